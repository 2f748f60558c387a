"""Engines as Ray actors: one actor per data-parallel training rank, sampler or reference replica.

The actor classes hold an engine and a torch.distributed membership; the driver-side groups
(:class:`TrainerGroup`, :class:`SamplerGroup`) fan a call out to their actors, wait without hanging
on a dead one, and reduce the answers. :func:`link_weight_sync` wires trainer rank 0 and a set of
samplers into their own broadcast group. Both the ``ray`` transport and the service's Ray engine
host build on these pieces. Weights never travel through Ray's object store: only batches, results
and small metadata do.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from icefloe.config import ClientConfig, RayConfig
from icefloe.protocol import IcefloeError, IcefloeTimeoutError, JobFailedError, SamplingParams

__all__ = [
    "SamplerGroup",
    "SamplingActor",
    "TrainerGroup",
    "TrainingActor",
    "WorkerSpec",
    "actor_failures",
    "collective_backend",
    "link_weight_sync",
    "plan_placement",
]

ROLES = ("training", "sampling", "reference")


# --- failures ----------------------------------------------------------------------------------
@contextlib.contextmanager
def actor_failures(job_name: str, actor_name: str) -> Iterator[None]:
    """Turn Ray's failure types into the error tree: a dead actor is a :class:`JobFailedError`.

    An engine error raised inside an actor (an ``IcefloeError`` such as ``InvalidRequestError``)
    comes back as itself, chained to Ray's wrapper so the remote traceback stays visible.
    """
    try:
        yield
    except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
        raise JobFailedError(
            job_name, "failed", f"actor {actor_name} died: {_first_line(exc)}", {actor_name: "dead"}
        ) from exc
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, IcefloeError):
            raise cause from exc
        raise JobFailedError(
            job_name, "failed", f"actor {actor_name} raised {type(cause).__name__}: {cause}", {actor_name: "error"}
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def gather(job_name: str, calls: Sequence[tuple[str, ray.ObjectRef]], timeout_s: float | None = None) -> list[Any]:
    """Results of ``(actor_name, ref)`` pairs in order; the first failure raises at once.

    Waiting on all refs together means a dead rank surfaces immediately instead of after its live
    peers (which may be blocked in a collective with it) return.
    """
    pending = {ref: index for index, (_, ref) in enumerate(calls)}
    results: list[Any] = [None] * len(calls)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
        if not ready:
            names = sorted(calls[i][0] for i in pending.values())
            raise IcefloeTimeoutError(f"job {job_name}: actors {names} did not answer within {timeout_s}s")
        for ref in ready:
            index = pending.pop(ref)
            with actor_failures(job_name, calls[index][0]):
                results[index] = ray.get(ref)
    return results


# --- placement ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One actor to create: its role, index within the role, actor name and placement bundle."""

    role: str
    index: int
    name: str
    bundle: int


def collective_backend(ray_config: RayConfig) -> str:
    """``gloo`` on CPU workers, ``nccl`` on GPU workers, unless the config names one."""
    if ray_config.collective_backend != "auto":
        return ray_config.collective_backend
    return "nccl" if ray_config.num_gpus_per_worker > 0 else "gloo"


def worker_resources(ray_config: RayConfig) -> dict[str, float]:
    resources = {"CPU": ray_config.num_cpus_per_worker}
    if ray_config.num_gpus_per_worker > 0:
        resources["GPU"] = ray_config.num_gpus_per_worker
    return resources


def plan_placement(job_name: str, counts: dict[str, int], ray_config: RayConfig) -> tuple[list[dict], list[WorkerSpec]]:
    """Bundles of one placement group and which bundle each worker uses.

    Separate placement: one bundle per worker. Colocated: bundle ``i`` holds worker ``i`` of every
    role, its resources the sum of theirs, so fractional per-worker GPUs (e.g. 0.5 each) share one
    device.
    """
    per_worker = worker_resources(ray_config)
    workers: list[WorkerSpec] = []
    bundles: list[dict[str, float]] = []
    for role in ROLES:
        for index in range(counts.get(role, 0)):
            if ray_config.colocate:
                bundle = index
                while len(bundles) <= bundle:
                    bundles.append({key: 0.0 for key in per_worker})
                for key, value in per_worker.items():
                    bundles[bundle][key] += value
            else:
                bundle = len(bundles)
                bundles.append(dict(per_worker))
            workers.append(WorkerSpec(role, index, f"{job_name}-{role}-{index}", bundle))
    return bundles, workers


