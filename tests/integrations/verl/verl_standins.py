"""Stand-in ``verl`` modules that mirror the registry and worker APIs icefloe's plugin touches.

verl itself cannot be installed next to icefloe (it pins transformers < 5.11), so the tests put
these into ``sys.modules``. They follow verl's behaviour where the plugin depends on it: the
registries' dedupe / collision rules, loaders called on ``get``, ``TokenOutput``'s fields, and
``ActorRolloutRefWorker.__init__`` building engines (here: refusing to run, so skipping it is tested).
Also importable on its own so a subprocess can install the same modules.
"""

from __future__ import annotations

import abc
import enum
import sys
import types
from collections.abc import Callable, MutableMapping
from typing import Any, ClassVar

from pydantic import BaseModel

V1_PROBE = "verl.trainer.ppo.v1.trainer_remote_backend"


def build(*, v1: bool = False, seam: bool = True) -> dict[str, types.ModuleType]:
    """Fresh stand-in modules; ``v1`` adds the probe module, ``seam=False`` mimics PyPI verl."""
    modules: dict[str, types.ModuleType] = {}

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # every stand-in is a package, so submodule imports resolve through sys.modules
        modules[name] = mod
        return mod

    for name in ("verl", "verl.workers", "verl.workers.rollout", "verl.single_controller", "verl.utils"):
        module(name)
    if seam:
        module("verl.remote_backend")
        module(
            "verl.remote_backend.base",
            RemoteBackend=_make_remote_backend(),
            RemoteBackendRegistry=_make_registry(),
        )
    module(
        "verl.workers.rollout.replica",
        RolloutReplica=RolloutReplica,
        RolloutMode=RolloutMode,
        TokenOutput=TokenOutput,
        RolloutReplicaRegistry=_make_replica_registry(),
    )
    module("verl.single_controller.base", Worker=Worker)
    module(
        "verl.single_controller.base.decorator",
        Dispatch=Dispatch,
        register=register,
        make_nd_compute_dataproto_dispatch_fn=make_nd_compute_dataproto_dispatch_fn,
    )
    module("verl.utils.tensordict_utils", get=td_get, get_tensordict=get_tensordict)
    module("verl.workers.engine_workers", ActorRolloutRefWorker=ActorRolloutRefWorker)
    if v1:
        for name in ("verl.trainer", "verl.trainer.ppo", "verl.trainer.ppo.v1", V1_PROBE):
            module(name)
    return modules


def install(target: MutableMapping[str, Any] | None = None, **kwargs: Any) -> dict[str, types.ModuleType]:
    modules = build(**kwargs)
    (sys.modules if target is None else target).update(modules)
    return modules


# --- verl.remote_backend.base -------------------------------------------------------------------
def _make_remote_backend() -> type:
    class RemoteBackend(abc.ABC):
        @classmethod
        @abc.abstractmethod
        def from_config(cls, main_config, *, handle=None): ...

        @abc.abstractmethod
        def reconnect_handle(self): ...

        @abc.abstractmethod
        def destroy(self): ...

        @abc.abstractmethod
        async def update_weights(self): ...

        @abc.abstractmethod
        async def save_checkpoint(self): ...

        @abc.abstractmethod
        def requires_single_forwarder(self): ...

    return RemoteBackend


def _make_registry() -> type:
    class RemoteBackendRegistry:
        _backends: ClassVar[dict[str, type]] = {}
        _workers: ClassVar[dict[str, Callable[[], type]]] = {}
        _worker_cache: ClassVar[dict[str, type]] = {}

        @classmethod
        def register(cls, name: str):
            def decorate(backend_cls: type) -> type:
                existing = cls._backends.get(name)
                if existing is not None and existing is not backend_cls:
                    raise ValueError(f"remote backend {name!r} is already registered to {existing!r}")
                cls._backends[name] = backend_cls
                return backend_cls

            return decorate

        @classmethod
        def get(cls, name: str) -> type:
            if name not in cls._backends:
                raise KeyError(f"unknown remote backend {name!r}; import its module via VERL_USE_EXTERNAL_MODULES")
            return cls._backends[name]

        @classmethod
        def create(cls, name: str, main_config: Any) -> Any:
            return cls.get(name).from_config(main_config)

        @classmethod
        def list(cls) -> list[str]:
            return sorted(cls._backends)

        @classmethod
        def register_worker(cls, name: str, loader: Callable[[], type]) -> None:
            existing = cls._workers.get(name)
            if existing is not None and existing is not loader:
                raise ValueError(f"a worker loader for {name!r} is already registered")
            cls._workers[name] = loader

        @classmethod
        def get_worker(cls, name: str) -> type | None:
            if name not in cls._workers:
                return None
            if name not in cls._worker_cache:
                cls._worker_cache[name] = cls._workers[name]()
            return cls._worker_cache[name]

    return RemoteBackendRegistry


# --- verl.workers.rollout.replica ---------------------------------------------------------------
class TokenOutput(BaseModel):
    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any | None = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = {}


class RolloutMode(enum.Enum):
    HYBRID = "hybrid"
    COLOCATED = "colocated"
    STANDALONE = "standalone"


class RolloutReplica(abc.ABC):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("the icefloe replica must not run RolloutReplica.__init__ (it sizes GPU worlds)")

    @abc.abstractmethod
    async def launch_servers(self): ...


def _make_replica_registry() -> type:
    class RolloutReplicaRegistry:
        _registry: ClassVar[dict[str, Callable[[], type]]] = {}

        @classmethod
        def register(cls, name: str, loader: Callable[[], type]) -> None:
            cls._registry[name] = loader

        @classmethod
        def get(cls, name: str) -> type:
            if name not in cls._registry:
                raise ValueError(f"Unknown rollout mode: {name}. Available: {list(cls._registry)}")
            return cls._registry[name]()

    return RolloutReplicaRegistry


# --- verl.single_controller ---------------------------------------------------------------------
class Worker:
    def __init__(self) -> None:
        self.rank = 0
        self.dispatch_info: dict[str, tuple[int, bool]] = {}

    def _register_dispatch_collect_info(self, mesh_name: str, dp_rank: int, is_collect: bool) -> None:
        self.dispatch_info[mesh_name] = (dp_rank, is_collect)


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, str]:
    return {"mesh_name": mesh_name}


def register(dispatch_mode: Any = None, blocking: bool = True, **_: Any):
    def decorate(fn: Callable) -> Callable:
        fn.verl_dispatch = {"dispatch_mode": dispatch_mode, "blocking": blocking}
        return fn

    return decorate


class ActorRolloutRefWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("ActorRolloutRefWorker.__init__ builds FSDP engines; the icefloe worker must skip it")


# --- verl.utils.tensordict_utils ----------------------------------------------------------------
def td_get(data: Any, key: str, default: Any = None) -> Any:
    return data.get(key, default)


def get_tensordict(tensor_dict: dict[str, Any], non_tensor_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**tensor_dict, **(non_tensor_dict or {})}
