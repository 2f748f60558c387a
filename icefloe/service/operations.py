"""What each op does on a running job: validate its body, then queue the engine call.

Routes call these after the job and body checks; each returns the response body. Validation runs
before anything is queued, so a bad body is a 400 and never a failed request. Functions taking an
octet body run on a thread-pool thread (decoding a 60 MiB frame must not stall the event loop).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from icefloe import protocol as api
from icefloe import wire
from icefloe.config import validation_problems
from icefloe.protocol import (
    ClientClosedError,
    ConflictError,
    InvalidRequestError,
    SamplingParams,
    UnsupportedOpError,
)
from icefloe.service import store
from icefloe.service.jobs import JobManager, LiveJob, job_type_named
from icefloe.service.limits import check_frame_header, truncated
from icefloe.service.models import (
    GenerateBody,
    LoadBody,
    SaveBody,
    StepBody,
    WeightSyncPayload,
    check_body,
    parse_json_body,
)
from icefloe.service.results import JsonText

_SAMPLING_KEYS = frozenset(SamplingParams.model_fields)
# From this size a training frame travels to an engine process as its bytes, decoded there: pickling a 2.4 MB
# frame's tensors again took 4.3 ms of this process's GIL. A small frame's tensors pickle in microseconds, and
# decoding and checking it again in the engine process put ~1 ms on the engine's critical path per call
# (bench remote: ratio 1.23 with every frame sent as is, 1.10 with none).
_FRAME_BYTES_SENT_AS_IS = 1 << 20


def submit_frame(
    manager: JobManager,
    job: LiveJob,
    op: str,
    body: bytes,
    *,
    sub_job_id: str | None,
    reference: bool = False,
    header: wire.FrameHeader | None = None,
) -> dict[str, Any]:
    """Take an octet body (a DSSST1 frame or one request chunk of it) for ``op``.

    ``sub_job_id`` None is allowed for generate only: the body's ``routing_key`` then picks one.
    ``reference``: a forward on a LoRA training sub-job scores with its adapters disabled (see
    :func:`forward_target`). ``header``: ``wire.read_header(body)``, when the route parsed it already.
    """
    if op == api.OP_FORWARD and sub_job_id is not None and job.specs[sub_job_id].job_type == "sampling":
        raise InvalidRequestError(f"forward runs on a training or log_probability sub-job; {sub_job_id} is a sampler")
    if header is None:
        check_frame_header(body)
        header = wire.read_header(body)
    descriptor = wire.chunk_descriptor(body, header)
    if descriptor is None:
        return _submit_decoded(manager, job, op, body, header, sub_job_id, reference)
    return job.chunks.accept(
        descriptor,
        wire.chunk_payload(body, header),
        execute=lambda frame: _submit_decoded(manager, job, op, frame, None, sub_job_id, reference),
    )


def _submit_decoded(
    manager: JobManager,
    job: LiveJob,
    op: str,
    frame: bytes,
    header: wire.FrameHeader | None,
    sub_job_id: str | None,
    reference: bool,
) -> dict[str, Any]:
    if header is None:  # a frame joined from request chunks
        check_frame_header(frame)
        header = wire.read_header(frame)
    payload = wire.decode(frame, tensors="torch", header=header)
    check_body(payload, "frame")
    op_metadata = wire.read_metadata(frame, header)
    if op == api.OP_GENERATE:
        request_id = _submit_generate(manager, job, payload, op_metadata, sub_job_id)
    else:
        assert sub_job_id is not None
        run = _engine_call(job, op, payload, frame, sub_job_id, reference)
        if isinstance(run, Training):
            request_id = submit_training(manager, job, run, op_metadata=op_metadata)
        else:
            request_id = manager.submit(job, sub_job_id, op, run, op_metadata=op_metadata)
    return {"request_id": request_id, "job_id": job.job_id}


# --- forward-backward / forward ----------------------------------------------------------------
def forward_target(
    manager: JobManager, job: LiveJob, *, sub_job_id: str | None, sub_job_type: str | None
) -> tuple[str, bool]:
    """The sub-job a forward runs on, and whether it scores the reference policy there: on a LoRA job
    without a ``log_probability`` sub-job, that is the trainer with its adapters disabled."""
    if sub_job_id is None and sub_job_type is not None and job_type_named(sub_job_type) == "log_probability":
        kinds = {spec.job_type for spec in job.specs.values()}
        lora_trainers = [sid for sid, spec in job.specs.items() if spec.is_training and spec.config.lora is not None]
        if "log_probability" not in kinds and lora_trainers:
            return lora_trainers[0], True
    target = manager.resolve_sub_job(job, sub_job_id=sub_job_id, sub_job_type=sub_job_type, default_type="training")
    return target, False


def _engine_call(
    job: LiveJob, op: str, payload: Any, frame: bytes, sub_job_id: str, reference: bool
) -> Callable[[], Any] | Training:
    """The engine call a forward or forward-backward body asks for, validated before it is queued; an engine
    process receives the batch as its ``frame``."""
    from icefloe.engines.batch import FramedBatch, validate_batch

    if isinstance(payload, dict) and "batch" in payload and "kwargs" not in payload:
        raise InvalidRequestError(
            "a verl-style {batch, meta, processing} payload was sent; lower it to the canonical "
            "{args, kwargs, context, processing} frame first (icefloe.client.batch.to_canonical)"
        )
    require_context = op == api.OP_FWD_BWD
    batch = validate_batch(payload, require_context=require_context)
    if len(frame) >= _FRAME_BYTES_SENT_AS_IS:
        batch = FramedBatch(batch, frame, require_context=require_context)
    host = job.engines
    if op == api.OP_FORWARD:
        forward = host.forward_reference if reference else host.forward
        return lambda: forward(sub_job_id, batch)
    if not job.specs[sub_job_id].is_training:
        raise InvalidRequestError(f"forward-backward needs a training sub-job; {sub_job_id} is not one")

    def render(result: dict[str, Any]) -> dict[str, Any]:
        job.last_avg_loss[sub_job_id] = float(result["avg_loss"])
        return {"job_id": job.job_id, **result, "post_process_outputs": {}}

    return Training(sub_job_id, batch, render)


@dataclass(frozen=True, slots=True)
class Training:
    """One forward-backward a lane holds: the validated batch of a training sub-job, and how its
    result becomes the request's. Those queued at the same time on the lanes of a shared host run in
    the same passes, each through its own run's adapter (:func:`submit_training`)."""

    sub_job_id: str
    batch: Any
    render: Callable[[dict[str, Any]], Any]


