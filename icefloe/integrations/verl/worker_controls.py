"""The control methods both forwarder workers (V0 and V1) expose to verl, defined once.

verl dispatches these to every worker; icefloe owns device residency, the loss and engine state,
so all but ``init_model`` and the handle lookup are no-ops. Imported only by the worker modules,
so verl's worker machinery loads only in processes that build a worker.
"""

from __future__ import annotations

from typing import Any

from verl.single_controller.base.decorator import Dispatch, register

from icefloe.integrations.verl.forwarder import Forwarder, flops_estimator
from icefloe.integrations.verl.settings import select
from icefloe.protocol import ConfigError

__all__ = ["ForwarderControls"]


class ForwarderControls:
    """Mixed in before verl's worker base so these methods win over any base definitions.

    ``bound_main_config`` / ``bound_handle`` stand in for the ``main_config`` / ``backend_handle``
    kwargs when a launcher binds them to a subclass instead of passing them.
    """

    bound_main_config: Any = None
    bound_handle: dict[str, Any] | None = None
    how_to_launch = ""  # each worker says how verl must be launched to hand it the backend handle
    _handle: dict[str, Any]
    _forwarder: Forwarder

    def _attach(self, config: Any, kwargs: dict[str, Any], *, nested_batches: bool) -> None:
        handle = kwargs.get("backend_handle", self.bound_handle)
        if handle is None:
            raise ConfigError(f"the icefloe worker got no backend_handle; {self.how_to_launch}")
        self._handle = handle
        self._forwarder = Forwarder.attach(
            kwargs.get("main_config", self.bound_main_config), handle, nested_batches=nested_batches
        )
        self._forwarder.set_flops_estimator(flops_estimator(select(config, "model.path")))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        for mesh in ("actor", "ref", "rollout"):
            self._register_dispatch_collect_info(mesh, dp_rank=self.rank, is_collect=True)  # type: ignore[attr-defined]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def to(self, device: Any, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        return None  # icefloe owns device residency

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_fn(self, loss_fn: Any) -> None:
        return None  # the loss travels with each fwd_bwd

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self) -> None:
        return None  # icefloe owns engine state

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def icefloe_backend_handle(self) -> dict[str, Any]:
        """The handle rollout replicas re-attach with when nobody passed it to them."""
        return self._handle
