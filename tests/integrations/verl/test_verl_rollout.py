"""The rollout replica and its server actor (run in-process; Ray only carries them in production)."""

from __future__ import annotations

import asyncio

import pytest

from icefloe.protocol import InvalidRequestError


def test_server_generates_from_token_ids_and_tags_the_policy(load_plugin, make_config) -> None:
    load_plugin(v1=True)
    from verl.remote_backend.base import RemoteBackendRegistry
    from verl.workers.rollout.replica import TokenOutput

    from icefloe.integrations.verl.rollout import IcefloeLLMServer

    driver = RemoteBackendRegistry.create("icefloe", make_config())

    async def scenario() -> None:
        server = IcefloeLLMServer(make_config(), driver.reconnect_handle())
        first = await server.generate([3, 4, 5], {"temperature": 0.0, "max_tokens": 3}, "a")
        assert isinstance(first, TokenOutput) and first.stop_reason == "completed"
        assert first.log_probs is None and 1 <= len(first.token_ids) <= 3
        assert first.extra_fields["global_steps"] == 0  # no sync yet: the sampler's initial version
        await server.set_global_steps(7)
        await server.sleep()
        await server.wake_up()
        again = await server.generate([3, 4, 5], {"temperature": 0.0, "max_tokens": 3}, "b")
        assert again.token_ids == first.token_ids and again.extra_fields["global_steps"] == 7
        with pytest.raises(InvalidRequestError, match="text token ids only"):
            await server.generate([3], {}, "c", image_data=[object()])
        await server.destroy()
        await driver.destroy()

    asyncio.run(scenario())


class _WorkerGroup:
    """What a verl RayWorkerGroup exposes to a replica: its workers and ONE_TO_ALL methods."""

    def __init__(self, handle: dict) -> None:
        self.workers = ["forwarder-0"]
        self._handle = handle

    def icefloe_backend_handle(self) -> list[dict]:
        return [self._handle]


def test_replica_takes_the_handle_from_the_forwarder_when_not_passed(load_plugin, monkeypatch) -> None:
    plugin = load_plugin()
    from verl.workers.rollout.replica import RolloutMode, RolloutReplicaRegistry

    replica_cls = RolloutReplicaRegistry.get(plugin.NAME)
    replica = replica_cls(replica_rank=0, config={"free_cache_engine": True}, model_config={}, gpus_per_node=8)
    launched = []

    async def launch() -> None:
        launched.append(replica.backend_handle)

    monkeypatch.setattr(replica, "launch_servers", launch)
    asyncio.run(replica.init_hybrid(_WorkerGroup({"client": {}, "settings": {}})))
    assert launched == [{"client": {}, "settings": {}}]
    assert replica.rollout_mode is RolloutMode.HYBRID and replica.workers == ["forwarder-0"]
    assert replica.rollout_worker_use_gpu() is False
    passed = replica_cls(0, {}, {}, main_config={"a": 1}, backend_handle={"h": 1}, is_teacher_model=False)
    assert (passed.main_config, passed.backend_handle) == ({"a": 1}, {"h": 1})