def submit_training(
    manager: JobManager, job: LiveJob, item: Training, *, op: str = api.OP_FWD_BWD, op_metadata: dict | None = None
) -> str:
    """Queue ``item`` to run with every forward-backward queued beside it (``op``: the request's op)."""

    def run_batch(items: list[Training]) -> Iterator[dict[int, Any]]:  # a slice per next(): see JobManager._run_slices
        for done in job.engines.fwd_bwd_many([(i.sub_job_id, i.batch) for i in items]):
            yield {index: items[index].render(result) for index, result in done.items()}

    return manager.submit(
        job, item.sub_job_id, op, run_batch, batch_key=(api.OP_FWD_BWD,), batch_item=item, op_metadata=op_metadata
    )


# --- generate ----------------------------------------------------------------------------------
def _sampling_params(raw: dict[str, Any] | None, where: str, job: LiveJob, sub_job_id: str) -> SamplingParams:
    raw = dict(raw or {})
    ignored = sorted(set(raw) - _SAMPLING_KEYS)
    if ignored:
        job.log.write(f"{where}: ignored sampling keys {ignored}", level="WARNING", sub_job_id=sub_job_id)
    try:
        return SamplingParams(**{k: v for k, v in raw.items() if k in _SAMPLING_KEYS and v is not None})
    except ValidationError as exc:
        raise InvalidRequestError(validation_text(exc, prefix=f"{where}.")) from None


def _generate_body(payload: Any) -> GenerateBody:
    if not isinstance(payload, dict):
        raise InvalidRequestError(f"generate body must be a dict with 'prompts'; got {type(payload).__name__}")
    if isinstance(payload.get("prompts"), list):  # token prompts may come as tensors
        payload = {**payload, "prompts": [p.tolist() if hasattr(p, "tolist") else p for p in payload["prompts"]]}
    try:
        return GenerateBody.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequestError(validation_text(exc)) from None


