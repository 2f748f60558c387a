"""The Tinker API's routes (``/api/v1``), as the ``tinker`` SDK calls them.

The ``tinker`` package (its protobuf classes) imports torch, so :mod:`.convert` is imported on
first use: ``icefloe serve`` starts without torch in its own process.

The ``X-API-Key`` is checked before a handler runs (``middleware.RequireToken``). Each handler
validates, queues the work on the model's job (see :mod:`icefloe.service.tinker.state`) and
answers the SDK's shape: a future ``{request_id}`` for ops, the result itself for the rest.
Forward-backward requests and forward-backward / sample results travel as protobuf, the rest as JSON.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse

from icefloe.protocol import (
    OP_FORWARD,
    OP_FWD_BWD,
    OP_LOAD,
    OP_SAVE,
    OP_STEP,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
)
from icefloe.protocol import SamplingParams as EngineSamplingParams
from icefloe.service import store
from icefloe.service.models import WeightSyncPayload
from icefloe.service.operations import Sampling, submit_sampling, submit_weight_sync
from icefloe.service.tinker.state import CheckpointPath, Model, SamplingSession, TinkerState, remember

__all__ = ["router"]

_POLL_S = 30.0  # the SDK gives retrieve_future 45 s; answer try_again well before
_PROTO = "application/x-protobuf"
_PROMPT_KEYS = ("prompt_logprobs", "topk_prompt_logprobs")  # per call, not per sample


async def _state(request: Request) -> TinkerState:
    return request.app.state.tinker


# The X-API-Key is checked by the service's RequireToken layer, like every other token.
router = APIRouter(prefix="/api/v1", tags=["tinker"])
State = Annotated[TinkerState, Depends(_state)]


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
    # An abandoned sample future sends cancel_future, so its call leaves the sampler's queue at once.
    return {"sample_cancel_enabled": True}


@router.post("/create_session")
async def create_session(state: State) -> dict[str, Any]:
    return {"type": "create_session", "session_id": state.create_session()}


@router.post("/session_heartbeat")
async def session_heartbeat(body: dict[str, Any], state: State) -> Response:
    session_id = str(body.get("session_id"))
    if state.session(session_id) != "active":
        return JSONResponse({"code": "session_finished", "message": "the session has finished"}, status_code=410)
    state.heartbeat(session_id)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, state: State) -> dict[str, Any]:
    await asyncio.to_thread(state.finish_session, session_id)
    return {}


@router.post("/telemetry")
async def telemetry() -> dict[str, Any]:
    return {"status": "accepted"}


# --- models ----------------------------------------------------------------------------------
@router.post("/create_model")
async def create_model(body: dict[str, Any], state: State) -> dict[str, Any]:
    session_id, seq = str(body.get("session_id")), int(body.get("model_seq_id", 0))
    model_id = f"{session_id}:train:{seq}"
    if model_id not in state.models:
        lora = body.get("lora_config") or {}
        rank = lora.get("rank")
        # The SDK's defaults: every layer kind, the output layer (unembedding) included.
        layers = {key: lora.get(key, True) for key in ("train_attn", "train_mlp", "train_unembed")}
        base_model = _base_model(body.get("base_model"))
        job_id = await asyncio.to_thread(
            state.create_job, session_id, base_model, lora_rank=rank, training=True, name=model_id, layers=layers
        )
        state.models[model_id] = Model(model_id, session_id, job_id, base_model, rank)
        state.models[model_id].taken[-1] = {
            "request_id": state.future(job_id, lambda _: {"type": "create_model", "model_id": model_id}),
            "model_id": model_id,
        }
    return state.models[model_id].taken[-1]


@router.post("/get_info")
async def get_info(body: dict[str, Any], state: State) -> dict[str, Any]:
    model = state.model(str(body.get("model_id")))
    from icefloe.engines.models import resolve_model

    # The folder the job loads (a name under --model-root resolved), where the SDK finds the tokenizer.
    job = await state.live(model.job_id)
    folder = await asyncio.to_thread(resolve_model, next(iter(job.specs.values())).config.model)
    return {
        "type": "get_info",
        "model_id": model.model_id,
        "model_data": {"arch": "causal_lm", "model_name": model.base_model, "tokenizer_id": str(folder)},
        "is_lora": model.lora_rank is not None,
        "lora_rank": model.lora_rank,
        "model_name": model.base_model,
    }


# --- training ops, in seq_id order -----------------------------------------------------------
@router.post("/forward_backward")
async def forward_backward(request: Request, state: State) -> dict[str, Any]:
    from icefloe.service.tinker import convert  # protobuf and torch: imported on first use

    message = convert.pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(await request.body())
    except Exception as exc:  # protobuf raises DecodeError, a plain Exception subclass
        raise InvalidRequestError(f"forward_backward body is not a ForwardBackwardRequest protobuf: {exc}") from None
    model = state.model(message.model_id)

    async def prepare() -> Callable[[], str]:
        job = await state.live(model.job_id)
        sub_job_id = state.sub_job(job, "training")
        context_length = job.specs[sub_job_id].config.max_seq_len
        batch, lengths = convert.batch_from_request(message, pad_id=0, context_length=context_length)
        from icefloe.engines.batch import validate_batch

        batch = validate_batch(batch, require_context=True)
        host = job.engines
        op = OP_FORWARD if message.forward_only else OP_FWD_BWD

        def run() -> dict[str, Any]:
            result = host.fwd_bwd(sub_job_id, batch)
            rows = result.pop("logprobs")
            result["logprobs"] = [rows[i, :n].tolist() for i, n in enumerate(lengths)]
            return result

        return lambda: state.manager.submit(job, sub_job_id, op, run)

    return await state.in_turn(model, message.seq_id, convert.forward_backward_output, prepare)


@router.post("/optim_step")
async def optim_step(body: dict[str, Any], state: State) -> dict[str, Any]:
    model = state.model(str(body.get("model_id")))
    params = dict(body.get("adam_params") or body.get("optim_params") or {})
    if body.get("optimizer_params"):
        raise InvalidRequestError("optimizer_params (a non-Adam optimizer) is not served; send adam_params")
    learning_rate = float(params.pop("learning_rate", 1e-4))
    params.pop("type", None)

    async def prepare() -> Callable[[], str]:
        job = await state.live(model.job_id)
        sub_job_id, host = state.sub_job(job, "training"), job.engines
        return lambda: state.manager.submit(
            job, sub_job_id, OP_STEP, lambda: host.step(sub_job_id, learning_rate, params)
        )

    return await state.in_turn(model, body.get("seq_id"), _optim_result, prepare)


def _optim_result(result: dict[str, Any]) -> dict[str, Any]:
    metrics = {"grad_norm:mean": float(result["grad_norm"]), "learning_rate:mean": float(result["lr"])}
    return {"type": "optim_step", "metrics": metrics}


@router.post("/save_weights")
async def save_weights(body: dict[str, Any], state: State) -> dict[str, Any]:
    model = state.model(str(body.get("model_id")))
    path = CheckpointPath(model.model_id, "weights", str(body.get("path") or f"seq{body.get('seq_id')}"))
    CheckpointPath.parse(str(path))  # refuses a name holding '/'
    answer, prepare = _saver(state, model, path, "resumable", sync=False)
    return await state.in_turn(model, body.get("seq_id"), lambda _: answer, prepare)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(body: dict[str, Any], state: State) -> dict[str, Any]:
    model = state.model(str(body.get("model_id")))
    name = body.get("path") or f"ephemeral-{body.get('sampling_session_seq_id')}-{body.get('seq_id')}"
    path = CheckpointPath(model.model_id, "sampler_weights", str(name))
    CheckpointPath.parse(str(path))
    session_seq = body.get("sampling_session_seq_id")
    answer, prepare = _saver(
        state, model, path, "weights-only", sync=True, session_seq=session_seq, named=bool(body.get("path"))
    )
    return await state.in_turn(model, body.get("seq_id"), lambda _: answer, prepare)


def _saver(
    state: TinkerState, model: Model, path: CheckpointPath, kind: str, *, sync: bool,
    session_seq: int | None = None, named: bool = True,
) -> tuple[dict[str, Any], Callable[[], Awaitable[Callable[[], str]]]]:  # fmt: skip
    """The answer of a save of ``kind`` (and, for a sampler, a weight sync into the model's sampler),
    filled in when it is queued, and what prepares it for :meth:`TinkerState.in_turn`.

    An unnamed sampler save (``save_weights_and_get_sampling_client``) writes no files: its
    weights only ever live in the model's sampler, which the sync fills.
    """
    answer: dict[str, Any] = {"type": "save_weights" if not sync else "save_weights_for_sampler"}

    async def prepare() -> Callable[[], str]:
        job = await state.live(model.job_id)
        sub_job_id, host = state.sub_job(job, "training"), job.engines

        def run() -> dict[str, Any]:
            result = host.save(sub_job_id, job.job_dir / "tinker" / path.kind / path.name, kind)
            store.upsert_checkpoint(
                state.manager.db, job_id=job.job_id, checkpoint_id=path.checkpoint_id,
                global_steps=result["global_step"], avg_loss=None, checkpoint_type=result["kind"],
                path=result["path"],
            )  # fmt: skip
            return result

        def queue() -> str:
            if named or not sync:
                request_id = state.manager.submit(job, sub_job_id, OP_SAVE, run)
                answer["path"] = str(path)
            if sync:
                request_id = submit_weight_sync(state.manager, job, WeightSyncPayload(), sub_job_id)
                model.sampler_path = str(path)
                if session_seq is not None:
                    sampler = _sampling_session(state, model.session_id, int(session_seq), model, str(path))
                    answer["sampling_session_id"] = sampler.sampling_session_id
            return request_id

        return queue

    return answer, prepare


@router.post("/load_weights")
async def load_weights(body: dict[str, Any], state: State) -> dict[str, Any]:
    path = CheckpointPath.parse(str(body.get("path")))
    optimizer = bool(body.get("optimizer", False))
    if body.get("session_id") is not None:  # resume: a new model that starts from the checkpoint
        session_id, seq = str(body["session_id"]), int(body.get("model_seq_id", 0))
        model_id = f"{session_id}:train:{seq}"
        if model_id not in state.models:
            base_model, rank, layers = await asyncio.to_thread(state.base_model_of, path)
            job_id = await asyncio.to_thread(
                state.create_job, session_id, base_model, lora_rank=rank, training=True, name=model_id,
                source=path, load_optimizer=optimizer, layers=layers,
            )  # fmt: skip
            state.models[model_id] = Model(model_id, session_id, job_id, base_model, rank)
            answer = {"type": "load_weights", "path": str(path), "model_id": model_id}
            state.models[model_id].taken[-1] = {
                "request_id": state.future(job_id, lambda _: answer),
                "model_id": model_id,
            }
        return state.models[model_id].taken[-1]
    model = state.model(str(body.get("model_id")))

    async def prepare() -> Callable[[], str]:
        folder = await asyncio.to_thread(state.checkpoint_folder, path)
        job = await state.live(model.job_id)
        sub_job_id, host = state.sub_job(job, "training"), job.engines
        return lambda: state.manager.submit(job, sub_job_id, OP_LOAD, lambda: host.load(sub_job_id, folder, optimizer))

    answer = {"type": "load_weights", "path": str(path), "model_id": model.model_id}
    return await state.in_turn(model, body.get("seq_id"), lambda _: answer, prepare)


# --- sampling --------------------------------------------------------------------------------
def _sampling_session(state: TinkerState, session_id: str, seq: int, model: Model, model_path: str) -> SamplingSession:
    """A sampling session on the model's own sampler."""
    sampling_session_id = f"{session_id}:sample:{seq}"
    sampler = SamplingSession(sampling_session_id, session_id, model.job_id, model.base_model, model_path)
    state.samplers[sampling_session_id] = sampler
    return sampler


@router.post("/create_sampling_session")
async def create_sampling_session(body: dict[str, Any], state: State) -> dict[str, Any]:
    session_id, seq = str(body.get("session_id")), int(body.get("sampling_session_seq_id", 0))
    sampling_session_id = f"{session_id}:sample:{seq}"
    if sampling_session_id in state.samplers:
        return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}
    model_path = body.get("model_path")
    if model_path:
        path = CheckpointPath.parse(str(model_path))
        model = state.models.get(path.run)
        if model is not None and model.sampler_path == str(path):  # the model's sampler holds these weights
            sampler = _sampling_session(state, session_id, seq, model, str(path))
        else:
            base_model, rank, layers = await asyncio.to_thread(state.base_model_of, path)
            job_id = await asyncio.to_thread(
                state.create_job, session_id, base_model, lora_rank=rank, training=False,
                name=sampling_session_id, source=path, layers=layers,
            )  # fmt: skip
            sampler = SamplingSession(sampling_session_id, session_id, job_id, base_model, str(path))
            state.samplers[sampling_session_id] = sampler
    else:
        base_model = _base_model(body.get("base_model"))
        job_id = await asyncio.to_thread(
            state.create_job, session_id, base_model, lora_rank=None, training=False, name=sampling_session_id
        )
        state.samplers[sampling_session_id] = SamplingSession(sampling_session_id, session_id, job_id, base_model, None)
    return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}


