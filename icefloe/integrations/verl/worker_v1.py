"""The forwarder worker for verl's V1 trainer (TransferQueue batches, ``ActorRolloutRefWorker`` base).

V1 requires a subclass of verl's ``ActorRolloutRefWorker``; its ``__init__`` is skipped because it
builds FSDP/Megatron engines icefloe replaces. ``@register`` on V1 makes methods synchronous, so
each one drives the async client on the worker's one persistent :class:`BackgroundLoop`.
"""

from __future__ import annotations

from typing import Any

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker

from icefloe.integrations.verl.forwarder import BackgroundLoop, read_fields, read_options
from icefloe.integrations.verl.worker_controls import ForwarderControls
from icefloe.protocol import ConfigError

__all__ = ["IcefloeV1ActorRolloutRefWorker"]

_ROLES = ("actor", "rollout", "ref", "actor_rollout", "actor_rollout_ref")


class IcefloeV1ActorRolloutRefWorker(ForwarderControls, ActorRolloutRefWorker):
    """CPU-only V1 forwarder; nested batches are densified to the config's maximum lengths."""

    how_to_launch = (
        "select the trainer with remote_backend=icefloe "
        "(or launch with python -m icefloe.integrations.verl.launch on stock verl)"
    )

    def __init__(self, config: Any, role: str, distillation_config: Any = None, **kwargs: Any) -> None:
        Worker.__init__(self)
        if role not in _ROLES:
            raise ConfigError(f"icefloe worker role must be one of {list(_ROLES)}; got {role!r}")
        self.config = config
        self.role = role
        self.distillation_config = distillation_config
        self.actor = self.ref = self.rollout = None
        self._is_actor = role in ("actor", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_rollout_ref")
        self.enable_routing_replay = False
        self._loop = BackgroundLoop()
        self._attach(config, kwargs, nested_batches=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: Any) -> Any:
        return self._log_prob(data, ref=False)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_log_prob(self, data: Any) -> Any:
        return self._log_prob(data, ref=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: Any) -> Any:
        extras = self._loop.run(self._forwarder.update_actor(read_fields(data, tu.get), read_options(data, tu.get)))
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict=extras)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        return self._loop.run(self._forwarder.update_weights())  # icefloe moves the weights whatever the mode

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def save_checkpoint(self, *verl_paths: Any, **verl_options: Any) -> dict[str, Any]:
        # icefloe stores it: verl's local_path, hdfs_path, global_step and max_ckpt_to_keep do not apply
        return self._loop.run(self._forwarder.save_checkpoint())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False):
        return None  # icefloe resumes when its backend starts, not through verl's per-worker files

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def destroy(self) -> None:
        try:
            self._loop.run(self._forwarder.destroy())
        finally:
            self._loop.close()

    def _log_prob(self, data: Any, *, ref: bool) -> Any:
        outputs, extras = self._loop.run(
            self._forwarder.compute_log_prob(read_fields(data, tu.get), read_options(data, tu.get), ref=ref)
        )
        return tu.get_tensordict(tensor_dict=outputs, non_tensor_dict=extras)