def _submit_generate(
    manager: JobManager, job: LiveJob, payload: Any, op_metadata: dict[str, Any], sub_job_id: str | None
) -> str:
    body = _generate_body(payload)
    if sub_job_id is None:
        sub_job_id = generate_target(job, body.routing_key)
    params = sampling_params_per_prompt(body, job, sub_job_id)

    def render(samples: list[Any]) -> JsonText:
        return JsonText.object({"job_id": job.job_id}, results=samples)

    # Each sample is encoded as JSON where it is made (an engine process), so the answer splices it in.
    item = Sampling(sub_job_id, body.prompts, params, render)
    return submit_sampling(manager, job, item, as_json=True, op_metadata=op_metadata)


@dataclass(frozen=True, slots=True)
class Sampling:
    """One generate item a lane holds: what to sample on which sub-job, and how its samples (prompt
    major, ``n`` per prompt) become its result. Items queued at the same time on any lane of a host
    run as one engine batch (:func:`submit_sampling`)."""

    sub_job_id: str
    prompts: list[Any]
    params: list[SamplingParams]
    render: Callable[[list[Any]], Any]
    index: int = 0  # a generate-stream's prompt


def submit_sampling(
    manager: JobManager,
    job: LiveJob,
    item: Sampling,
    *,
    as_json: bool,
    op: str = api.OP_GENERATE,
    op_metadata: dict[str, Any] | None = None,
    stream: Any = None,
) -> str:
    """Queue ``item`` (or a stream's items) to be sampled in one batch with every item queued beside it.
    ``as_json``: samples reach ``render`` as JSON text (cheap to pass on) instead of dicts."""

    def run_batch(items: list[Sampling]) -> Iterator[dict[int, Any]]:  # a slice per next(): see JobManager._run_slices
        for done in job.engines.generate_many([(i.sub_job_id, i.prompts, i.params) for i in items], as_json):
            yield {index: items[index].render(part) for index, part in done.items()}

    key = (api.OP_GENERATE, as_json)
    return manager.submit(
        job, item.sub_job_id, op, run_batch, batch_key=key, batch_item=item, op_metadata=op_metadata, stream=stream
    )


def sampling_params_per_prompt(body: GenerateBody, job: LiveJob, sub_job_id: str) -> list[SamplingParams]:
    """One validated SamplingParams per prompt; also refuses token prompts longer than the sampler allows."""
    if body.model_extra:
        job.log.write(f"generate: ignored body keys {sorted(body.model_extra)}", level="WARNING", sub_job_id=sub_job_id)
    if isinstance(body.sampling_params, list):
        params = [
            _sampling_params(p, f"sampling_params.{i}", job, sub_job_id) for i, p in enumerate(body.sampling_params)
        ]
    else:
        params = [_sampling_params(body.sampling_params, "sampling_params", job, sub_job_id)] * len(body.prompts)
    limit = job.specs[sub_job_id].config.max_seq_len
    for i, prompt in enumerate(body.prompts):
        if isinstance(prompt, list) and len(prompt) >= limit:
            raise InvalidRequestError(
                f"prompts.{i} has {len(prompt)} tokens; {sub_job_id} takes fewer than max_seq_len={limit}"
            )
    return params


def generate_target(job: LiveJob, routing_key: Any) -> str:
    """The sampling sub-job for a generate: a routing key (a string, or the one key of a per-prompt
    list) picks one stably, else the first."""
    samplers = [sid for sid, spec in job.specs.items() if spec.job_type == "sampling"]
    if not samplers:
        raise InvalidRequestError(f"job {job.job_id} has no sampling sub-job; create it with a sampling sub_job_config")
    if isinstance(routing_key, list):
        routing_key = next((key for key in routing_key if key), None)
    if isinstance(routing_key, str) and routing_key:
        return samplers[sum(routing_key.encode()) % len(samplers)]
    return samplers[0]


