"""The Tinker API's routes (``/api/v1``) for sessions, models, training ops, sampling and futures, as
the ``tinker`` SDK calls them; :mod:`.runs` has the REST client's routes.

The ``tinker`` package (its protobuf classes) imports torch, so :mod:`.convert` is imported on
first use: ``icefloe serve`` starts without torch in its own process.

The ``X-API-Key`` is checked before a handler runs (``RequireToken`` with ``TINKER_ACCESS``), which also names
the caller's tenant: every lookup takes it. Each handler reads its body off the event loop when it is
large (:mod:`.checks`), checks every field, queues the work on the model's job (see
:mod:`icefloe.service.tinker.state`) and answers the SDK's shape: a future ``{request_id}`` for ops,
the result itself for the rest. An ordered op reads its ``model_id`` and ``seq_id`` first and checks
the rest in its turn, so a refusal uses up its ``seq_id``. Forward-backward requests and
forward-backward / sample results travel as protobuf, the rest as JSON.
"""

from __future__ import annotations

import array
import asyncio
import functools
import uuid
from collections.abc import Callable
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from icefloe.protocol import OP_FORWARD, OP_FWD_BWD, ConflictError, InvalidRequestError
from icefloe.protocol import SamplingParams as EngineSamplingParams
from icefloe.service import store
from icefloe.service.jobs import LiveJob
from icefloe.service.limits import CHECK_ON_LOOP_BYTES, MAX_LORA_RANK, MAX_STOPS
from icefloe.service.middleware import read_body
from icefloe.service.routes import SettingsDep, TenantDep
from icefloe.service.settings import ServeSettings
from icefloe.service.tinker.checks import Fields, checkpoint_name, int_array, json_body
from icefloe.service.tinker.external import recipients_of
from icefloe.service.tinker.state import (
    CheckpointPath,
    Model,
    SamplerSave,
    SamplingSession,
    TinkerState,
    remember,
)
from icefloe.service.work.items import FwdBwd, Load, Sample, Save, Step

__all__ = ["router", "tinker_state"]

_POLL_S = 30.0  # the SDK gives retrieve_future 45 s; answer try_again well before
_PROTO = "application/x-protobuf"
_PROMPT_KEYS = ("prompt_logprobs", "topk_prompt_logprobs", "target_prompt_logprobs")  # per call, not per sample
_MAX_SEQ_ID = 2**62
_MAX_TOPK = 1024
_SAMPLER_KINDS = ("snapshot", "inflight")  # the SDK's SamplingClientKind
# The fields of the SDK's CreateModelRequest and LoraConfig, which forbid any other key (extra="forbid").
_CREATE_MODEL_KEYS = ("session_id", "model_seq_id", "base_model", "user_metadata", "lora_config",
                      "optimizer_config", "type")  # fmt: skip
_LORA_KEYS = ("rank", "seed", "train_unembed", "train_mlp", "train_attn")


async def tinker_state(request: Request) -> TinkerState:
    return request.app.state.tinker


# The X-API-Key is checked by the Tinker API's own RequireToken layer (TINKER_ACCESS).
router = APIRouter(tags=["tinker"])  # mounted at TINKER_PREFIX
State = Annotated[TinkerState, Depends(tinker_state)]
Body = Annotated[Fields, Depends(json_body)]


def _seq_id(body: Fields) -> int | None:
    return body.integer("seq_id", None, low=0, high=_MAX_SEQ_ID)


# --- client and session ----------------------------------------------------------------------
@router.post("/client/config")
async def client_config(state: State) -> Response:
    # Uncompressed protobuf bodies; chunks of one forward_backward sent at once, each answered at once
    # (queued here in seq_id order).
    # The SDK asks this on a connection pool of its own that it never closes: closing the
    # connection from here keeps its socket from outliving the ServiceClient (a ResourceWarning).
    # An unpickled sampling client asks join_sampling_session for its clone number.
    # retrieve_futures is served but not advertised: it adds a request per step here (see state.py).
    flags = {"proto_compress_fwdbwd": False, "parallel_fwdbwd_chunks": True, "sample_join_sampling_session": True,
             "sample_use_retrieve_futures": state.advertise_retrieve_futures}  # fmt: skip
    return JSONResponse(flags, headers={"Connection": "close"})


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    # An abandoned sample future sends cancel_future: a call that has not started leaves the sampler's
    # queue, one that runs stops at its next decode step.
    return {"sample_cancel_enabled": True}