@router.post("/join_sampling_session")
async def join_sampling_session(body: dict[str, Any], state: State) -> dict[str, Any]:
    """A clone of a sampling client (unpickled in another process) gets a number of its own:
    its seq_ids start at number × 10⁹, so they never collide with another client's."""
    sampler = _sampler(state, str(body.get("sampling_session_id")))
    sampler.clients += 1
    return {"type": "join_sampling_session", "client_counter": sampler.clients - 1}


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, state: State) -> dict[str, Any]:
    sampler = _sampler(state, sampling_session_id)
    return {"sampler_id": sampling_session_id, "base_model": sampler.base_model, "model_path": sampler.model_path}


def _sampler(state: TinkerState, sampling_session_id: str) -> SamplingSession:
    sampler = state.samplers.get(sampling_session_id)
    if sampler is None:
        raise NotFoundError(f"sampling session {sampling_session_id} not found; create it with create_sampling_session")
    return sampler


@router.post("/asample")
async def asample(body: dict[str, Any], state: State) -> dict[str, Any]:
    if not body.get("sampling_session_id"):
        raise InvalidRequestError("sampling_session_id is required; create one with create_sampling_session")
    sampler = _sampler(state, str(body["sampling_session_id"]))
    seq_id = body.get("seq_id")
    if seq_id is not None and seq_id in sampler.taken:  # a resend: the first copy's answer, once it has one
        return await asyncio.shield(sampler.taken[seq_id])
    answered: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    if seq_id is not None:  # taken from now on: a resend that arrives meanwhile waits for this answer
        remember(sampler.taken, seq_id, answered)
    try:
        answered.set_result(await _queue_sample(state, sampler, body))
    except BaseException as exc:
        sampler.taken.pop(seq_id, None)  # nothing was queued: a resend may try again
        answered.set_exception(exc if isinstance(exc, Exception) else ConflictError("the first copy was dropped"))
        answered.exception()  # read here, so no waiter is needed
        raise
    return answered.result()