# --- step / save / load ------------------------------------------------------------------------
def submit_step(manager: JobManager, job: LiveJob, body: StepBody, sub_job_id: str) -> str:
    def run() -> dict[str, Any]:
        result = job.engines.step(sub_job_id, body.learning_rate)
        return {"job_id": job.job_id, "global_steps": result["global_step"], "last_lr": result["lr"], **result}

    return manager.submit(job, sub_job_id, api.OP_STEP, run)


def submit_save(manager: JobManager, job: LiveJob, body: SaveBody, sub_job_id: str) -> str:
    def run() -> dict[str, Any]:
        result = job.engines.save(sub_job_id, job.job_dir / "checkpoints", body.checkpoint_type)
        store.upsert_checkpoint(
            manager.db,
            job_id=job.job_id,
            checkpoint_id=result["checkpoint_id"],
            global_steps=result["global_step"],
            avg_loss=job.last_avg_loss.get(sub_job_id),
            checkpoint_type=result["kind"],
            path=result["path"],
        )
        path, tag = manager.settings.public_path(result["path"]), result["checkpoint_id"]
        return {"job_id": job.job_id, "checkpoint_path": path, "checkpoint_tag": tag, **result, "path": path}

    return manager.submit(job, sub_job_id, api.OP_SAVE, run)


def load_target(job: LiveJob, body: LoadBody) -> str:
    """The training sub-job a load goes to, with the training API's 400 / 501 rules."""
    training = [sid for sid, spec in job.specs.items() if spec.is_training]
    if body.target_sub_job_id is None:
        if not training:
            raise InvalidRequestError(f"job {job.job_id} has no training sub-job to load a checkpoint into")
        return training[0]
    target = body.target_sub_job_id
    if target not in job.specs:
        raise InvalidRequestError(
            f"target_sub_job_id {target!r} is not in job {job.job_id}; its sub-jobs are {sorted(job.specs)}"
        )
    if not job.specs[target].is_training:
        raise UnsupportedOpError(
            f"load into a {job.specs[target].job_type} sub-job ({target}) is not supported; "
            "load into the training sub-job and run weight-sync"
        )
    return target


def submit_load(manager: JobManager, job: LiveJob, checkpoint: dict[str, Any], sub_job_id: str) -> str:
    """Queue a load of ``checkpoint`` (its record, as :meth:`Tenancy.checkpoint` found it for the caller)."""
    load = functools.partial(job.engines.load, sub_job_id, Path(checkpoint["path"]))

    def run() -> dict[str, Any]:
        result = load()
        if "path" in result:  # the answer names no server folder
            result["path"] = manager.settings.public_path(result["path"])
        return {"job_id": job.job_id, **result}

    return manager.submit(job, sub_job_id, api.OP_LOAD, run)


# --- weight sync -------------------------------------------------------------------------------
def submit_weight_sync(
    manager: JobManager, job: LiveJob, payload: WeightSyncPayload, routed_sub_job_id: str | None
) -> str:
    """Queue a sync that runs after every earlier request to the source and before any later one to a
    target: each target's worker parks (so no generate reads half-copied weights) until the copy ends."""
    source = payload.source_sub_job_id or routed_sub_job_id
    if source is None or source not in job.specs or not job.specs[source].is_training:
        raise InvalidRequestError(
            f"payload.source_sub_job_id must name a training sub-job of job {job.job_id}; got {source!r}"
        )
    targets = payload.target_sub_job_ids
    if targets is None:
        targets = [sid for sid, spec in job.specs.items() if spec.job_type == "sampling"]
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise InvalidRequestError(f"payload.target_sub_job_ids names {twice} more than once; name each target once")
    bad = sorted(t for t in targets if t not in job.specs or job.specs[t].job_type != "sampling")
    if bad or not targets:
        raise InvalidRequestError(
            f"payload.target_sub_job_ids must name sampling sub-jobs of job {job.job_id}; "
            f"not sampling sub-jobs: {bad or '[] (empty list)'}"
        )
    from icefloe.engines.host import SyncGate
    from icefloe.engines.lora import check_weight_format

    for target in targets:  # a format either end cannot use is a 400 now, not a failed request later
        weight_format = check_weight_format(
            payload.weight_format, job.specs[source].config.lora, job.specs[target].config.lora
        )

    sync_request: dict[str, str] = {}

    def abandoned() -> str | None:
        if job.stopping:
            return f"job {job.job_id} stopped before weight-sync could run"
        request_id = sync_request.get("id")
        if request_id is not None and not manager.requests.is_open(request_id):
            return "the weight-sync request was cancelled"
        return None

    gate = SyncGate.parked([job.workers[t] for t in targets], source=job.workers[source], abandoned=abandoned)
    host = job.engines

    def copy() -> dict[str, Any]:
        job.restart_clock(source)  # the targets are parked: the deadline counts from here
        started = time.perf_counter()
        per_target = {t: host.sync_weights(source, t, weight_format) for t in targets}
        return {
            "policy_version": per_target[targets[-1]]["policy_version"],
            "seconds": time.perf_counter() - started,
            "bytes": sum(int(r["bytes"]) for r in per_target.values()),
            "weight_format": weight_format,
            "targets": per_target,
        }

    def run() -> dict[str, Any]:
        job.restart_clock(source, at=math.inf)  # waiting for the targets' queued work (each op is watched)
        try:
            return gate.run(copy)
        except ClientClosedError as exc:
            raise ConflictError(str(exc)) from None

    try:
        sync_request["id"] = manager.submit(job, source, api.OP_WEIGHT_SYNC, run, ready=gate.may_start)
    except BaseException:
        gate.release()
        raise
    return sync_request["id"]


