"""Typed work items: what runs on which sub-job, as data a lane holds (print one to see its contents).

Every op of both APIs, and the engine ops of the training API's ``operation`` route, becomes one of
these and enters the lanes through :func:`icefloe.service.work.door.enter`. :func:`run_batch` and
:func:`run_one` are the one place that turns items into engine calls; an op that is one engine method
call finds that method in ``protocol.ENGINE_CALLS``, the table the client's engine host reads too.
Items carry no callbacks: a result is kept as the engine made it and rendered by the API that asked,
when it asks (:data:`HELD`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final

from icefloe import protocol as api
from icefloe.protocol import ENGINE_CALLS, SamplingParams

if TYPE_CHECKING:
    from icefloe.engines.host import SyncGate

__all__ = [
    "HELD",
    "OPENAI",
    "TINKER",
    "TRAINING",
    "EngineOp",
    "Forward",
    "FwdBwd",
    "Item",
    "Load",
    "Sample",
    "Save",
    "Step",
    "WeightSync",
    "run_batch",
    "run_one",
]


# The API that queued an item. Its result waits, as the engine made it, until that API asks for it: in
# memory for the Tinker and OpenAI APIs (JobManager.held; a restart loses it, and their clients send the
# call again), in the request's row for the training API, whose polls outlive a restart.
TRAINING: Final = "training"
TINKER: Final = "tinker"
OPENAI: Final = "openai"
HELD: Final = frozenset({TINKER, OPENAI})


@dataclass(frozen=True, slots=True)
class FwdBwd:
    """A forward-backward (or, with ``forward_only`` in its loss config, a forward with the loss):
    those queued together on the lanes of a host run in shared passes, each through its own adapter."""

    sub_job_id: str
    batch: Any  # an engines.batch.Frame (validated at the route; engines take it as it is)
    op: str = api.OP_FWD_BWD  # the request's op: the Tinker API's forward is OP_FORWARD
    batch_key: ClassVar[tuple[str]] = (api.OP_FWD_BWD,)


@dataclass(frozen=True, slots=True)
class Forward:
    """Log-probs of a batch; ``reference``: a LoRA trainer scoring with its adapters disabled."""

    sub_job_id: str
    batch: Any
    reference: bool = False
    op: ClassVar[str] = api.OP_FORWARD


@dataclass(frozen=True, slots=True)
class Step:
    sub_job_id: str
    learning_rate: float | None = None
    adam: Mapping[str, float] | None = None
    op: ClassVar[str] = api.OP_STEP


@dataclass(frozen=True, slots=True)
class Sample:
    """Prompts to sample, one params per prompt (``n`` samples each). Samples of every API, run and the
    base model queued together on a host's lanes run as one decode batch (the key names no API);
    ``as_json``: each sample comes back as its JSON text (encoded where it was made: an engine
    process pickles text far faster than a sample), for an answer that splices it in; ``progress``:
    the tokens decoded so far come with each slice while it runs, for an answer that streams them."""

    sub_job_id: str
    prompts: Sequence[Any]
    params: Sequence[SamplingParams]
    as_json: bool = False
    progress: bool = False
    index: int = 0  # a generate-stream's prompt
    op: str = api.OP_GENERATE
    batch_key: ClassVar[tuple[str]] = (api.OP_GENERATE,)
    # How long a sample the worker takes on an idle host waits for company: the Tinker SDK sends a
    # group's calls one by one, a few milliseconds apart, and they should decode as one batch.
    linger_s: ClassVar[float] = 0.008

    def one_by_one(self) -> list[Sample]:
        """Each prompt as an item of its own, ``index`` counting on (a stream's prompts, when the engine
        refused one of them: each prompt's outcome is its own)."""
        return [
            replace(self, prompts=[prompt], params=[params], index=self.index + offset)
            for offset, (prompt, params) in enumerate(zip(self.prompts, self.params, strict=True))
        ]


@dataclass(frozen=True, slots=True)
class Save:
    """A checkpoint of the trainer into ``folder``, recorded under ``checkpoint_id`` (None: the
    engine's name for it, ``global_step<N>``); ``encrypt_to``: age recipients the files are
    encrypted to (the result then counts the folder's ``size_bytes``), None to leave them."""

    sub_job_id: str
    folder: Path
    kind: str = "resumable"
    checkpoint_id: str | None = None
    encrypt_to: tuple[Any, ...] | None = None
    op: ClassVar[str] = api.OP_SAVE


@dataclass(frozen=True, slots=True)
class Load:
    """A checkpoint of ``source_job_id`` loaded into the trainer. ``folder`` is filled by the door,
    once it found the checkpoint visible to the job's tenant; an item without it never runs."""

    sub_job_id: str
    source_job_id: str
    checkpoint_id: str
    optimizer: bool = True
    folder: Path | None = None
    op: ClassVar[str] = api.OP_LOAD


@dataclass(frozen=True, slots=True)
class WeightSync:
    """The trainer's weights (with LoRA: its adapter) copied into sampling sub-jobs, after every earlier
    request to the source and before any later one to a target; ``gate`` (filled by the door) parks
    the targets' lanes meanwhile."""

    source: str
    targets: tuple[str, ...]
    weight_format: str | None = None
    gate: SyncGate | None = field(default=None, compare=False)
    op: ClassVar[str] = api.OP_WEIGHT_SYNC

    @property
    def sub_job_id(self) -> str:
        return self.source


@dataclass(frozen=True, slots=True)
class EngineOp:
    """An op of ``protocol.ENGINE_CALLS`` with no item of its own (``reset-prefix-cache``, ...)."""

    sub_job_id: str
    op: str
    body: Mapping[str, Any] = field(default_factory=dict)


Item = FwdBwd | Forward | Step | Sample | Save | Load | WeightSync | EngineOp


def run_batch(job: Any, items: Sequence[FwdBwd] | Sequence[Sample]) -> Iterator[dict[int, Any]]:
    """The items of one batch key, queued together on the lanes of ``job``'s host (any jobs), as one engine
    op run a slice (passes or decode steps) per ``next()``: each yields ``{index: result}`` for the items
    finished meanwhile, so the worker serves other runs between slices and answers a small item early.
    ``job``: a running ``jobs.LiveJob`` (not named as a type: the job manager imports this module)."""
    engines = job.engines
    if isinstance(items[0], FwdBwd):
        return engines.slices(items[0].sub_job_id, "fwd_bwd", [(item.sub_job_id, item.batch) for item in items])
    calls = [(item.sub_job_id, item.prompts, item.params, item.as_json, item.progress) for item in items]
    return engines.generate_many(calls)


def run_one(job: Any, item: Item, db: Any) -> list[Any] | Iterator[dict[int, Any]]:
    """One item that does not batch, on ``job``'s engines, as :func:`run_batch` gives results: its one
    result in a list, or (a forward) slices; ``db``: the store its checkpoints are recorded in."""
    if isinstance(item, WeightSync):
        return [_weight_sync(job, item)]
    if isinstance(item, Save):
        return [_save(job, item, db)]
    if isinstance(item, Forward):
        return _forward_slices(job, item)
    return [_call(job, item, _BODIES[type(item)](item))]


def _call(job: Any, item: Item, body: Mapping[str, Any]) -> Any:
    call = ENGINE_CALLS[item.op]
    return job.engines.call(item.sub_job_id, call.method, call.args(body), call.kwargs(body))


def _forward_slices(job: Any, item: Forward) -> Iterator[dict[int, Any]]:
    """A forward as engine calls of about one pass each (the sub-job's ``micro_batch_tokens`` positions,
    else :data:`_FORWARD_SLICE_POSITIONS`; whole rows, at least one), a slice per ``next()``: a forward
    as one engine call could not stop at its deadline, and killing it fails every run of a shared host."""
    import torch

    from icefloe.engines.batch import Frame

    batch = item.batch
    rows, width = batch["kwargs"]["input_ids"].shape
    positions = job.specs[item.sub_job_id].config.training.micro_batch_tokens or _FORWARD_SLICE_POSITIONS
    per_slice = max(1, positions // max(int(width), 1))
    if rows <= per_slice:
        yield {0: _call(job, item, {"batch": batch, "reference": item.reference})}
        return
    parts = []
    for start in range(0, rows, per_slice):
        if parts:
            yield {}  # the worker's other lanes take their turn; a deadline past stops the forward here
        rows_of = {section: {name: t[start : start + per_slice].clone() for name, t in batch[section].items()}
                   for section in ("kwargs", "context")}  # fmt: skip
        part = Frame({"args": (), **rows_of, "processing": batch["processing"]}, training=batch.training)
        parts.append(_call(job, item, {"batch": part, "reference": item.reference}))
    yield {0: {key: torch.cat([part[key] for part in parts]) for key in parts[0]}}


# Positions (rows x width) per engine call of a training-API forward whose sub-job sets no pass size.
_FORWARD_SLICE_POSITIONS = 16_384

# An item's fields in the terms of its op's ENGINE_CALLS entry (the body a client sends).
_BODIES: dict[type, Any] = {
    Step: lambda item: {"learning_rate": item.learning_rate, "adam": item.adam},
    Load: lambda item: {"folder": item.folder, "load_optimizer_states": item.optimizer},
    EngineOp: lambda item: item.body,
}


def _save(job: Any, item: Save, db: Any) -> dict[str, Any]:
    from icefloe.service import store

    call, body = ENGINE_CALLS[api.OP_SAVE], {"folder": item.folder, "checkpoint_type": item.kind}
    result = job.engines.call(item.sub_job_id, call.method, call.args(body), call.kwargs(body))
    if item.encrypt_to is not None:
        from icefloe.service.tinker.external import encrypt_folder

        result["size_bytes"] = encrypt_folder(Path(result["path"]), list(item.encrypt_to))
    store.upsert_checkpoint(
        db,
        job_id=job.job_id,
        checkpoint_id=item.checkpoint_id or result["checkpoint_id"],
        global_steps=result["global_step"],
        avg_loss=job.last_avg_loss.get(item.sub_job_id),
        checkpoint_type=result["kind"],
        path=result["path"],
    )
    return result


def _weight_sync(job: Any, item: WeightSync) -> dict[str, Any]:
    from icefloe.protocol import ClientClosedError, ConflictError

    assert item.gate is not None, "the door parks the targets before a weight sync is queued"
    engines = job.engines

    def copy() -> dict[str, Any]:
        job.restart_clock(item.source)  # the targets are parked: the deadline counts from here
        started = time.perf_counter()
        per_target = {t: engines.sync_weights(item.source, t, item.weight_format) for t in item.targets}
        return {
            "policy_version": per_target[item.targets[-1]]["policy_version"],
            "seconds": time.perf_counter() - started,
            "bytes": sum(int(r["bytes"]) for r in per_target.values()),
            "weight_format": item.weight_format,
            "targets": per_target,
        }

    job.restart_clock(item.source, at=float("inf"))  # waiting for the targets' queued work (each op is watched)
    try:
        return item.gate.run(copy)
    except ClientClosedError as exc:
        raise ConflictError(str(exc)) from None
