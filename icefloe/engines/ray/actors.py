"""The Ray actor classes: one process per training rank, sampler replica or reference replica.

An actor holds one engine and the weight-sync groups it belongs to. Engine ops reach the engine
through :meth:`call`; the methods written out here are the ones that need the actor's own state
(process groups, CUDA IPC handles). Weights never travel through Ray's object store: only batches,
results and small metadata do.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import ray

from icefloe.config import ClientConfig

__all__ = ["SamplingActor", "TrainingActor"]


class _EngineActor:
    """What every engine actor has: its config and role, the engine, and its weight-sync links."""

    def __init__(self, config: ClientConfig, *, role: str, model_dir: str) -> None:
        import torch

        torch.set_num_threads(max(1, int(config.backend.num_cpus_per_worker)))
        self.config, self.role, self.model_dir = config, role, Path(model_dir)
        self.engine: Any = None
        self.links: dict[str, Any] = {}  # weight-sync groups by link id (WeightBroadcast)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run one engine method here (``fwd_bwd``, ``generate``, ``save_checkpoint``, ...)."""
        return getattr(self.engine, method)(*args, **kwargs)

    def rendezvous(self) -> tuple[str, int]:
        """An address and free port on this node for a group's TCP store."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), int(sock.getsockname()[1])

    def join_weight_sync(self, link: str, master: tuple[str, int], rank: int, world_size: int, backend: str) -> None:
        """Join the broadcast group ``link`` as ``rank`` (trainer rank 0 is its rank 0 and hosts the store)."""
        from icefloe.engines.distributed import WeightBroadcast

        device = str(getattr(self.engine, "device", "cuda" if backend == "nccl" else "cpu"))
        self.links[link] = WeightBroadcast(*master, rank, world_size, backend=backend, device=device)


class TrainingActor(_EngineActor):
    """One training (or reference) rank; ``start`` joins the ranks' default group, then loads the engine."""

    rank = 0
    _ipc_keepalive: list[Any] | tuple[()] = ()  # the tensors behind exported CUDA IPC handles

    def start(self, rank: int, world_size: int, master: tuple[str, int] | None, backend: str, device: str) -> None:
        """Join the data-parallel group (when there is one) and build the engine."""
        self.rank = rank
        if master is None:
            from icefloe.engines.training import TrainingEngine

            self.engine = TrainingEngine(self.config, device=device, role=self.role, model_dir=self.model_dir)
            return
        import torch.distributed as dist

        from icefloe.engines.distributed import DataParallelTrainingEngine

        host, port = master
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size)
        self.engine = DataParallelTrainingEngine(
            self.config, device=device, role=self.role, model_dir=self.model_dir, fsdp=self.config.backend.fsdp
        )

    def reset_optimizer(self) -> None:
        """Drop AdamW state (a run that starts from a checkpoint's weights but not its optimizer)."""
        if self.engine.optimizer is not None:
            self.engine.optimizer.state.clear()

    def weight_layout(self) -> list[Any]:
        """Names, shapes and dtypes only: a sharded (DTensor) parameter reports its global shape without a gather."""
        from icefloe.engines.distributed import weight_layout

        return weight_layout(self.engine.sync_parameters())  # with LoRA: the adapters only

    def send_weights(self, link: str, bucket_bytes: int) -> dict[str, Any]:
        """Broadcast the weights on ``link``; under FSDP every rank must run this (gathering is collective)."""
        start = time.perf_counter()
        if self.rank != 0:
            for _ in self.engine.named_weights():
                pass
            return {}
        version = self.engine.global_step
        sent = self.links[link].send(self.engine.named_weights(), version, bucket_bytes)
        return {"policy_version": version, "seconds": time.perf_counter() - start, "bytes": sent}

    def export_cuda_ipc(self) -> tuple[list[Any], int]:
        """Handles to this rank's CUDA weights and their version, kept alive until :meth:`release_cuda_ipc`."""
        from icefloe.engines.distributed import export_cuda_ipc

        named = [(name, t.contiguous()) for name, t in self.engine.named_weights()]
        self._ipc_keepalive = named
        return export_cuda_ipc(named), self.engine.global_step

    def release_cuda_ipc(self) -> None:
        self._ipc_keepalive = ()


class SamplingActor(_EngineActor):
    """One sampler replica (torch on CPU, vLLM on GPU when installed)."""

    def start(self, device: str, replica: int) -> None:
        """Build the engine; replica k's generator starts from ``seed + k``, so replicas never draw alike.

        A request with its own ``seed`` samples the same on every replica (its rows' seeds come from it alone).
        """
        from icefloe.engines.sampling import build_sampling_engine

        config = self.config.model_copy(update={"seed": self.config.seed + replica})
        self.engine = build_sampling_engine(config, device, model_dir=self.model_dir)

    def receive_weights(self, link: str, layout: list[Any], bucket_bytes: int) -> dict[str, Any]:
        """Receive one broadcast into the sampler's parameters in place; the version comes with it."""
        received, version = self.links[link].receive(layout, self.engine.load_weights, bucket_bytes)
        return {"policy_version": version, "bytes": received}

    def import_cuda_ipc(self, handles: list[Any], policy_version: int) -> dict[str, Any]:
        import torch

        from icefloe.engines.distributed import import_cuda_ipc

        tensors = list(import_cuda_ipc(handles, torch.cuda.current_device()))
        copied = self.engine.load_weights(tensors, policy_version=policy_version)
        return {"policy_version": policy_version, "bytes": copied}