# --- generate-stream ---------------------------------------------------------------------------
OP_GENERATE_STREAM = "generate-stream"


@dataclass
class GenerateStream:
    """Events of one ``generate-stream`` request (UTF-8 JSON with a generate's fields): each prompt
    is a :class:`Sampling` item of ``items``, and its outcome an event the moment its batch
    finishes. Polls drain events destructively, as the training API specifies: ``{type: "result",
    index, result}``, ``{type: "error", index, error}``, then ``{type: "done", completed, failed}``.
    Only the host's worker pushes and only polls drain, so the deque needs no lock.
    """

    job_id: str
    items: list[Sampling]
    completed: int = 0
    failed: int = 0
    _events: deque[dict[str, Any]] = field(default_factory=deque)

    def push(self, item: Sampling, *, result: Any = None, error: str | None = None) -> str | None:
        """Queue the event of ``item``'s prompt; after the last prompt's, ``done``, and return the
        counts (JSON) the request finishes with."""
        if error is None:
            self.completed += 1
            self._events.append({"type": "result", "index": item.index, "result": result})
        else:
            self.failed += 1
            self._events.append({"type": "error", "index": item.index, "error": error})
        if self.completed + self.failed < len(self.items):
            return None
        self._events.append({"type": "done", "completed": self.completed, "failed": self.failed})
        return json.dumps({"completed": self.completed, "failed": self.failed})

    def drain(self, max_events: int) -> list[dict[str, Any]]:
        return [self._events.popleft() for _ in range(min(max_events, len(self._events)))]

    @property
    def pending_events(self) -> int:
        return len(self._events)


def submit_generate_stream(manager: JobManager, job: LiveJob, body: bytes, *, sub_job_id: str | None) -> dict:
    """Queue every prompt of the stream; returns ``{request_id, job_id, count}``."""
    request = _generate_body(parse_json_body(body, "generate-stream body (UTF-8 JSON, not DSSST1)"))
    target = sub_job_id or generate_target(job, request.routing_key)
    params = sampling_params_per_prompt(request, job, target)

    def render(samples: list[Any]) -> dict[str, Any]:
        return {"job_id": job.job_id, "results": samples}

    items = [
        Sampling(target, [prompt], [p], render, index)
        for index, (prompt, p) in enumerate(zip(request.prompts, params, strict=True))
    ]
    stream = GenerateStream(job.job_id, items=items)
    request_id = submit_sampling(manager, job, items[0], as_json=False, op=OP_GENERATE_STREAM, stream=stream)
    return {"request_id": request_id, "job_id": job.job_id, "count": len(stream.items)}


def validation_text(exc: ValidationError, prefix: str = "") -> str:
    """One ``field: problem; got value`` clause per error, fields dotted from ``prefix``."""
    return truncated(validation_problems(exc, prefix, whole="body"))