async def _queue_sample(state: TinkerState, sampler: SamplingSession, body: dict[str, Any]) -> dict[str, Any]:
    """Validate one sample call and queue it with the calls gathered beside it; the SDK's answer."""
    prompt = _prompt_tokens(body.get("prompt") or {})
    params = _sampling_params(body)
    # A job still waiting for its slots takes the call now: it waits in its gathering (sent once the job
    # runs), and each poll of its future says why it waits.
    job = state.manager.live_job(sampler.job_id) or await state.live(sampler.job_id)
    sub_job_id = state.sub_job(job, "sampling")
    limit = job.specs[sub_job_id].config.max_seq_len  # the model's context length
    if len(prompt) >= limit:
        raise InvalidRequestError(
            f"prompt has {len(prompt)} tokens; the model has a context of {limit} tokens, so it must be shorter"
        )
    wanted = (body.get("sampling_params") or {}).get("max_tokens")
    if wanted is not None and len(prompt) + int(wanted) > limit:
        raise InvalidRequestError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({wanted}) exceeds the model's context of {limit} "
            f"tokens; set max_tokens to at most {limit - len(prompt)}"
        )
    if wanted is None:  # until a stop or the end of the context, which the engines hold max_tokens to
        params = params.model_copy(update={"max_tokens": limit - len(prompt)})

    Call = tuple[list[int], EngineSamplingParams] | None  # None: cancelled before it was sent

    def submit(gathered: list[Call]) -> str:
        """One request for the calls gathered here; it samples in one batch with whatever is queued beside it."""
        calls = [call for call in gathered if call is not None]

        def render(samples: list[dict[str, Any]]) -> list[dict[str, Any] | None]:
            rest, results = iter(samples), []
            for call in gathered:
                if call is None:
                    results.append(None)
                    continue
                mine = [next(rest) for _ in range(call[1].n)]
                # The engine repeats the prompt's log-probs on each sample; the call keeps them once.
                prompt = {key: mine[0].pop(key, None) for key in _PROMPT_KEYS}  # the samples are this call's own
                for sample in mine[1:]:
                    for key in _PROMPT_KEYS:
                        sample.pop(key, None)
                results.append({"samples": mine, **prompt})
            return results

        item = Sampling(sub_job_id, [p for p, _ in calls], [q for _, q in calls], render)
        return submit_sampling(state.manager, job, item, as_json=False)

    from icefloe.service.tinker import convert

    last_n = body.get("prompt_logprobs_last_n")
    if last_n is not None and not (params.prompt_logprobs and 1 <= int(last_n) < len(prompt)):
        raise InvalidRequestError(
            f"prompt_logprobs_last_n must be between 1 and {len(prompt) - 1} (the prompt's scored positions), "
            f"with prompt_logprobs; got {last_n}"
        )
    render = functools.partial(convert.sample_response, last_n=None if last_n is None else int(last_n))
    future_id = state.future(job.job_id, render, gathered=state.gather(sampler, (prompt, params), submit))
    if state.advertise_retrieve_futures:  # only a client told to poll retrieve_futures drains the queue
        sampler.track(body.get("seq_id"), future_id)
    return {"request_id": future_id, "sample_sequence_ids": [f"{future_id}:{i}" for i in range(params.n)]}


