"""The training API's handlers: validate an op's body, make its work item, send it through the door.

Routes call these after the job and body checks; each returns the response body. Validation runs
before anything is queued, so a bad body is a 400 and never a failed request. Functions taking an
octet body run on a thread-pool thread (decoding a 60 MiB frame must not stall the event loop).
"""

from __future__ import annotations

import array
from typing import Any

from pydantic import ValidationError

from icefloe import protocol as api
from icefloe import wire
from icefloe.config import validation_problems
from icefloe.protocol import InvalidRequestError, SamplingParams, UnsupportedOpError
from icefloe.service.jobs import JobManager, LiveJob, job_type_named
from icefloe.service.limits import check_frame_header, truncated
from icefloe.service.schemas import (
    GenerateBody,
    LoadBody,
    SaveBody,
    StepBody,
    WeightSyncPayload,
    check_body,
    parse_json_body,
)
from icefloe.service.streams import GenerateStream
from icefloe.service.work.door import enter
from icefloe.service.work.items import TRAINING, Forward, FwdBwd, Item, Load, Sample, Save, Step, WeightSync

_SAMPLING_KEYS = frozenset(SamplingParams.model_fields)


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
    payload = wire.decode(frame, tensors="torch", header=header, dense=True)
    check_body(payload, "frame")
    op_metadata = wire.read_metadata(frame, header)
    if op == api.OP_GENERATE:
        item: Item = _generate_item(job, payload, sub_job_id)
    else:
        assert sub_job_id is not None
        item = _training_item(job, op, payload, sub_job_id, reference)
    return {"request_id": enter(manager, job, item, op_metadata=op_metadata), "job_id": job.job_id}


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


def _training_item(job: LiveJob, op: str, payload: Any, sub_job_id: str, reference: bool) -> Forward | FwdBwd:
    """The item a forward or forward-backward body asks for, validated here before it is queued and
    nowhere after (its batch is a Frame, whose tensors reach an engine process out of band)."""
    from icefloe.engines.batch import validate_batch

    if isinstance(payload, dict) and "batch" in payload and "kwargs" not in payload:
        raise InvalidRequestError(
            "a verl-style {batch, meta, processing} payload was sent; lower it to the canonical "
            "{args, kwargs, context, processing} frame first (icefloe.client.batch.to_canonical)"
        )
    require_context = op == api.OP_FWD_BWD
    batch = validate_batch(payload, require_context=require_context)
    if op == api.OP_FORWARD:
        return Forward(sub_job_id, batch, reference)
    if not job.specs[sub_job_id].is_training:
        raise InvalidRequestError(f"forward-backward needs a training sub-job; {sub_job_id} is not one")
    return FwdBwd(sub_job_id, batch)


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
    if isinstance(payload.get("prompts"), list):  # a frame's token prompts may be tensors; a JSON body's arrays stay
        prompts = [p.tolist() if hasattr(p, "tolist") and type(p) is not array.array else p for p in payload["prompts"]]
        payload = {**payload, "prompts": prompts}
    try:
        return GenerateBody.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequestError(validation_text(exc)) from None


def _generate_item(job: LiveJob, payload: Any, sub_job_id: str | None) -> Sample:
    body = _generate_body(payload)
    if sub_job_id is None:
        sub_job_id = generate_target(job, body.routing_key)
    params = sampling_params_per_prompt(body, job, sub_job_id)
    # Each sample is encoded as JSON where it is made (an engine process), so the answer splices it in.
    return Sample(sub_job_id, body.prompts, params, as_json=True)


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
        if not isinstance(prompt, str) and len(prompt) >= limit:
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
    return enter(manager, job, Step(sub_job_id, body.learning_rate))


def submit_save(manager: JobManager, job: LiveJob, body: SaveBody, sub_job_id: str) -> str:
    return enter(manager, job, Save(sub_job_id, job.job_dir / "checkpoints", body.checkpoint_type))


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


def submit_load(manager: JobManager, job: LiveJob, body: LoadBody, sub_job_id: str, *, tenant: str) -> str:
    """Queue a load of ``body``'s checkpoint; the door answers one of a job the caller may not see as unknown."""
    source = body.source_job_id or job.job_id
    return enter(manager, job, Load(sub_job_id, source, body.checkpoint_id), tenant=tenant)


# --- weight sync -------------------------------------------------------------------------------
def submit_weight_sync(
    manager: JobManager, job: LiveJob, payload: WeightSyncPayload, routed_sub_job_id: str | None, *, api: str = TRAINING
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
    from icefloe.engines.lora import check_weight_format

    for target in targets:  # a format either end cannot use is a 400 now, not a failed request later
        weight_format = check_weight_format(
            payload.weight_format, job.specs[source].config.lora, job.specs[target].config.lora
        )
    return enter(manager, job, WeightSync(source, tuple(targets), weight_format), api=api)


# --- generate-stream ---------------------------------------------------------------------------
OP_GENERATE_STREAM = "generate-stream"


# A stream's prompts are queued as items of at most this many: each item queued costs a future, its lock
# and an entry, and its prompts' events come once its last prompt finishes.
_STREAM_PROMPTS_PER_ITEM = 64


def submit_generate_stream(manager: JobManager, job: LiveJob, body: bytes, *, sub_job_id: str | None) -> dict:
    """Queue every prompt of the stream; returns ``{request_id, job_id, count}``. Refused (429) while the
    job's tenant holds a full budget of events no poll has drained."""
    manager.streams.budget.check_room(job.owner)
    request = _generate_body(parse_json_body(body, "generate-stream body (UTF-8 JSON, not DSSST1)"))
    target = sub_job_id or generate_target(job, request.routing_key)
    params = sampling_params_per_prompt(request, job, target)
    step = _STREAM_PROMPTS_PER_ITEM
    items = [
        Sample(target, request.prompts[start : start + step], params[start : start + step], as_json=True,
               index=start, op=OP_GENERATE_STREAM)
        for start in range(0, len(request.prompts), step)
    ]  # fmt: skip
    stream = GenerateStream(job.job_id, job.owner, manager.streams.budget, items=items, count=len(request.prompts))
    request_id = enter(manager, job, items[0], stream=stream)
    return {"request_id": request_id, "job_id": job.job_id, "count": stream.count}


def validation_text(exc: ValidationError, prefix: str = "") -> str:
    """One ``field: problem; got value`` clause per error, fields dotted from ``prefix``."""
    return truncated(validation_problems(exc, prefix, whole="body"))
