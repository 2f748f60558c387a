"""Driver-side groups: the actors of one role, driven as one engine.

:class:`ActorGroup` creates, attaches to and kills one role's actors and fans a call out to them,
waiting on all of them together so a dead actor surfaces at once. :class:`TrainerGroup` shards a
batch over the data-parallel ranks and reduces their answers; :class:`SamplerGroup` splits prompts
over the replicas. :func:`link_weight_sync` wires trainer rank 0 and the samplers into a broadcast
group of their own and :func:`sync_weights` runs both sides of one broadcast.
"""

from __future__ import annotations

import abc
import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup

from icefloe.config import ClientConfig, RayConfig
from icefloe.engines.batch import as_frame
from icefloe.engines.distributed import combine_fwd_bwd, concat_forward, shard_rows
from icefloe.engines.ray.actors import SamplingActor, TrainingActor
from icefloe.engines.ray.placement import WorkerSpec, actor_options, collective_backend, worker_device
from icefloe.protocol import IcefloeError, IcefloeTimeoutError, JobFailedError, SamplingParams

__all__ = [
    "ActorGroup",
    "SamplerGroup",
    "TrainerGroup",
    "actor_failures",
    "gather",
    "link_weight_sync",
    "sync_weights",
]


@contextlib.contextmanager
def actor_failures(job_name: str, actor_name: str) -> Iterator[None]:
    """Turn Ray's failure types into the error tree: a dead actor is a :class:`JobFailedError`.

    An engine error raised inside an actor (an ``IcefloeError`` such as ``InvalidRequestError``)
    comes back as itself, chained to Ray's wrapper so the remote traceback stays visible.
    """
    try:
        yield
    except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
        text = str(exc).strip()
        first_line = text.splitlines()[0] if text else type(exc).__name__
        raise JobFailedError(
            job_name, "failed", f"actor {actor_name} died: {first_line}", {actor_name: "dead"}
        ) from exc
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, IcefloeError):
            raise cause from exc
        raise JobFailedError(
            job_name, "failed", f"actor {actor_name} raised {type(cause).__name__}: {cause}", {actor_name: "error"}
        ) from exc


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


