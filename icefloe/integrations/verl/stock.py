"""Stock verl 0.9.x (PyPI, no remote-backend seam): icefloe as a registered V1 trainer mode.

verl's own hooks are enough, no verl file is patched: ``register_trainer`` adds the trainer mode
``icefloe``; the trainer subclass builds the driver-side backend, then overrides
``_init_resource_pool_mgr`` to install icefloe's forwarder worker (with the backend handle bound
on a subclass, since verl passes workers no extra kwargs) on CPU-only resource pools. Replicas are
built by verl's ``LLMServerManager`` from ``rollout.name=icefloe`` and fetch the handle from the
forwarder in ``init_hybrid``. Weight sync goes through the ``naive`` checkpoint engine, i.e. the
worker's ``update_weights``. Imported only inside verl's TaskRunner (see ``launch.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import ray
from verl.single_controller.ray.base import RayResourcePool, ResourcePoolManager
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from icefloe.integrations.verl import NAME
from icefloe.integrations.verl.backend import IcefloeBackend
from icefloe.integrations.verl.worker_v1 import IcefloeV1ActorRolloutRefWorker
from icefloe.protocol import ConfigError

__all__ = ["CpuResourcePoolManager", "IcefloeTrainer"]

_FORWARDER_ROLES = (Role.ActorRollout, Role.ActorRolloutRef, Role.Actor, Role.RefPolicy)


class CpuResourcePoolManager(ResourcePoolManager):
    """Resource pools without GPU bundles: the forwarder computes nothing, icefloe owns the accelerators."""

    def create_resource_pool(self) -> None:
        for name, process_on_nodes in self.resource_pool_spec.items():
            self.resource_pool_dict[name] = RayResourcePool(
                process_on_nodes=process_on_nodes, use_gpu=False, max_colocate_count=1, name_prefix=name
            )


@register_trainer(NAME)
class IcefloeTrainer(PPOTrainerSync):
    """verl's synchronous V1 trainer with icefloe's forwarder and rollout replica substituted."""

    def __init__(self, config: Any) -> None:
        forwarders = int(config.trainer.n_gpus_per_node) * int(config.trainer.nnodes)
        if forwarders != 1:
            raise ConfigError(
                f"icefloe needs exactly one forwarder worker; got trainer.n_gpus_per_node × trainer.nnodes = "
                f"{forwarders}. Set both to 1 (icefloe's remote_backend.training_gpus sizes the training)"
            )
        self.icefloe_backend = IcefloeBackend.from_config(config)
        self.icefloe_handle = self.icefloe_backend.reconnect_handle()
        super().__init__(config)

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()
        bound = type(
            "IcefloeBoundV1Worker",
            (IcefloeV1ActorRolloutRefWorker,),
            {"bound_main_config": self.config, "bound_handle": self.icefloe_handle},
        )
        for role in _FORWARDER_ROLES:
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(bound)
        self.resource_pool_manager = CpuResourcePoolManager(
            resource_pool_spec=self.resource_pool_manager.resource_pool_spec, mapping=self.mapping
        )

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().fit(*args, **kwargs)
        finally:
            asyncio.run(self.icefloe_backend.destroy())