def _prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    tokens: list[int] = []
    for index, chunk in enumerate(prompt.get("chunks") or []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidRequestError(
                f"prompt.chunks.{index} is a {chunk.get('type')} chunk; only encoded_text is served"
            )
        tokens += [int(t) for t in chunk.get("tokens") or []]
    if not tokens:
        raise InvalidRequestError("prompt is empty; give at least one token")
    return tokens


def _sampling_params(body: dict[str, Any]) -> EngineSamplingParams:
    raw = body.get("sampling_params") or {}
    stop = raw.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    fields: dict[str, Any] = {
        "n": int(body.get("num_samples", 1)),
        "max_tokens": int(raw.get("max_tokens") or 1_000_000),  # None: until a stop or the sequence limit
        "temperature": float(raw.get("temperature", 1.0)),
        "top_p": float(raw.get("top_p", 1.0)),
        "top_k": int(raw.get("top_k", -1)),
        "seed": raw.get("seed"),
        "logprobs": True,
        "prompt_logprobs": bool(body.get("prompt_logprobs")),
        "topk_prompt_logprobs": int(body.get("topk_prompt_logprobs") or 0),
        # No stop: EOS stops. A stop list (even empty) replaces EOS.
        "ignore_eos": stop is not None,
    }
    if stop:
        if all(isinstance(s, int) for s in stop):
            fields["stop_token_ids"] = tuple(stop)
        elif all(isinstance(s, str) for s in stop):
            fields["stop"] = tuple(stop)
        else:
            raise InvalidRequestError(f"sampling_params.stop must be strings or token ids, not a mix; got {stop!r}")
    _refuse_unserved(body)
    try:
        return EngineSamplingParams(**fields)
    except ValueError as exc:
        raise InvalidRequestError(f"sampling_params: {exc}") from None


def _refuse_unserved(body: dict[str, Any]) -> None:
    """Refuse the sample request fields the sampler cannot honour, each naming what to do instead."""
    if body.get("topk_sample_logprobs"):
        raise InvalidRequestError(
            f"topk_sample_logprobs={body['topk_sample_logprobs']} is not served "
            "(top-k log-probs of sampled tokens); leave it 0, or score prompt + completion with "
            "topk_prompt_logprobs and max_tokens=1"
        )
    if body.get("prompt_alt_tokens_k"):
        raise InvalidRequestError(f"prompt_alt_tokens_k={body['prompt_alt_tokens_k']} is not served; leave it 0")
    if body.get("target_prompt_logprobs") is not None:
        raise InvalidRequestError(
            "target_prompt_logprobs is not served; leave it unset, or read the tokens you need from "
            "topk_prompt_logprobs"
        )
    if body.get("record_stability_info"):
        raise InvalidRequestError(
            "record_stability_info=true is not served: it only feeds the stable_reinforce loss, which is not "
            "served either; sample with record_stability_info=False and train with importance_sampling, ppo, "
            "cispo, dro or gspo"
        )


# --- RestClient: checkpoints of a run ------------------------------------------------------------
@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, state: State) -> dict[str, Any]:
    model = state.model(model_id)
    records = await asyncio.to_thread(store.list_checkpoints, state.manager.db, job_id=model.job_id)
    checkpoints = []
    for record in records:
        kind, _, name = record["checkpoint_id"].removeprefix("tinker-").partition("-")
        if kind not in ("weights", "sampler_weights") or not name:
            continue  # saved through the training API, not a tinker:// path
        checkpoints.append({
            "checkpoint_id": f"{kind}/{name}",
            "checkpoint_type": "training" if kind == "weights" else "sampler",
            "time": record["created_at"],
            "tinker_path": str(CheckpointPath(model_id, kind, name)),
        })  # fmt: skip
    return {"checkpoints": checkpoints}