def create_placement_group(
    job_name: str, bundles: list[dict], ray_config: RayConfig, timeout_s: float
) -> PlacementGroup:
    """Reserve the bundles; an unsatisfiable request fails with what was asked instead of waiting forever."""
    lifetime = "detached" if ray_config.detached else None
    group = placement_group(bundles, strategy=ray_config.placement_strategy, name=f"{job_name}-pg", lifetime=lifetime)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise IcefloeTimeoutError(
            f"job {job_name}: the Ray cluster could not reserve {bundles} ({ray_config.placement_strategy}) within "
            f"{timeout_s:.0f}s; lower backend.num_cpus_per_worker / num_gpus_per_worker, use fewer workers, or add "
            f"nodes (cluster has {ray.cluster_resources()})"
        ) from None
    return group


# --- the actors --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _limit_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


class TrainingActor:
    """One training (or reference) rank. ``start`` joins the ranks' default group, then loads the engine."""

    def __init__(self, config: ClientConfig, *, role: str, rank: int, world_size: int, model_dir: str) -> None:
        _limit_threads(config.backend.num_cpus_per_worker)
        self.config, self.role, self.rank, self.world_size = config, role, rank, world_size
        self.model_dir = Path(model_dir)
        self.engine: Any = None
        self._links: dict[str, Any] = {}
        self._ipc_keepalive: list[Any] = []

    def rendezvous(self) -> tuple[str, int]:
        """An address and free port on this node for a group's TCP store."""
        return ray.util.get_node_ip_address(), _free_port()

    def start(self, master: tuple[str, int] | None, backend: str, device: str) -> int:
        """Join the data-parallel group (when there is one) and build the engine; returns this pid."""
        from icefloe.engines.training import TrainingEngine

        ray_config = self.config.backend
        if master is not None:
            import torch.distributed as dist

            from icefloe.engines.distributed import DataParallelTrainingEngine

            host, port = master
            dist.init_process_group(
                backend, init_method=f"tcp://{host}:{port}", rank=self.rank, world_size=self.world_size
            )
            self.engine = DataParallelTrainingEngine(
                self.config, device=device, role=self.role, model_dir=self.model_dir, fsdp=ray_config.fsdp
            )
        else:
            self.engine = TrainingEngine(self.config, device=device, role=self.role, model_dir=self.model_dir)
        return os.getpid()

    def fwd_bwd(self, shard: dict[str, Any]) -> dict[str, Any]:
        return self.engine.fwd_bwd(shard)

    def forward(self, shard: dict[str, Any]) -> dict[str, Any]:
        return self.engine.forward(shard)

    def step(self, learning_rate: float | None) -> dict[str, Any]:
        return self.engine.step(learning_rate)

    def save_checkpoint(self, root: str, kind: str) -> dict[str, Any]:
        return self.engine.save_checkpoint(root, kind=kind)

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        return self.engine.load_checkpoint(path)

    def sleep(self) -> dict[str, Any]:
        return self.engine.sleep()

    def reset_optimizer(self) -> None:
        """Drop AdamW state (a run that starts from a checkpoint's weights but not its optimizer)."""
        if self.engine.optimizer is not None:
            self.engine.optimizer.state.clear()

    def wake(self) -> dict[str, Any]:
        return self.engine.wake()

    def weights_digest(self) -> float:
        """Σ of every weight (a cheap fingerprint: equal replicas give equal sums)."""
        return float(sum(float(t.double().sum()) for _, t in self.engine.named_weights()))

    def weight_layout(self) -> list[Any]:
        from icefloe.engines.distributed import weight_layout

        # Shapes and dtypes only: a sharded (DTensor) parameter reports its global shape without a gather.
        return weight_layout(self.engine.model.named_parameters())

    def join_weight_sync(self, link: str, master: tuple[str, int], world_size: int, backend: str) -> None:
        """Rank 0 hosts the link's store as broadcast rank 0; other training ranks are not members."""
        from icefloe.engines.distributed import WeightBroadcast

        if self.rank == 0:
            device = str(self.engine.device)
            self._links[link] = WeightBroadcast(*master, 0, world_size, backend=backend, device=device)

    def send_weights(self, link: str, bucket_bytes: int) -> dict[str, Any]:
        """Broadcast the weights on ``link``; under FSDP every rank must run this (gathering is collective)."""
        start = time.perf_counter()
        if self.rank != 0:
            for _ in self.engine.named_weights():
                pass
            return {}
        version = self.engine.global_step
        sent = self._links[link].send(self.engine.named_weights(), version, bucket_bytes)
        return {"policy_version": version, "seconds": time.perf_counter() - start, "bytes": sent}

    def raw_broadcast(self, link: str, num_bytes: int) -> float:
        """Broadcast ``num_bytes`` of one flat tensor on ``link``; returns seconds (the benchmark's baseline)."""
        return _raw_broadcast(self._links[link], num_bytes)

    def export_cuda_ipc(self) -> list[Any]:
        """Handles to this rank's CUDA weights, kept alive until :meth:`release_cuda_ipc`."""
        from icefloe.engines.distributed import export_cuda_ipc

        named = [(name, t.contiguous()) for name, t in self.engine.named_weights()]
        self._ipc_keepalive = named
        return export_cuda_ipc(named)

    def release_cuda_ipc(self) -> None:
        self._ipc_keepalive = []

    def global_step(self) -> int:
        return self.engine.global_step

    def placement(self) -> dict[str, Any]:
        """Where Ray put this actor: its placement group and the resources it holds there."""
        return _placement()


