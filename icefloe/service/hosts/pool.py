"""Model hosts: the engines of one base model, and the jobs that run on them.

A LoRA job attaches to a running host of its base model (same model and dtype) that has room: its
trainer and sampler are adapters on the host's one copy of the base, and it takes no slot of its
own. Any other job gets a dedicated host with the slots it asks for. A host takes its slots when
its first job needs it (waiting in ``placing`` as a job would) and gives them back when its last
job leaves. A job is placed when it is created, so a tenant's ``max_slots`` counts the hosts its
jobs start: a shared host's slot is charged to its oldest job (the one that started it, until it
leaves), a dedicated host's to its job.

A host runs its engines on :class:`~icefloe.engines.host.Worker` threads, with one lane per
sub-job: one worker for a shared base, so every run's ops interleave fairly and generates queued at
the same time run as one batch; one worker per sub-job on a dedicated host, so a trainer and its
sampler run side by side. A crash of the engines fails every job on the host, each with the
checkpoint it can resume from; anything else one job does touches that job only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from icefloe.engines.host import Lane, Worker
from icefloe.protocol import ConfigError
from icefloe.service.hosts.seam import BaseModel, JobEngines, LocalEngineHost
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.joblog import JobLog
from icefloe.service.lifecycle import JobState
from icefloe.service.settings import ServeSettings
from icefloe.service.specs import SubJobSpec
from icefloe.service.work.items import Sample

__all__ = [
    "HostFailed",
    "HostKey",
    "HostPool",
    "HostedJob",
    "ModelHost",
    "fail_resumable",
    "make_engine_host",
    "shared_base_key",
]

_log = logging.getLogger("icefloe.service.hosts.pool")
_SHARED_WORKER = "shared"
# Work that arrives while an engine is busy batches up behind it; only samples wait on an idle one.
_LINGERS = {Sample.batch_key: Sample.linger_s}
# On a shared host, a run behind in time whose op was just answered keeps the worker this long for its
# next op (a client sends it once the last is answered), instead of waiting behind another run's slice.
_ANTICIPATE_S = 0.02


@dataclass(frozen=True)
class HostKey:
    """What LoRA runs must agree on to share a host."""

    model: str
    seed: int  # a tiny:<preset> model's weights depend on the seed; 0 for a folder
    dtype: str


def shared_base_key(specs: list[SubJobSpec]) -> HostKey | None:
    """The base a job can share with other LoRA jobs, or None when it needs a host of its own.

    Shared: every sub-job is a LoRA trainer or a sampler on at most one slot, all of one model and
    dtype (a vLLM sampler keeps a host of its own). A shared base runs mixed-adapter batches in eval
    mode, so a model or adapter with dropout, or trained biases (base parameters every run would
    write), gets a host of its own; so does a sampler that starts from full weights.
    """
    if not specs:
        return None
    first = specs[0].config
    for spec in specs:
        config, lora = spec.config, spec.config.lora
        if spec.job_type not in ("training", "sampling") or spec.num_slots > 1:
            return None
        if spec.job_type == "training" and lora is None:
            return None
        if lora is not None and (lora.dropout or lora.bias != "none"):
            return None
        if spec.job_type == "training" and config.training.gradient_checkpointing:
            return None  # a shared base runs in eval mode, where transformers skips checkpointing
        if spec.job_type == "sampling" and (
            config.sampling.engine == "vllm" or (lora is None and spec.source_checkpoint)
        ):
            return None
        if (config.model, config.seed, config.dtype) != (first.model, first.seed, first.dtype):
            return None
    tiny = first.model.startswith("tiny:")
    if not tiny and _has_dropout(Path(first.model)):
        return None
    return HostKey(first.model, first.seed if tiny else 0, first.dtype)


def _has_dropout(folder: Path) -> bool:
    """Whether the model's config.json turns dropout on anywhere (``attention_dropout``, ``resid_pdrop``, ...)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return True  # unreadable: do not share what cannot be checked
    return any(
        ("dropout" in key or "pdrop" in key) and isinstance(value, int | float) and value > 0
        for key, value in config.items()
    )


class HostedJob(Protocol):
    """What a host needs of a job placed on it (the service's ``LiveJob`` is one)."""

    job_id: str
    specs: dict[str, SubJobSpec]
    state: JobState
    log: JobLog
    job_dir: Path
    base_key: HostKey | None
    owner: str
    in_flight: dict[str, tuple[str, str, float]]

    @property
    def num_slots(self) -> int: ...


class HostFailed(RuntimeError):
    """The host a job was placed on could not start or died."""


