"""``icefloe serve --engines ray``: a service job whose engines are Ray actors, driven by the remote client."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray as _ray  # noqa: F401 (the dev extra installs it: fail, never skip)
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)

from icefloe.client import Client
from icefloe.client.batch import build_batch
from icefloe.client.remote.admin import ServiceAdmin
from icefloe.config import RemoteConfig
from icefloe.protocol import IcefloeError
from icefloe.service.app import ServerThread, create_app
from icefloe.service.hosts.pool import make_engine_host
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.settings import ServeSettings

pytestmark = pytest.mark.integration


def test_make_engine_host_ray_names_the_choice():
    from icefloe.service.hosts.ray_hosts import RayEngineHost

    assert isinstance(make_engine_host("ray", [], {}, {}, Path("logs")), RayEngineHost)


@pytest.mark.slow  # ~10 s: a service, its Ray actors and a whole train-sync-sample round
def test_serve_with_ray_engines_trains_syncs_and_samples(ray_session, model_dir, tmp_path):
    settings = ServeSettings(data_dir=tmp_path / "serve", engines="ray", model_root=model_dir.parent)
    app = create_app(settings, pool=SlotPool("cpu", 2))
    with ServerThread(app) as base_url:
        config = {"model": str(model_dir), "max_seq_len": 48, "backend": {"type": "remote", "base_url": base_url}}
        with Client(config) as client:
            batch = build_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [1.0, -1.0], pad_id=0)
            result = client.fwd_bwd(batch)
            assert result["num_tokens"] == 5
            assert client.step()["global_step"] == 1
            assert client.sync_weights()["policy_version"] == 1
            sample = client.generate([[1, 2, 3]], {"max_tokens": 3, "logprobs": True})[0]
            assert sample["policy_version"] == 1 and len(sample["token_ids"]) == 3
            serving = serving_actors(ray_session)
            assert any("-training-" in name for name in serving) and any("-sampling-" in name for name in serving)
    assert not serving_actors(ray_session)  # closing the service released the job's actors


@pytest.mark.slow  # ~15 s: a service, one shared actor and two LoRA runs' rounds
def test_lora_jobs_on_ray_engines_share_one_base_actor_and_one_slot(ray_session, model_dir, tmp_path):
    settings = ServeSettings(data_dir=tmp_path / "serve", engines="ray", model_root=model_dir.parent)
    app = create_app(settings, pool=SlotPool("cpu", 1))  # one slot: a second run waits for ever unless it shares
    with ServerThread(app) as base_url:
        config = {
            "model": str(model_dir),
            "max_seq_len": 48,
            "lora": {"rank": 4, "alpha": 8},
            "job_ready_timeout_s": 60,
            "backend": {"type": "remote", "base_url": base_url},
        }
        batch = build_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [1.0, -1.0], pad_id=0)
        with Client(config) as first, Client(config) as second:
            losses = [client.fwd_bwd(batch)["loss"] for client in (first, second)]
            assert losses[0] == pytest.approx(losses[1], abs=1e-6)  # the same seed: the same fresh adapter
            assert first.step()["global_step"] == 1 and second.step()["global_step"] == 1
            assert first.sync_weights()["policy_version"] == 1
            sample = first.generate([[1, 2, 3]], {"max_tokens": 3, "logprobs": True})[0]
            assert sample["policy_version"] == 1 and len(sample["token_ids"]) == 3
            first.generate([[1, 2, 3]], {"max_tokens": 3, "stop_token_ids": [999]})  # the actor warns: not an id
            logs = [
                app.state.jobs.tail_logs(
                    client.handle()["transport"]["job_id"],
                    sub_job_id=None, sub_job_type="sampling", cursor=None, max_lines=50,
                )["entries"]
                for client in (first, second)
            ]  # fmt: skip
            warned = [[e["msg"] for e in entries if e["logger"] == "icefloe.engines.sampling"] for entries in logs]
            assert [len(messages) for messages in warned] == [1, 0], warned  # the first run's log alone
            with ServiceAdmin(RemoteConfig(base_url=base_url)) as admin:
                jobs = admin.list_jobs()
            hosts = {(job.get("host") or {}).get("host_id") for job in jobs}
            assert len(jobs) == 2 and len(hosts) == 1 and None not in hosts, jobs
            assert jobs[0]["host"]["shared"] and jobs[0]["host"]["num_jobs"] == 2
            serving = serving_actors(ray_session)
            assert [name for name in serving if name.startswith("icefloe-shared-base-")] == serving, serving
            assert len(serving) == 1

            ray_session.kill(ray_session.get_actor(serving[0], namespace="icefloe-serve"))
            for client in (first, second):  # a dead actor fails every job on it, naming the crash
                with pytest.raises(IcefloeError, match="Ray actor died"):
                    client.fwd_bwd(batch)
    assert not serving_actors(ray_session)  # closing the service released the shared actor


def serving_actors(ray) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "icefloe-serve"]