class SamplingActor:
    """One sampler replica (torch on CPU, vLLM on GPU when installed)."""

    def __init__(self, config: ClientConfig, *, index: int, model_dir: str) -> None:
        _limit_threads(config.backend.num_cpus_per_worker)
        self.config, self.index = config, index
        self.model_dir = Path(model_dir)
        self.engine: Any = None
        self._links: dict[str, Any] = {}

    def start(self, device: str) -> int:
        from icefloe.engines.sampling import build_sampling_engine

        self.engine = build_sampling_engine(self.config, device, model_dir=self.model_dir)
        return os.getpid()

    def generate(self, prompts: list[Any], params: list[SamplingParams]) -> list[dict[str, Any]]:
        return self.engine.generate(prompts, params)

    def sleep(self, level: int) -> dict[str, Any]:
        return self.engine.sleep(level)

    def wake(self) -> dict[str, Any]:
        return self.engine.wake()

    def reset_prefix_cache(self) -> dict[str, Any]:
        return self.engine.reset_prefix_cache()

    def policy_version(self) -> int:
        return int(self.engine.policy_version)

    def join_weight_sync(self, link: str, master: tuple[str, int], rank: int, world_size: int, backend: str) -> None:
        from icefloe.engines.distributed import WeightBroadcast

        device = str(getattr(self.engine, "device", "cuda" if backend == "nccl" else "cpu"))
        self._links[link] = WeightBroadcast(*master, rank, world_size, backend=backend, device=device)

    def receive_weights(self, link: str, layout: list[Any], bucket_bytes: int) -> dict[str, Any]:
        """Receive one broadcast into the sampler's parameters in place; the version comes with it."""
        received, version = self._links[link].receive(layout, self.engine.load_weights, bucket_bytes)
        return {"policy_version": version, "bytes": received}

    def import_cuda_ipc(self, handles: list[Any], policy_version: int) -> dict[str, Any]:
        import torch

        from icefloe.engines.distributed import import_cuda_ipc

        tensors = list(import_cuda_ipc(handles, torch.cuda.current_device()))
        copied = self.engine.load_weights(tensors, policy_version=policy_version)
        return {"policy_version": policy_version, "bytes": copied}

    def raw_broadcast(self, link: str, num_bytes: int) -> float:
        return _raw_broadcast(self._links[link], num_bytes)

    def placement(self) -> dict[str, Any]:
        """Where Ray put this actor: its placement group and the resources it holds there."""
        return _placement()