class ModelHost:
    """The engines of one model host and the jobs placed on it (see the module docstring).

    Args:
        host_id: names the host in job records, logs and metrics.
        key: the shared base (None: a dedicated host for one job).
        capacity: how many jobs a shared host takes.
    """

    def __init__(self, host_id: str, key: HostKey | None, capacity: int) -> None:
        self.host_id = host_id
        self.key = key
        self.capacity = capacity
        self.members: dict[str, HostedJob] = {}
        self.engines: JobEngines | None = None
        self.slots: list[int] = []
        self.device = "cpu"
        self.dead: str | None = None  # why the host failed, once it did
        self._workers: dict[str, Worker] = {}
        self._start_lock = threading.Lock()

    @property
    def shared(self) -> bool:
        return self.key is not None

    @property
    def has_room(self) -> bool:
        return self.shared and self.dead is None and len(self.members) < self.capacity

    def describe(self) -> dict[str, Any]:
        """What the job record and the dashboard show of the host."""
        return {
            "host_id": self.host_id,
            "shared": self.shared,
            "base_model": self.key.model if self.key is not None else None,
            "num_jobs": len(self.members),
            "max_jobs": self.capacity if self.shared else 1,
            "slots": list(self.slots),
        }

    # --- start --------------------------------------------------------------------------------
    def open(
        self,
        job: HostedJob,
        *,
        pool: SlotPool,
        settings: ServeSettings,
        placed: Callable[[], bool],
        checkpoints: dict[str, Path],
    ) -> bool:
        """Make the host ready for ``job`` and build its engines on it; False if the job stopped first.

        The first job to arrive takes the host's slots (the job waits in ``placing`` meanwhile) and
        starts its engines; a job arriving meanwhile waits for that. ``placed()`` moves the job to
        ``initializing`` once the slots are held (False: it is stopping).

        Raises:
            HostFailed: the engines could not start, or the host died; says why.
        """
        with self._start_lock:
            if self.dead is not None:
                raise HostFailed(self.dead)
            if self.engines is None:
                if not self.slots:  # else a job that stopped took them before it could start the host
                    slots = pool.acquire(job.num_slots, cancelled=job.state.stop, ticket=job)
                    if slots is None:
                        return False
                    self.slots = slots
                if not placed():
                    return False
                try:
                    self._start(job, pool, settings, checkpoints)
                except Exception as exc:
                    self.close()
                    if job.state.stop.is_set():  # the job starting it stopped: the next job of the host starts it
                        return False
                    self.dead = f"initializing failed: {type(exc).__name__}: {exc}"
                    raise HostFailed(self.dead) from None
                if not self.shared:
                    return True  # a dedicated host built the job's engines at start
            elif not placed():
                return False
        assert self.engines is not None and self.key is not None
        job.log.write(f"attaching to {self.host_id} (shared base {self.key.model!r} on {self.device})")
        self.engines.attach(list(job.specs.values()), checkpoints)
        return True

    def _start(self, job: HostedJob, pool: SlotPool, settings: ServeSettings, checkpoints: dict[str, Path]) -> None:
        devices: dict[str, str] = {}
        if self.shared:
            assert self.key is not None
            self.device = pool.device(self.slots[0])
            base = BaseModel(self.key.model, self.key.seed, self.device)
            self.engines = make_engine_host(settings.engines, [], {}, {}, None, base=base)
            self.engines.start(job.log.write, job.state.stop)  # what it loads, in the log of the job waiting for it
            self._workers[_SHARED_WORKER] = Worker(
                self.host_id, linger_s=0.0, lingers=_LINGERS, anticipate_s=_ANTICIPATE_S
            )
            return
        cursor = 0
        for sub_job_id, spec in job.specs.items():
            if spec.num_slots:
                devices[sub_job_id] = pool.device(self.slots[cursor])
                cursor += spec.num_slots
        for sub_job_id, spec in job.specs.items():
            if not spec.num_slots:  # n_gpus 0: a sampler on its trainer's device
                devices[sub_job_id] = next(devices[s] for s, o in job.specs.items() if o.is_training)
        self.device = next(iter(devices.values()), "cpu")
        specs = list(job.specs.values())
        self.engines = make_engine_host(settings.engines, specs, devices, checkpoints, job.job_dir / "logs")
        self.engines.start(job.log.write, job.state.stop)
        self._workers = {sid: Worker(sid, linger_s=0.0, lingers=_LINGERS) for sid in job.specs}

    def lanes(self, job: HostedJob) -> dict[str, Lane]:
        """A lane per sub-job of ``job``, on the worker that runs its engine."""
        if self.shared:
            return {sid: self._workers[_SHARED_WORKER].lane(sid, group=job.owner) for sid in job.specs}
        return {sid: self._workers[sid].lane(sid) for sid in job.specs}

    # --- leaving and failing ------------------------------------------------------------------
    def leave(self, job: HostedJob) -> None:
        """Drop ``job``'s engines from a shared host that lives on (its lanes are drained already)."""
        if self.shared and self.dead is None and self.engines is not None and job.job_id in self.members:
            try:
                self.engines.detach(list(job.specs))
            except Exception as exc:  # the host died under it: nothing left to drop
                _log.warning("%s: detaching job %s failed: %s", self.host_id, job.job_id, exc)

    def close(self) -> None:
        """Stop the workers and the engines (the last job left, the host failed, or its start gave up).
        Idempotent; the slots stay with the host."""
        if self.engines is not None:
            self.engines.interrupt()  # no worker may stay blocked on an engine process's pipes
        workers, self._workers = self._workers, {}
        for worker in workers.values():
            worker.close()
        if self.engines is not None:
            try:
                self.engines.close()
            except Exception as exc:  # a failing close must not keep the slots
                _log.warning("%s: closing engines failed: %s", self.host_id, exc)
            self.engines = None

    def fail(self, cause: str, checkpoint_of: Callable[[str], str | None]) -> None:
        """The engines crashed: fail every job on the host, each told where it can resume from
        (a dedicated host's job too: a crash is its failure whatever it was doing)."""
        if self.dead is not None:
            return
        self.dead = cause
        for job in list(self.members.values()):
            fail_resumable(job, cause, checkpoint_of)