@router.post("/copy_weights")
async def copy_weights(body: dict[str, Any], state: State) -> dict[str, Any]:
    # One service has no projects: destination_project_id, session_id and ttl_seconds change nothing.
    source = CheckpointPath.parse(str(body.get("source_path")))
    copy = await asyncio.to_thread(state.copy_checkpoint, source)
    return {"tinker_path": str(copy)}


@router.post("/weights_info")
async def weights_info(body: dict[str, Any], state: State) -> dict[str, Any]:
    path = CheckpointPath.parse(str(body.get("tinker_path")))
    base_model, rank, _ = await asyncio.to_thread(state.base_model_of, path)
    return {"base_model": base_model, "is_lora": rank is not None, "lora_rank": rank}


# --- futures ---------------------------------------------------------------------------------
@router.post("/cancel_future")
async def cancel_future(body: dict[str, Any], state: State) -> dict[str, Any]:
    state.cancel(str(body.get("request_id")))
    return {}


@router.post("/retrieve_futures")
async def retrieve_futures(body: dict[str, Any], state: State) -> dict[str, Any]:
    """A sampling client's finished sample futures since ``prev_cursor`` (a long-poll); the client
    then fetches each one's result with ``retrieve_future``, which answers at once."""
    target = body.get("target") or {}
    if target.get("type", "sampling_session") != "sampling_session":
        raise InvalidRequestError(f"target.type {target.get('type')!r} is not served; poll a sampling_session")
    sampler = _sampler(state, str(target.get("sampling_session_id")))
    timeout = body.get("timeout")
    wait_s = _POLL_S if timeout is None else max(0.0, min(float(timeout), _POLL_S))
    clone, prev_cursor = int(target.get("cloned_sampler_id") or 0), int(body.get("prev_cursor") or 0)
    completions, cursor = await state.completions(sampler, clone, prev_cursor, wait_s)
    return {"completions": completions, "cursor": cursor}


def _try_again(future_id: str, state: TinkerState, job_id: str) -> JSONResponse:
    """Poll again; while the job waits for slots, the SDK's queue-state observer is told why."""
    answer = {"type": "try_again", "request_id": future_id, "queue_state": "active"}
    if waiting := state.manager.waiting(job_id):
        answer |= {"queue_state": "paused_capacity", "queue_state_reason": waiting}
    return JSONResponse(answer)


@router.post("/retrieve_future")
async def retrieve_future(body: dict[str, Any], state: State) -> Response:
    future_id = str(body.get("request_id"))
    future = state.futures.get(future_id)
    if future is None:
        raise NotFoundError(f"future {future_id} not found")
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
                return JSONResponse(
                    {"error": row["error"] or row["status"], "category": "user" if running else "server"}
                )
            answer = state.answer(future_id, future, row)
    except Exception as exc:  # the job failed to start, or the result could not be turned into an answer
        if isinstance(exc, InvalidRequestError):
            raise
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}", "category": "server"})
    if isinstance(answer, bytes):
        return Response(answer, media_type=_PROTO)
    return JSONResponse(answer)


def _base_model(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"base_model must name a model (a local folder or tiny:<preset>); got {value!r}")
    return value.strip()