def _placement() -> dict[str, Any]:
    context = ray.get_runtime_context()
    return {"placement_group_id": context.get_placement_group_id(), "resources": context.get_assigned_resources()}


def _raw_broadcast(link: Any, num_bytes: int) -> float:
    import torch

    flat = torch.empty(num_bytes // 4, dtype=torch.float32, device=link.device)
    link.broadcast(flat)  # warm-up: the first collective on a group pays its connection set-up
    start = time.perf_counter()
    link.broadcast(flat)
    return time.perf_counter() - start


# --- driver-side groups ------------------------------------------------------------------------
def _actor_options(spec: WorkerSpec, ray_config: RayConfig, group: PlacementGroup | None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": spec.name,
        "namespace": ray_config.namespace,
        "num_cpus": ray_config.num_cpus_per_worker,
        "num_gpus": ray_config.num_gpus_per_worker,
        "max_restarts": 0,
    }
    if ray_config.detached:
        options["lifetime"] = "detached"
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=spec.bundle
        )
    return options


def _device(ray_config: RayConfig) -> str:
    return "cuda" if ray_config.num_gpus_per_worker > 0 else "cpu"


class TrainerGroup:
    """The data-parallel ranks of one training (or reference) role, driven as one engine."""

    def __init__(self, job_name: str, role: str, names: list[str], actors: list[Any], timeout_s: float) -> None:
        self.job_name, self.role, self.names, self.actors = job_name, role, names, actors
        self.timeout_s = timeout_s
        self.layout: list[Any] | None = None
        self._ray_config: RayConfig | None = None  # set by create(); attached groups never start ranks

    @classmethod
    def create(
        cls, config: ClientConfig, specs: list[WorkerSpec], group: PlacementGroup | None, model_dir: Path
    ) -> TrainerGroup:
        """Create the rank actors (their processes start now); :meth:`start_calls` loads the engines."""
        ray_config: RayConfig = config.backend
        remote = ray.remote(TrainingActor)
        actors = [
            remote.options(**_actor_options(spec, ray_config, group)).remote(
                config, role=spec.role, rank=rank, world_size=len(specs), model_dir=str(model_dir)
            )
            for rank, spec in enumerate(specs)
        ]
        job_name = specs[0].name.rsplit(f"-{specs[0].role}-", 1)[0]
        trainers = cls(job_name, specs[0].role, [s.name for s in specs], actors, config.job_ready_timeout_s)
        trainers._ray_config = ray_config
        return trainers

    def start_calls(self) -> list[tuple[str, Any]]:
        """Pending ``start`` calls of every rank (after rank 0 picked the group's rendezvous port)."""
        ray_config = self._ray_config
        needs_group = self.world_size > 1 or (ray_config.fsdp and self.role == "training")
        master = self._call_one(0, "rendezvous") if needs_group else None
        backend = collective_backend(ray_config)
        return [(n, a.start.remote(master, backend, _device(ray_config))) for n, a in self.members]

    @classmethod
    def launch(
        cls, config: ClientConfig, specs: list[WorkerSpec], group: PlacementGroup | None, model_dir: Path
    ) -> TrainerGroup:
        """Create the ranks and wait until every engine is loaded."""
        trainers = cls.create(config, specs, group, model_dir)
        gather(trainers.job_name, trainers.start_calls(), trainers.timeout_s)
        return trainers

    @classmethod
    def attach(cls, job_name: str, role: str, names: list[str], namespace: str, timeout_s: float) -> TrainerGroup:
        return cls(job_name, role, names, [_get_actor(job_name, n, namespace) for n in names], timeout_s)

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def members(self) -> list[tuple[str, Any]]:
        """``(actor name, actor handle)`` per rank."""
        return list(zip(self.names, self.actors, strict=True))

    def _call_one(self, rank: int, method: str, *args: Any) -> Any:
        ref = getattr(self.actors[rank], method).remote(*args)
        return gather(self.job_name, [(self.names[rank], ref)], self.timeout_s)[0]

    def _call_all(self, method: str, *per_rank_args: tuple[Any, ...]) -> list[Any]:
        calls = [
            (name, getattr(actor, method).remote(*args))
            for name, actor, args in zip(self.names, self.actors, per_rank_args, strict=True)
        ]
        return gather(self.job_name, calls)

    def _same_call(self, method: str, *args: Any) -> list[Any]:
        return self._call_all(method, *[args] * self.world_size)

    # --- engine methods --------------------------------------------------------------------------
    def fwd_bwd(self, frame: dict[str, Any]) -> dict[str, Any]:
        from icefloe.engines.distributed import combine_fwd_bwd, shard_rows

        shards, _ = shard_rows(frame, self.world_size)
        return combine_fwd_bwd(self._call_all("fwd_bwd", *[(s,) for s in shards]))

    def forward(self, frame: dict[str, Any]) -> dict[str, Any]:
        from icefloe.engines.distributed import concat_forward, shard_rows

        shards, real_rows = shard_rows(frame, self.world_size)
        return concat_forward(self._call_all("forward", *[(s,) for s in shards]), real_rows)

    def step(self, learning_rate: float | None = None) -> dict[str, Any]:
        results = self._same_call("step", learning_rate)
        first = results[0]
        if "peak_memory" in first:  # the job-wide GPU high-water mark; the CPU one is rank 0's
            first = {**first, "peak_memory": {**first["peak_memory"]}}
            first["peak_memory"]["gpu_peak"] = max(r["peak_memory"]["gpu_peak"] for r in results)
        return first

    def save_checkpoint(self, root: Path | str, kind: str = "resumable") -> dict[str, Any]:
        return self._same_call("save_checkpoint", str(root), kind)[0]

    def load_checkpoint(self, path: Path | str) -> dict[str, Any]:
        return self._same_call("load_checkpoint", str(path))[0]

    def sleep(self) -> dict[str, Any]:
        self._same_call("sleep")
        return {}

    def wake(self) -> dict[str, Any]:
        self._same_call("wake")
        return {}

    def reset_optimizer(self) -> None:
        self._same_call("reset_optimizer")

    def weights_digests(self) -> list[float]:
        return self._same_call("weights_digest")

    def weight_layout(self) -> list[Any]:
        if self.layout is None:
            self.layout = self._call_one(0, "weight_layout")
        return self.layout

    def send_weights(self, link: str, bucket_bytes: int) -> dict[str, Any]:
        return self._same_call("send_weights", link, bucket_bytes)[0]

    def kill(self) -> None:
        kill_actors(self.actors)