class ActorGroup(abc.ABC):
    """The actors of one role (named ``{job}-{role}-{index}``), driven as one engine.

    Engine ops reach every actor's engine through the actor's ``call``; an op's answers are awaited
    together (see :func:`gather`).
    """

    actor_class: ClassVar[type]

    def __init__(
        self,
        job_name: str,
        role: str,
        names: list[str],
        actors: list[Any],
        timeout_s: float,
        ray_config: RayConfig | None = None,
    ) -> None:
        self.job_name, self.role, self.names, self.actors = job_name, role, names, actors
        self.timeout_s = timeout_s
        self.ray_config = ray_config  # None when attached: an attached group never starts its actors

    @classmethod
    def create(
        cls,
        job_name: str,
        config: ClientConfig,
        specs: list[WorkerSpec],
        placement: PlacementGroup | None,
        model_dir: Path,
    ) -> Self:
        """Create the actors (their processes start now); :meth:`start_calls` loads the engines."""
        ray_config: RayConfig = config.backend
        remote = ray.remote(cls.actor_class)
        actors = [
            remote.options(**actor_options(spec, ray_config, placement)).remote(
                config, role=spec.role, model_dir=str(model_dir)
            )
            for spec in specs
        ]
        return cls(job_name, specs[0].role, [s.name for s in specs], actors, config.job_ready_timeout_s, ray_config)

    def start(self) -> Self:
        """Wait until every actor created by :meth:`create` has loaded its engine."""
        gather(self.job_name, self.start_calls(), self.timeout_s)
        return self

    @classmethod
    def attach(cls, job_name: str, role: str, names: list[str], namespace: str, timeout_s: float) -> Self:
        """The live actors called ``names``; a missing one is a :class:`JobFailedError`."""
        return cls(job_name, role, names, [_get_actor(job_name, n, namespace) for n in names], timeout_s)

    @property
    def members(self) -> list[tuple[str, Any]]:
        """``(actor name, actor handle)`` per actor."""
        return list(zip(self.names, self.actors, strict=True))

    @abc.abstractmethod
    def start_calls(self) -> list[tuple[str, ray.ObjectRef]]:
        """Pending ``start`` calls of every actor, to wait on with :func:`gather`."""

    def _each(self, method: str, args_per_actor: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``method`` on every actor with that actor's arguments; answers in actor order."""
        calls = [
            (name, getattr(actor, method).remote(*args))
            for (name, actor), args in zip(self.members, args_per_actor, strict=True)
        ]
        return gather(self.job_name, calls)

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._each(method, [args] * len(self.actors))

    def _first(self, method: str, *args: Any) -> Any:
        """``method`` on the first actor only (rank 0), within the group's timeout."""
        ref = getattr(self.actors[0], method).remote(*args)
        return gather(self.job_name, [(self.names[0], ref)], self.timeout_s)[0]

    def call(self, method: str, *args: Any) -> Any:
        """An engine method the group has no method of its own for, on every actor; rank 0's answer."""
        return self._all("call", method, *args)[0]

    def kill(self, timeout_s: float = 60.0) -> None:
        """Kill the actors and wait until Ray reports them dead, so their resources are free on return."""
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        probes = []
        for actor in self.actors:
            with contextlib.suppress(Exception):
                probes.append(actor.__ray_ready__.remote())  # fails once the actor is dead
        if probes:
            ray.wait(probes, num_returns=len(probes), timeout=timeout_s)


class TrainerGroup(ActorGroup):
    """The data-parallel ranks of one training (or reference) role: a batch's rows are sharded over them."""

    actor_class = TrainingActor
    _layout: list[Any] | None = None

    def start_calls(self) -> list[tuple[str, ray.ObjectRef]]:
        """Rank 0 picks the group's rendezvous port first (when the ranks form a group)."""
        assert self.ray_config is not None, "an attached group does not start actors"
        world_size = len(self.actors)
        forms_group = world_size > 1 or (self.ray_config.fsdp and self.role == "training")
        master = self._first("rendezvous") if forms_group else None
        backend, device = collective_backend(self.ray_config), worker_device(self.ray_config)
        return [
            (name, actor.start.remote(rank, world_size, master, backend, device))
            for rank, (name, actor) in enumerate(self.members)
        ]

    def fwd_bwd(self, frame: dict[str, Any]) -> dict[str, Any]:
        # Validated first: the shards then share the whole batch's loss mask, loss and normalisers.
        shards, real_rows = shard_rows(as_frame(frame), len(self.actors))
        return combine_fwd_bwd(self._each("call", [("fwd_bwd", shard) for shard in shards]), real_rows)

    def forward(self, frame: dict[str, Any], *, reference: bool = False) -> dict[str, Any]:
        """``reference=True``: LoRA trainers score with the adapters disabled (the base model)."""
        shards, real_rows = shard_rows(as_frame(frame, require_context=False), len(self.actors))
        calls = [
            (name, actor.call.remote("forward", shard, reference=reference))
            for (name, actor), shard in zip(self.members, shards, strict=True)
        ]
        return concat_forward(gather(self.job_name, calls), real_rows)

    def step(self, learning_rate: float | None = None, adam: dict[str, float] | None = None) -> dict[str, Any]:
        results = self._all("call", "step", learning_rate, adam)
        first = results[0]
        if "peak_memory" in first:  # the job-wide GPU high-water mark; the CPU one is rank 0's
            first = {**first, "peak_memory": {**first["peak_memory"]}}
            first["peak_memory"]["gpu_peak"] = max(r["peak_memory"]["gpu_peak"] for r in results)
        return first

    def save_checkpoint(self, root: Path | str, kind: str = "resumable") -> dict[str, Any]:
        return self._all("call", "save_checkpoint", str(root), kind)[0]

    def load_checkpoint(self, path: Path | str, optimizer: bool = True) -> dict[str, Any]:
        return self._all("call", "load_checkpoint", str(path), optimizer)[0]

    def reset_optimizer(self) -> None:
        self._all("reset_optimizer")

    def weight_layout(self) -> list[Any]:
        """What a receiver needs to unpack the broadcast (asked of rank 0 once)."""
        if self._layout is None:
            self._layout = self._first("weight_layout")
        return self._layout

    def send_weights(self, link: str, bucket_bytes: int) -> dict[str, Any]:
        return self._all("send_weights", link, bucket_bytes)[0]

    def export_cuda_ipc(self) -> tuple[list[Any], int]:
        """Rank 0's CUDA IPC handles and the policy version they carry."""
        return self._first("export_cuda_ipc")

    def release_cuda_ipc(self) -> None:
        self._first("release_cuda_ipc")


class SamplerGroup(ActorGroup):
    """The sampler replicas: prompts are split across them and the answers re-joined in order."""

    actor_class = SamplingActor

    def start_calls(self) -> list[tuple[str, ray.ObjectRef]]:
        assert self.ray_config is not None, "an attached group does not start actors"
        device = worker_device(self.ray_config)
        return [(name, actor.start.remote(device, replica)) for replica, (name, actor) in enumerate(self.members)]

    def generate(self, prompts: list[Any], params: list[SamplingParams]) -> list[dict[str, Any]]:
        """Contiguous prompt slices per replica, so joining the answers keeps them prompt-major."""
        count = len(self.actors)
        bounds = [(len(prompts) * i) // count for i in range(count + 1)]
        calls = [
            (name, actor.call.remote("generate", prompts[lo:hi], params[lo:hi]))
            for (name, actor), lo, hi in zip(self.members, bounds, bounds[1:], strict=False)
            if hi > lo
        ]
        return [sample for part in gather(self.job_name, calls) for sample in part]

    def receive_weights(self, link: str, layout: list[Any], bucket_bytes: int) -> dict[str, Any]:
        return self._all("receive_weights", link, layout, bucket_bytes)[0]

    def import_cuda_ipc(self, handles: list[Any], policy_version: int) -> dict[str, Any]:
        return self._all("import_cuda_ipc", handles, policy_version)[0]


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
    master = trainers._first("rendezvous")
    world_size = 1 + len(samplers.actors)
    members = [trainers.members[0], *samplers.members]
    calls = [
        (name, actor.join_weight_sync.remote(link, master, rank, world_size, backend))
        for rank, (name, actor) in enumerate(members)
    ]
    gather(trainers.job_name, calls, trainers.timeout_s)
    return link


def sync_weights(trainers: TrainerGroup, samplers: SamplerGroup, link: str, bucket_bytes: int) -> dict[str, Any]:
    """Run both sides of one weight broadcast together; returns ``{policy_version, seconds, bytes}``."""
    layout = trainers.weight_layout()
    calls = [(n, a.send_weights.remote(link, bucket_bytes)) for n, a in trainers.members]
    calls += [(n, a.receive_weights.remote(link, layout, bucket_bytes)) for n, a in samplers.members]
    return gather(trainers.job_name, calls)[0]