def fail_resumable(job: HostedJob, cause: str, checkpoint_of: Callable[[str], str | None]) -> None:
    """The one way a job fails for its engines (a crash, a kill, an op stopped at its deadline): the
    reason says why and which checkpoint it can resume from."""
    checkpoint = checkpoint_of(job.job_id)
    resume = f"resume from checkpoint {checkpoint}" if checkpoint else "no checkpoint was saved"
    job.state.fail(f"{cause}; {resume}")


class HostPool:
    """The running model hosts, and which one each job goes to."""

    def __init__(self, settings: ServeSettings, slots: SlotPool) -> None:
        self.settings = settings
        self.slots = slots
        self._hosts: list[ModelHost] = []
        self._lock = threading.RLock()  # re-entered by a place() inside frozen()
        self._ids = itertools.count(1)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """No job is placed or released meanwhile: a tenant's admission counts the slots it holds and
        the new job would take, and the job is placed, on the same hosts."""
        with self._lock:
            yield

    def new_slots(self, key: HostKey | None, num_slots: int) -> int:
        """The slots a job placed now takes from the pool: ``num_slots`` for a host of its own (``key``
        None), one when no host of its shared base ``key`` has room (it starts one), else none."""
        if key is None:
            return num_slots
        with self._lock:
            return 0 if self._shared_with_room(key) is not None else 1

    def holders(self) -> list[str]:
        """The job charged with each shared host's slot: its oldest job, the one that started it until it leaves."""
        with self._lock:
            return [next(iter(h.members)) for h in self._hosts if h.shared and h.members]

    def _shared_with_room(self, key: HostKey) -> ModelHost | None:
        return next((h for h in self._hosts if h.key == key and h.has_room), None)

    def place(self, job: HostedJob) -> ModelHost:
        """The host ``job`` runs on: a shared host of its base with room, else a new one. Never blocks."""
        key = job.base_key
        with self._lock:
            host = self._shared_with_room(key) if key is not None else None
            if host is None:
                capacity = self.settings.max_adapters if key is not None else 1
                host = ModelHost(f"host-{next(self._ids)}", key, capacity)
                self._hosts.append(host)
            host.members[job.job_id] = job
            return host

    def release(self, host: ModelHost, job: HostedJob) -> None:
        """``job`` left (its lanes are drained): drop its engines, and the host once it is empty."""
        host.leave(job)
        with self._lock:
            host.members.pop(job.job_id, None)
            empty = not host.members
            if empty and host in self._hosts:
                self._hosts.remove(host)
        if empty:
            host.close()
            if host.slots:
                self.slots.release(host.slots)
                host.slots = []

    def hosts(self) -> list[ModelHost]:
        with self._lock:
            return list(self._hosts)


def make_engine_host(
    engines: str,
    specs: Sequence[SubJobSpec],
    devices: dict[str, str],
    checkpoints: dict[str, Path],
    log_dir: Path | None,
    *,
    base: BaseModel | None = None,
) -> JobEngines:
    """Build the host ``--engines`` names: a dedicated job's sub-jobs (``log_dir``: the job's log
    folder), or a shared ``base`` that jobs attach to later."""
    if engines == "local":
        return LocalEngineHost(specs, devices, checkpoints, base=base)
    if engines == "process":
        from icefloe.service.hosts.process import ProcessEngineHost

        return ProcessEngineHost(specs, devices, checkpoints, log_dir, base=base)
    if engines == "ray":
        from icefloe.service.hosts.ray_hosts import RayEngineHost, RaySharedHost

        return RaySharedHost(devices, base=base) if base is not None else RayEngineHost(specs, devices, checkpoints)
    raise ConfigError(f"serve.engines must be 'process', 'local' or 'ray'; got {engines!r}")