class SamplerGroup:
    """The sampler replicas of one role; prompts are split across them and answers re-joined in order."""

    def __init__(self, job_name: str, names: list[str], actors: list[Any], timeout_s: float) -> None:
        self.job_name, self.names, self.actors, self.timeout_s = job_name, names, actors, timeout_s
        self._device = "cpu"  # set by create()

    @classmethod
    def create(
        cls, config: ClientConfig, specs: list[WorkerSpec], group: PlacementGroup | None, model_dir: Path
    ) -> SamplerGroup:
        """Create the replica actors (their processes start now); :meth:`start_calls` loads the engines."""
        ray_config: RayConfig = config.backend
        remote = ray.remote(SamplingActor)
        actors = [
            remote.options(**_actor_options(spec, ray_config, group)).remote(
                config, index=spec.index, model_dir=str(model_dir)
            )
            for spec in specs
        ]
        job_name = specs[0].name.rsplit("-sampling-", 1)[0]
        samplers = cls(job_name, [s.name for s in specs], actors, config.job_ready_timeout_s)
        samplers._device = _device(ray_config)
        return samplers

    @property
    def members(self) -> list[tuple[str, Any]]:
        """``(actor name, actor handle)`` per replica."""
        return list(zip(self.names, self.actors, strict=True))

    def start_calls(self) -> list[tuple[str, Any]]:
        return [(n, a.start.remote(self._device)) for n, a in self.members]

    @classmethod
    def launch(
        cls, config: ClientConfig, specs: list[WorkerSpec], group: PlacementGroup | None, model_dir: Path
    ) -> SamplerGroup:
        """Create the replicas and wait until every engine is loaded."""
        samplers = cls.create(config, specs, group, model_dir)
        gather(samplers.job_name, samplers.start_calls(), samplers.timeout_s)
        return samplers

    @classmethod
    def attach(cls, job_name: str, names: list[str], namespace: str, timeout_s: float) -> SamplerGroup:
        return cls(job_name, names, [_get_actor(job_name, n, namespace) for n in names], timeout_s)

    def _same_call(self, method: str, *args: Any) -> list[Any]:
        calls = [(name, getattr(actor, method).remote(*args)) for name, actor in self.members]
        return gather(self.job_name, calls)

    def generate(self, prompts: list[Any], params: list[SamplingParams]) -> list[dict[str, Any]]:
        """Contiguous prompt slices per replica, so joining the answers keeps them prompt-major."""
        count = len(self.actors)
        bounds = [(len(prompts) * i) // count for i in range(count + 1)]
        calls = [
            (
                self.names[i],
                self.actors[i].generate.remote(prompts[bounds[i] : bounds[i + 1]], params[bounds[i] : bounds[i + 1]]),
            )
            for i in range(count)
            if bounds[i + 1] > bounds[i]
        ]
        return [sample for part in gather(self.job_name, calls) for sample in part]

    def sleep(self, level: int = 1) -> dict[str, Any]:
        self._same_call("sleep", level)
        return {}

    def wake(self) -> dict[str, Any]:
        self._same_call("wake")
        return {}

    def reset_prefix_cache(self) -> dict[str, Any]:
        self._same_call("reset_prefix_cache")
        return {}

    def policy_versions(self) -> list[int]:
        return self._same_call("policy_version")

    def receive_weights(self, link: str, layout: list[Any], bucket_bytes: int) -> dict[str, Any]:
        return self._same_call("receive_weights", link, layout, bucket_bytes)[0]

    def kill(self) -> None:
        kill_actors(self.actors)


def kill_actors(actors: Sequence[Any], timeout_s: float = 60.0) -> None:
    """Kill the actors and wait until Ray reports them dead, so their resources are free on return."""
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    probes = []
    for actor in actors:
        with contextlib.suppress(Exception):
            probes.append(actor.__ray_ready__.remote())  # fails once the actor is dead
    if probes:
        ray.wait(probes, num_returns=len(probes), timeout=timeout_s)


def _get_actor(job_name: str, name: str, namespace: str) -> Any:
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        raise JobFailedError(
            job_name, "terminated", f"actor {name!r} does not exist in Ray namespace {namespace!r}", {name: "missing"}
        ) from None


def link_weight_sync(trainers: TrainerGroup, samplers: SamplerGroup, backend: str) -> str:
    """Create a broadcast group of trainer rank 0 + every sampler; returns the link id to name it by."""
    link = uuid.uuid4().hex[:8]
    master = trainers._call_one(0, "rendezvous")
    world_size = 1 + len(samplers.actors)
    calls = [(trainers.names[0], trainers.actors[0].join_weight_sync.remote(link, master, world_size, backend))]
    calls += [
        (name, actor.join_weight_sync.remote(link, master, rank, world_size, backend))
        for rank, (name, actor) in enumerate(samplers.members, start=1)
    ]
    gather(trainers.job_name, calls, trainers.timeout_s)
    return link


def raw_broadcast_seconds(trainers: TrainerGroup, samplers: SamplerGroup, link: str, num_bytes: int) -> float:
    """Seconds one flat broadcast of ``num_bytes`` takes on ``link`` (what bucketed sync is measured against)."""
    calls = [(trainers.names[0], trainers.actors[0].raw_broadcast.remote(link, num_bytes))]
    calls += [(n, a.raw_broadcast.remote(link, num_bytes)) for n, a in samplers.members]
    return float(gather(trainers.job_name, calls, trainers.timeout_s)[0])


def sync_weights(trainers: TrainerGroup, samplers: SamplerGroup, link: str, bucket_bytes: int) -> dict[str, Any]:
    """Run both sides of one weight broadcast together; returns ``{policy_version, seconds, bytes}``."""
    layout = trainers.weight_layout()
    calls = [(n, a.send_weights.remote(link, bucket_bytes)) for n, a in trainers.members]
    calls += [(n, a.receive_weights.remote(link, layout, bucket_bytes)) for n, a in samplers.members]
    return gather(trainers.job_name, calls)[0]
