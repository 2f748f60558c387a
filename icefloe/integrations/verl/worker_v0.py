"""The forwarder worker for verl's V0 seam (``RemoteBackendTrainer``, verl ``release/v0.7.1``).

A free-standing verl ``Worker`` with async methods; verl's ``@register`` keeps them coroutines
on V0. Loaded lazily by the registry, so verl's worker machinery is imported only in processes
that build a worker.
"""

from __future__ import annotations

from typing import Any

from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu

from icefloe.integrations.verl.forwarder import read_fields, read_options
from icefloe.integrations.verl.worker_controls import ForwarderControls

__all__ = ["IcefloeActorRolloutRefWorker"]


class IcefloeActorRolloutRefWorker(ForwarderControls, Worker):
    """CPU-only forwarder: verl dispatches here, icefloe computes."""

    how_to_launch = (
        "run it under verl's remote-backend trainer (trainer.remote_backend=icefloe) so the driver's backend is shared"
    )

    def __init__(self, config: Any, role: str, **kwargs: Any) -> None:
        Worker.__init__(self)
        self.config = config
        self.role = role
        self._attach(config, kwargs, nested_batches=False)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    async def compute_log_prob(self, data: Any) -> Any:
        outputs, extras = await self._forwarder.compute_log_prob(
            read_fields(data, tu.get), read_options(data, tu.get), ref=False
        )
        return tu.get_tensordict(tensor_dict=outputs, non_tensor_dict=extras)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    async def compute_ref_log_prob(self, data: Any) -> Any:
        outputs, extras = await self._forwarder.compute_log_prob(
            read_fields(data, tu.get), read_options(data, tu.get), ref=True
        )
        return tu.get_tensordict(tensor_dict=outputs, non_tensor_dict=extras)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    async def update_actor(self, data: Any) -> Any:
        extras = await self._forwarder.update_actor(read_fields(data, tu.get), read_options(data, tu.get))
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict=extras)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None) -> dict[str, Any]:
        return await self._forwarder.update_weights()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def save_checkpoint(self, *verl_paths: Any, **verl_options: Any) -> dict[str, Any]:
        # icefloe stores it: verl's local_path, hdfs_path, global_step and max_ckpt_to_keep do not apply
        return await self._forwarder.save_checkpoint()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def sleep_replicas(self) -> None:
        return None  # replicas sleep through their own servers

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def destroy(self) -> None:
        await self._forwarder.destroy()