@router.post("/create_session")
async def create_session(state: State, tenant: TenantDep) -> dict[str, Any]:
    return {"type": "create_session", "session_id": state.create_session(tenant)}


@router.post("/session_heartbeat")
async def session_heartbeat(body: Body, state: State, tenant: TenantDep) -> Response:
    session_id = body.text("session_id", max_chars=256)
    if state.session(session_id, tenant) != "active":
        return JSONResponse({"code": "session_finished", "message": "the session has finished"}, status_code=410)
    state.heartbeat(session_id)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, state: State, tenant: TenantDep) -> dict[str, Any]:
    await asyncio.to_thread(state.finish_session, session_id, tenant)
    return {}


@router.post("/telemetry")
async def telemetry() -> dict[str, Any]:
    return {"status": "accepted"}  # the body is never parsed: nothing here reads the SDK's telemetry


# --- models ----------------------------------------------------------------------------------
def _base_model(body: Fields) -> str:
    value = body.text("base_model", max_chars=1024).strip()
    if not value:
        raise InvalidRequestError("base_model must name a model (a folder under --model-root, or tiny:<preset>)")
    return value


@router.post("/create_model")
async def create_model(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    body.only(_CREATE_MODEL_KEYS, "CreateModelRequest")
    session_id = body.text("session_id", max_chars=256)
    seq = body.integer("model_seq_id", 0, low=0, high=_MAX_SEQ_ID)
    model_id = f"{session_id}:train:{seq}"
    if model_id not in state.models:
        lora = body.section("lora_config")
        lora.only(_LORA_KEYS, "LoraConfig")
        rank = lora.integer("rank", None, low=1, high=MAX_LORA_RANK)
        # The SDK's defaults: every layer kind, the output layer (unembedding) included.
        layers = {key: lora.flag(key, True) for key in ("train_attn", "train_mlp", "train_unembed")}
        base_model = _base_model(body)
        job_id = await asyncio.to_thread(
            state.create_job,
            session_id,
            base_model,
            lora_rank=rank,
            training=True,
            name=model_id,
            tenant=tenant,
            layers=layers,
        )
        model = state.add_model(model_id, session_id, job_id, base_model, rank)
        model.taken[-1] = {
            "request_id": state.future(job_id, lambda _: {"type": "create_model", "model_id": model_id}),
            "model_id": model_id,
        }
    return state.model(model_id, tenant).taken[-1]


@router.post("/get_info")
async def get_info(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    model = state.model(body.text("model_id", max_chars=512), tenant)
    # The SDK loads the tokenizer from tokenizer_id: the base model as the caller named it (a folder
    # path it shares with the service, typically), never the service's own path for it.
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_data": {"arch": "causal_lm", "model_name": model.base_model, "tokenizer_id": model.base_model},
        "is_lora": model.lora_rank is not None,
        "lora_rank": model.lora_rank,
        "model_name": model.base_model,
    }


# --- training ops, in seq_id order -----------------------------------------------------------
async def _off_loop(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    call = functools.partial(fn, *args, **kwargs)
    return await asyncio.to_thread(call) if size > CHECK_ON_LOOP_BYTES else call()


@router.post("/forward_backward")
async def forward_backward(request: Request, state: State, tenant: TenantDep) -> dict[str, Any]:
    from icefloe.service.tinker import convert  # protobuf and torch: imported on first use

    declared = request.headers.get("content-length", "")
    raw = await read_body(request.receive, declared=int(declared) if declared.isdigit() else None) or b""
    # A large body is counted from its wire bytes first, off the loop (a Python step per field): parsing
    # builds up to 70 bytes of objects per byte, and its model is looked up before anything is built. One
    # of at most CHECK_ON_LOOP_BYTES builds at most a few MB, so it is parsed as it is.
    model = (
        state.model(await asyncio.to_thread(convert.model_id_of, raw), tenant)
        if len(raw) > CHECK_ON_LOOP_BYTES
        else None
    )
    try:
        message = await _off_loop(len(raw), convert.pb.ForwardBackwardRequest.FromString, raw)
    except Exception as exc:  # protobuf raises DecodeError, a plain Exception subclass
        raise InvalidRequestError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from None
    model = model or state.model(message.model_id, tenant)
    max_tokens = state.manager.settings.max_tokens_per_request
    with state.turn(model, message.seq_id) as turn:
        if turn.answer is not None:
            return turn.answer
        job = await state.live(model.job_id)
        sub_job_id = state.sub_job(job, "training")
        limit = job.specs[sub_job_id].config.max_seq_len
        batch, layout = await _off_loop(
            len(raw), convert.batch_from_request, message, pad_id=0, context_length=limit, max_tokens=max_tokens
        )
        item = FwdBwd(sub_job_id, batch, OP_FORWARD if message.forward_only else OP_FWD_BWD)
        # Rendered when polled: each datum's log-probs cut out of the engine's tensor, as protobuf.
        return turn.queue(job, item, functools.partial(convert.forward_backward_output, layout=layout), tenant)


_ADAM_KEYS = ("beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@router.post("/optim_step")
async def optim_step(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    model = state.model(body.text("model_id", max_chars=512), tenant)
    with state.turn(model, _seq_id(body)) as turn:
        if turn.answer is not None:
            return turn.answer
        if body.value.get("optimizer_params") is not None:
            raise InvalidRequestError("optimizer_params (a non-Adam optimizer) is not served; send adam_params")
        adam = body.section("adam_params" if "adam_params" in body.value else "optim_params")
        unknown = sorted(set(adam.value) - {"learning_rate", "type", *_ADAM_KEYS})
        if unknown:
            known = ["learning_rate", *_ADAM_KEYS]
            raise InvalidRequestError(f"{adam.where}{unknown} are not Adam parameters; send only {known}")
        learning_rate = adam.number("learning_rate", 1e-4, low=0, null_ok=False)
        params = {key: adam.number(key, null_ok=False) for key in _ADAM_KEYS if key in adam.value}
        job = await state.live(model.job_id)
        item = Step(state.sub_job(job, "training"), learning_rate, params)
        return turn.queue(job, item, _optim_result, tenant)


def _optim_result(result: dict[str, Any]) -> dict[str, Any]:
    metrics = {"grad_norm:mean": float(result["grad_norm"]), "learning_rate:mean": float(result["lr"])}
    return {"type": "optim_step", "metrics": metrics}


@router.post("/save_weights")
async def save_weights(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    model, seq_id = state.model(body.text("model_id", max_chars=512), tenant), _seq_id(body)
    with state.turn(model, seq_id) as turn:
        if turn.answer is not None:
            return turn.answer
        name = checkpoint_name(body.value.get("path") or f"seq{seq_id}", "path")
        path = CheckpointPath(model.model_id, "weights", name)
        job, save = await _save(state, model, path, kind="resumable")
        answer = {"type": "save_weights", "path": str(path)}
        return turn.queue(job, save, functools.partial(_fixed, answer), tenant)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    model, seq_id = state.model(body.text("model_id", max_chars=512), tenant), _seq_id(body)
    with state.turn(model, seq_id) as turn:
        if turn.answer is not None:
            return turn.answer
        session_seq = body.integer("sampling_session_seq_id", None, low=0, high=_MAX_SEQ_ID)
        if session_seq is not None and session_seq not in model.sampler_saves:
            taken = f"{model.session_id}:sample:{session_seq}"
            if taken in state.samplers or await asyncio.to_thread(store.get_tinker_run, state.db, run_id=taken):
                raise ConflictError(
                    f"sampling_session_seq_id {session_seq} already names sampling session {taken}; "
                    "give each sampling client of a session a new number"
                )
        kind = body.value.get("kind", "snapshot")
        if kind not in _SAMPLER_KINDS:
            raise InvalidRequestError(f"kind must be one of {list(_SAMPLER_KINDS)}; got {kind!r:.40}")
        named = body.value.get("path") is not None
        if named:
            path = CheckpointPath(model.model_id, "sampler_weights", checkpoint_name(body.value["path"], "path"))
        else:  # kept only for the snapshot client made with it, so never a path a caller can name
            path = CheckpointPath(model.model_id, "snapshot", f"{session_seq}-{seq_id}-{uuid.uuid4().hex[:8]}")
        job, save = await _save(state, model, path, kind="weights-only")
        keeps_files = named or kind == "snapshot"
        answer: dict[str, Any] = {"type": "save_weights_for_sampler"}
        order = SamplerSave(model, path, save.sub_job_id, save if keeps_files else None, answer, session_seq,
                            named=named, snapshot=kind == "snapshot")  # fmt: skip
        return turn.queue(job, order, functools.partial(_fixed, answer), tenant)


@router.post("/save_weights_external")
async def save_weights_external(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    """The weights as a Hugging Face (or, with LoRA, PEFT) folder under ``tinker://<run>/external_weights/<name>``,
    each file encrypted to ``age_encryption_recipients`` when given. ``ttl_seconds`` is accepted and
    changes nothing: checkpoints live until deleted."""
    model = state.model(body.text("model_id", max_chars=512), tenant)
    with state.turn(model, _seq_id(body)) as turn:
        if turn.answer is not None:
            return turn.answer
        path = CheckpointPath(model.model_id, "external_weights", checkpoint_name(body.value.get("path"), "path"))
        body.integer("ttl_seconds", None, low=0)
        recipients = recipients_of(body.value.get("age_encryption_recipients"), "age_encryption_recipients")
        job, save = await _save(state, model, path, kind="weights-only", encrypt_to=recipients)
        return turn.queue(job, save, functools.partial(_external_answer, str(path)), tenant)


def _external_answer(path: str, result: dict[str, Any]) -> dict[str, Any]:
    return {"type": "save_weights_external", "path": path, "size_bytes": result["size_bytes"]}


def _fixed(answer: dict[str, Any], result: Any) -> dict[str, Any]:
    """The answer of an op whose result adds nothing to what it said when it was queued."""
    return answer


async def _save(
    state: TinkerState, model: Model, path: CheckpointPath, *, kind: str, encrypt_to: list[Any] | None = None
) -> tuple[LiveJob, Save]:
    """The model's running job, and the save of ``kind`` that writes ``path`` in its folder."""
    job = await state.live(model.job_id)
    folder = job.job_dir / "tinker" / path.kind / path.name
    sub_job_id = state.sub_job(job, "training")
    return job, Save(sub_job_id, folder, kind, checkpoint_id=path.checkpoint_id, encrypt_to=tuple(encrypt_to or ()))


@router.post("/load_weights")
async def load_weights(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    if body.value.get("session_id") is not None:  # resume: a new model that starts from the checkpoint
        path, optimizer = CheckpointPath.parse(body.text("path", max_chars=2048)), body.flag("optimizer")
        session_id = body.text("session_id", max_chars=256)
        model_id = f"{session_id}:train:{body.integer('model_seq_id', 0, low=0, high=_MAX_SEQ_ID)}"
        if model_id not in state.models:
            base_model, rank, layers = await asyncio.to_thread(state.base_model_of, path, tenant)
            job_id = await asyncio.to_thread(
                state.create_job, session_id, base_model, lora_rank=rank, training=True, name=model_id,
                tenant=tenant, source=path, load_optimizer=optimizer, layers=layers,
            )  # fmt: skip
            model = state.add_model(model_id, session_id, job_id, base_model, rank)
            answer = {"type": "load_weights", "path": str(path), "model_id": model_id}
            model.taken[-1] = {"request_id": state.future(job_id, lambda _: answer), "model_id": model_id}
        return state.model(model_id, tenant).taken[-1]
    model = state.model(body.text("model_id", max_chars=512), tenant)
    with state.turn(model, _seq_id(body)) as turn:
        if turn.answer is not None:
            return turn.answer
        path, optimizer = CheckpointPath.parse(body.text("path", max_chars=2048)), body.flag("optimizer")
        record = await asyncio.to_thread(state.checkpoint_record, path, tenant)
        job = await state.live(model.job_id)
        item = Load(state.sub_job(job, "training"), record["job_id"], path.checkpoint_id, optimizer)
        answer = {"type": "load_weights", "model_id": model.model_id, "path": str(path)}
        return turn.queue(job, item, functools.partial(_fixed, answer), tenant)


# --- sampling --------------------------------------------------------------------------------
@router.post("/create_sampling_session")
async def create_sampling_session(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    session_id = body.text("session_id", max_chars=256)
    seq = body.integer("sampling_session_seq_id", 0, low=0, high=_MAX_SEQ_ID)
    sampling_session_id = f"{session_id}:sample:{seq}"
    if sampling_session_id in state.samplers:
        state.sampler(sampling_session_id, tenant)  # 404 for another tenant's
        return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}
    if state.session(session_id, tenant) != "active":
        raise ConflictError(f"session {session_id} is finished; create a new session")
    model_path = body.text("model_path", None, max_chars=2048)
    if model_path:
        path = CheckpointPath.parse(model_path)
        model = state.models.get(path.run)
        held = model.sampler_files if model is not None else None
        if model is not None and state.tenancy.sees(tenant, model.owner) and held and held.path == path:
            state.pin(state.model_sampler(model, seq, str(path)), model)  # moves once it changes
        else:
            base_model, rank, layers = await asyncio.to_thread(state.base_model_of, path, tenant)
            job_id = await asyncio.to_thread(
                state.create_job, session_id, base_model, lora_rank=rank, training=False,
                name=sampling_session_id, tenant=tenant, source=path, layers=layers,
            )  # fmt: skip
            state.add_sampler(sampling_session_id, session_id, job_id, base_model, str(path))
    else:
        base_model = _base_model(body)
        job_id = await asyncio.to_thread(
            state.create_job, session_id, base_model, lora_rank=None, training=False, name=sampling_session_id,
            tenant=tenant,
        )  # fmt: skip
        state.add_sampler(sampling_session_id, session_id, job_id, base_model, None)
    return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}


@router.post("/join_sampling_session")
async def join_sampling_session(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    """A clone of a sampling client (unpickled in another process) gets a number of its own:
    its seq_ids start at number × 10⁹, so they never collide with another client's."""
    sampler = state.sampler(body.text("sampling_session_id", max_chars=512), tenant)
    sampler.clients += 1
    return {"type": "join_sampling_session", "client_counter": sampler.clients - 1}


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, state: State, tenant: TenantDep) -> dict[str, Any]:
    sampler = state.sampler(sampling_session_id, tenant)
    return {"sampler_id": sampling_session_id, "base_model": sampler.base_model, "model_path": sampler.model_path}


@router.post("/asample")
async def asample(body: Body, state: State, tenant: TenantDep, settings: SettingsDep) -> dict[str, Any]:
    sampler = state.sampler(body.text("sampling_session_id", max_chars=512), tenant)
    seq_id = _seq_id(body)
    if seq_id is not None and seq_id in sampler.taken:  # a resend: the first copy's answer, once it has one
        return await asyncio.shield(sampler.taken[seq_id])
    answered: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    if seq_id is not None:  # taken from now on: a resend that arrives meanwhile waits for this answer
        remember(sampler.taken, seq_id, answered)
    try:
        answered.set_result(await _queue_sample(state, sampler, body, settings))
    except BaseException as exc:
        sampler.taken.pop(seq_id, None)  # nothing was queued: a resend may try again
        answered.set_exception(exc if isinstance(exc, Exception) else ConflictError("the first copy was dropped"))
        answered.exception()  # read here, so no waiter is needed
        raise
    return answered.result()


async def _queue_sample(
    state: TinkerState, sampler: SamplingSession, body: Fields, settings: ServeSettings
) -> dict[str, Any]:
    """Check one sample call and queue it (it decodes in one batch with every sample queued beside it on
    its host, of any API or run); the SDK's answer."""
    tag = uuid.uuid4().hex  # names the call to the engine, which stops it on cancel_future
    prompt, params, last_n, targets = await _off_loop(body.size, _sample_call, body, settings, tag)
    # A job still waiting for its slots takes the call now: it is queued once the job runs, and each poll
    # of its future says why it waits.
    job_id = await state.sampling_job(sampler, sampler.owner)
    job = state.manager.live_job(job_id) or await state.live(job_id)
    sub_job_id = state.sub_job(job, "sampling")
    limit = job.specs[sub_job_id].config.max_seq_len  # the model's context length
    if len(prompt) >= limit:
        raise InvalidRequestError(
            f"prompt has {len(prompt)} tokens; the model has a context of {limit} tokens, so it must be shorter"
        )
    wanted = body.section("sampling_params").value.get("max_tokens")
    if wanted is not None and len(prompt) + wanted > limit:
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({wanted}) exceeds the model's context of {limit} "
            f"tokens; set max_tokens to at most {limit - len(prompt)}"
        )
    if wanted is None:  # until a stop or the end of the context, which the engines hold max_tokens to
        params = params.model_copy(update={"max_tokens": limit - len(prompt)})
    generated = params.n * (len(prompt) + params.max_tokens)
    if generated > settings.max_tokens_per_request:
        raise InvalidRequestError(
            f"num_samples ({params.n}) x (prompt + max_tokens) is up to {generated} tokens; at most "
            f"{settings.max_tokens_per_request} go in one request (icefloe serve --max-tokens-per-request): lower "
            "num_samples or max_tokens"
        )

    if last_n is not None and not (params.prompt_logprobs and last_n < len(prompt)):
        raise InvalidRequestError(
            f"prompt_logprobs_last_n must be between 1 and {len(prompt) - 1} (the prompt's scored positions), "
            f"with prompt_logprobs; got {last_n}"
        )
    if targets is not None:
        if len(targets) != len(prompt) - 1:
            raise InvalidRequestError(
                f"target_prompt_logprobs has {len(targets)} rows; the prompt has {len(prompt)} tokens, so it needs "
                f"{len(prompt) - 1} (one per position after the first)"
            )  # within the context now: Python numbers for the engine cost what a prompt of it may
        params = params.model_copy(update={"target_prompt_logprobs": tuple(map(tuple, targets.tolist()))})
    render = functools.partial(_sample_answer, last_n=last_n)
    future_id = state.sample(job, Sample(sub_job_id, [prompt.tolist()], [params]), render, tag=tag)
    if state.advertise_retrieve_futures:  # only a client told to poll retrieve_futures drains the queue
        sampler.track(body.value.get("seq_id"), future_id)
    return {"request_id": future_id, "sample_sequence_ids": [f"{future_id}:{i}" for i in range(params.n)]}


# The answer to a call cancel_future stopped, queued or not: the caller's doing, so a user error.
_CANCELLED: dict[str, str] = {"error": "cancelled by the caller", "category": "user"}
# The answer to a poll of a result no longer held (the service restarted, or it was among the oldest).
_NOT_KEPT: dict[str, str] = {
    "error": "the result of this call was not kept (the service restarted, or it was not polled in time); send it "
    "again",
    "category": "server",
}


def _sample_answer(samples: list[dict[str, Any]], *, last_n: int | None) -> dict[str, Any] | bytes:
    """A sample call's stored samples as the SDK's SampleResponse (the error of one stopped by cancel_future)."""
    from icefloe.service.tinker import convert

    if samples[0]["finish_reason"] == "cancelled":
        return dict(_CANCELLED)
    # The engine repeats the prompt's log-probs on each sample; the call keeps them once.
    prompt = {key: samples[0].pop(key, None) for key in _PROMPT_KEYS}
    for sample in samples[1:]:
        for key in _PROMPT_KEYS:
            sample.pop(key, None)
    return convert.sample_response({"samples": samples, **prompt}, last_n=last_n)


def _chunks(body: Fields) -> list[dict[str, Any]]:
    chunks = body.section("prompt").value.get("chunks")
    if not isinstance(chunks, list) or not all(isinstance(chunk, dict) for chunk in chunks):
        raise InvalidRequestError("prompt.chunks must be a list of chunk objects ({type, tokens})")
    return chunks


def _sample_call(
    body: Fields, settings: ServeSettings, tag: str
) -> tuple[np.ndarray, EngineSamplingParams, int | None, np.ndarray | None]:
    """The prompt's tokens, the engine's sampling params, ``prompt_logprobs_last_n`` and the
    ``target_prompt_logprobs`` of one call; the tokens and targets stay arrays until the model's context
    bounds them."""
    _refuse_unserved(body)
    chunks = []
    for index, chunk in enumerate(_chunks(body)):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidRequestError(
                f"prompt.chunks.{index} is a {chunk.get('type')} chunk; only encoded_text is served"
            )
        where, what = f"prompt.chunks.{index}.tokens", "a list of token ids (integers from 0)"
        chunks.append(int_array(chunk.get("tokens") or [], where, what, low=0, high=2**31))
    tokens = chunks[0] if len(chunks) == 1 else np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)
    if not len(tokens):
        raise InvalidRequestError("prompt is empty; give at least one token")
    n = body.integer("num_samples", 1, low=1, high=settings.max_samples_per_request)
    raw = body.section("sampling_params")
    stop = raw.value.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif type(stop) is array.array:  # token ids of a large body
        stop = stop.tolist()
    if isinstance(stop, list) and len(stop) > MAX_STOPS:
        raise InvalidRequestError(
            f"sampling_params.stop holds {len(stop)} entries; at most {MAX_STOPS} stop strings or token ids are served"
        )
    if stop is not None and not (
        isinstance(stop, list) and (all(type(s) is int for s in stop) or all(isinstance(s, str) for s in stop))
    ):
        raise InvalidRequestError(f"sampling_params.stop must be strings or token ids, not a mix; got {stop!r:.200}")
    topk = body.integer("topk_prompt_logprobs", 0, low=0, high=_MAX_TOPK)
    fields: dict[str, Any] = {
        "n": n,
        "max_tokens": raw.integer("max_tokens", 1_000_000, low=1),  # None: until a stop or the sequence limit
        "temperature": raw.number("temperature", 1.0, low=0, null_ok=False),
        "top_p": raw.number("top_p", 1.0, null_ok=False),
        "top_k": raw.integer("top_k", -1, low=-1),
        "seed": raw.integer("seed", None, low=0, high=2**64 - 1),
        "logprobs": True,
        "prompt_logprobs": body.flag("prompt_logprobs"),
        "topk_prompt_logprobs": topk,
        "tag": tag,
        # No stop: EOS stops. A stop list (even empty) replaces EOS.
        "ignore_eos": stop is not None,
    }
    if stop:
        fields["stop_token_ids" if type(stop[0]) is int else "stop"] = tuple(stop)
    try:
        params = EngineSamplingParams(**fields)
    except ValueError as exc:
        raise InvalidRequestError(f"sampling_params: {exc}") from None
    if n * len(tokens) > settings.max_tokens_per_request:
        raise InvalidRequestError(
            f"num_samples ({n}) x the prompt ({len(tokens)} tokens) exceeds {settings.max_tokens_per_request} tokens "
            "per request (icefloe serve --max-tokens-per-request)"
        )
    last_n = body.integer("prompt_logprobs_last_n", None, low=1)
    return tokens, params, last_n, _targets(body.value.get("target_prompt_logprobs"))


def _targets(raw: Any) -> np.ndarray | None:
    """``target_prompt_logprobs`` (the SDK's TensorData: int64 ``[len(prompt) - 1, K]``, dense or sparse
    CSR whose unlisted cells ask for nothing) as ``[rows, K]`` ids, -1 where nothing is asked."""
    if raw is None:
        return None
    where = "target_prompt_logprobs"
    if not isinstance(raw, dict) or raw.get("dtype") != "int64":
        raise InvalidRequestError(f"{where} must be an int64 tensor ({{data, dtype: 'int64', shape: [rows, K]}})")
    shape, data = raw.get("shape"), raw.get("data")
    shape = shape.tolist() if type(shape) is array.array else shape  # two numbers of a large body
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(d) is int for d in shape)):
        raise InvalidRequestError(f"{where}.shape must be [len(prompt) - 1, K]; got {shape!r:.80}")
    rows, k = shape
    if not 1 <= k <= _MAX_TOPK or rows < 1:
        raise InvalidRequestError(f"{where}.shape must be [len(prompt) - 1, K] with K in [1, {_MAX_TOPK}]; got {shape}")
    data = int_array(data, f"{where}.data", "token ids (integers from 0), or -1 for none", low=-1, high=2**63)
    if not len(data) or data.max() < 0:
        raise InvalidRequestError(f"{where} names no token id; ask for at least one, or leave it unset")
    crow, cols = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    if crow is None and cols is None:
        if len(data) != rows * k:
            raise InvalidRequestError(f"{where}.data has {len(data)} values for shape {shape}; send {rows * k}")
        return data.reshape(rows, k)
    offsets = f"{where}.sparse_crow_indices"
    crow = int_array(crow, offsets, "non-decreasing offsets into data", low=0, high=len(data) + 1)
    cols = int_array(cols, f"{where}.sparse_col_indices", f"columns in [0, {k})", low=0, high=k)
    if len(crow) != rows + 1 or len(cols) != len(data):
        raise InvalidRequestError(
            f"{where}: sparse_crow_indices must be {rows + 1} offsets and sparse_col_indices one column per value"
        )
    if (np.diff(crow) < 0).any():
        raise InvalidRequestError(f"{offsets} must be non-decreasing offsets into data")
    dense = np.full((rows, k), -1, dtype=np.int64)
    listed = slice(crow[0], crow[-1])
    dense[np.repeat(np.arange(rows), np.diff(crow)), cols[listed]] = data[listed]
    return dense


def _refuse_unserved(body: Fields) -> None:
    """Refuse the sample request fields the sampler cannot honour, each naming what to do instead."""
    if body.value.get("topk_sample_logprobs"):
        raise InvalidRequestError(
            f"topk_sample_logprobs={body.value['topk_sample_logprobs']!r:.40} is not served "
            "(top-k log-probs of sampled tokens); leave it 0, or score prompt + completion with "
            "topk_prompt_logprobs and max_tokens=1"
        )
    if body.value.get("prompt_alt_tokens_k"):
        raise InvalidRequestError(
            f"prompt_alt_tokens_k={body.value['prompt_alt_tokens_k']!r:.40} is not served; leave it 0"
        )
    if body.value.get("record_stability_info"):
        raise InvalidRequestError(
            "record_stability_info=true is not served: it only feeds the stable_reinforce loss, which is not "
            "served either; sample with record_stability_info=False and train with importance_sampling, ppo, "
            "cispo, dro or gspo"
        )


# --- futures ---------------------------------------------------------------------------------
@router.post("/cancel_future")
async def cancel_future(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    await asyncio.to_thread(state.cancel, body.text("request_id", max_chars=512), tenant)
    return {}


@router.post("/retrieve_futures")
async def retrieve_futures(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    """A sampling client's finished sample futures since ``prev_cursor`` (a long-poll); the client
    then fetches each one's result with ``retrieve_future``, which answers at once."""
    target = body.section("target")
    if target.value.get("type", "sampling_session") != "sampling_session":
        kind = target.value.get("type")
        raise InvalidRequestError(f"target.type {kind!r:.40} is not served; poll a sampling_session")
    sampler = state.sampler(target.text("sampling_session_id", max_chars=512), tenant)
    timeout = body.number("timeout", None, low=0)
    wait_s = _POLL_S if timeout is None else min(timeout, _POLL_S)
    clone = target.integer("cloned_sampler_id", 0, low=0)
    prev_cursor = body.integer("prev_cursor", 0, low=0)
    completions, cursor = await state.completions(sampler, clone, prev_cursor, wait_s)
    return {"completions": completions, "cursor": cursor}


def _try_again(future_id: str, state: TinkerState, job_id: str) -> JSONResponse:
    """Poll again; while the job waits for slots, the SDK's queue-state observer is told why."""
    answer = {"type": "try_again", "request_id": future_id, "queue_state": "active"}
    if waiting := state.manager.waiting(job_id):
        answer |= {"queue_state": "paused_capacity", "queue_state_reason": waiting}
    return JSONResponse(answer)


@router.post("/retrieve_future")
async def retrieve_future(body: Body, state: State, tenant: TenantDep) -> Response:
    future_id = body.text("request_id", max_chars=512)
    if future_id not in state.futures:
        return JSONResponse(await asyncio.to_thread(state.lost_future, future_id, tenant))
    future = state.future_of(future_id, tenant)
    if future.cancelled:  # by cancel_future before its call was queued (its job was starting): it never runs
        return JSONResponse(dict(_CANCELLED))
    try:
        if future.request_id is None and future.submitted is None:
            job = await state.running(future.job_id, _POLL_S)
            if job is None:
                return _try_again(future_id, state, future.job_id)
            answer = future.render(None)
        else:
            request_id = await state.request_of(future, _POLL_S)
            if request_id is None:
                return _try_again(future_id, state, future.job_id)
            row = await state.manager.requests.wait(future.job_id, request_id, _POLL_S)
            if row["status"] in ("pending", "running"):
                return _try_again(future_id, state, future.job_id)
            if row["status"] != "done":
                # A caller's mistake fails the request and leaves the job up; an engine crash fails the job.
                running = state.manager.public(future.job_id)["status"] == "running"
                error = state.manager.settings.public_text(row["error"] or row["status"])
                return JSONResponse({"error": error, "category": "user" if running else "server"})
            try:  # rendered from the result as the engines made it on the first poll, the same answer after
                answer = state.manager.held.answer(row["request_id"], future.render)
            except KeyError:  # the service restarted since, or the result was among the oldest held
                return JSONResponse(dict(_NOT_KEPT))
    except Exception as exc:  # the job failed to start, or the result could not be turned into an answer
        if isinstance(exc, InvalidRequestError):
            raise
        error = state.manager.settings.public_text(f"{type(exc).__name__}: {exc}")
        return JSONResponse({"error": error, "category": "server"})
    if isinstance(answer, bytes):
        return Response(answer, media_type=_PROTO)
    return JSONResponse(answer)
