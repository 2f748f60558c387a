"""The remote backend: every op over the training API (``icefloe serve`` or the managed endpoint).

Each op is one exchange generator (see :mod:`icefloe.client.remote.exchange`) driven by a blocking
``httpx.Client`` or an ``httpx.AsyncClient`` per event loop. Octet ops travel as DSSST1;
forward-backward always goes as a chunk group (so every call carries a group id and runs at most
once), step/save/load/operations as JSON. Every mutating POST carries an ``Idempotency-Key``
reused across its retries. Ops the service lacks are answered here: sleep/wake with ``{}``,
forward with zeros only when ``backend.allow_zero_logprobs`` is set.

When the service advertises ``inline_wait``, an op posts with ``?wait=`` and usually gets its
result in the POST's answer: one exchange instead of two. With ``sequenced_submit`` as well
(``icefloe serve``), async ops are numbered and all sent at once (see
:mod:`icefloe.client.remote.ordering`); otherwise an op with a successor queued behind it posts
without waiting, so the successor is sent as soon as this one is accepted.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Final

from icefloe import wire
from icefloe.client.remote.batching import OpBatcher, Outcome
from icefloe.client.remote.coalesce import GenerateCoalescer
from icefloe.client.remote.errors import Redactor, error_from_response
from icefloe.client.remote.exchange import Call, Exchange, Retry, Submitted, run_async, run_sync
from icefloe.client.remote.http import AsyncHttp, Endpoint, RetryPolicy, SyncHttp, TransportWrapper
from icefloe.client.remote.jobs import (
    JobRef,
    ServiceInfo,
    create_job,
    job_create_body,
    probe_service,
    sub_jobs_of,
    wait_running,
)
from icefloe.client.remote.ordering import RoleTurns, Turn
from icefloe.client.remote.polling import Backoff, FrameResult, poll_request
from icefloe.client.transports.base import Transport
from icefloe.config import ClientConfig, RemoteConfig
from icefloe.protocol import (
    INLINE_OPERATIONS,
    OP_CANCEL,
    OP_DELETE_CHECKPOINT,
    OP_FORWARD,
    OP_FWD_BWD,
    OP_GENERATE,
    OP_GET_CHECKPOINT,
    OP_LIST_CHECKPOINTS,
    OP_LOAD,
    OP_RESET_PREFIX_CACHE,
    OP_SAVE,
    OP_SEQUENCE_SKIP,
    OP_SLEEP_INFERENCE,
    OP_SLEEP_TRAINING,
    OP_STEP,
    OP_WAKE_INFERENCE,
    OP_WAKE_TRAINING,
    OP_WEIGHT_SYNC,
    OPS,
    TARGET_REFERENCE,
    TARGET_SAMPLING,
    TARGET_TRAINING,
    ChunkGroupRestartError,
    ClientClosedError,
    ConfigError,
    InvalidRequestError,
    Request,
    RequestFailedError,
    SamplingParams,
    UnsupportedOpError,
)

__all__ = ["RemoteTransport"]

_log = logging.getLogger("icefloe.client.remote")

# Sub-jobs on the service are always resident: nothing to offload or restore.
_NOOP_OPS: Final = frozenset({OP_SLEEP_TRAINING, OP_WAKE_TRAINING, OP_SLEEP_INFERENCE, OP_WAKE_INFERENCE})
# Ask for tensor results as DSSST1 result chunks.
_TENSOR_RESPONSE: Final = {"response_options": {"format": "dssst1", "delivery": "chunked"}}
_CHUNK_GROUP_REPLAYS: Final = 1
_CANCEL_TIMEOUT_S: Final = 30.0
_MIN_LR: Final = 1e-12
# False while the op being sent has a successor queued behind it (set per task by _send_in_turn).
_MAY_HOLD: Final = contextvars.ContextVar("icefloe_remote_may_hold", default=True)
# The turn of the op being sent, when the service orders numbered POSTs (set by _send_in_turn).
_NUMBERED: Final[contextvars.ContextVar[Turn | None]] = contextvars.ContextVar("icefloe_remote_numbered", default=None)
_SKIP_WAIT_S: Final = 5.0  # how long aclose waits for skips still in flight
_BATCHED_OPS: Final = frozenset({OP_FWD_BWD, OP_STEP})  # what POST {job}/batch takes


class RemoteTransport(Transport):
    """A job on a training-API service; the constructor does no I/O, ``open`` creates or re-attaches."""

    def __init__(
        self,
        config: ClientConfig,
        handle: dict[str, Any] | None = None,
        *,
        wrap_http_transport: TransportWrapper | None = None,
    ) -> None:
        """``wrap_http_transport`` wraps each httpx transport built (a proxy layer, or faults in tests)."""
        if not isinstance(config.backend, RemoteConfig):
            raise ConfigError(f"RemoteTransport needs backend.type='remote'; got {config.backend.type!r}")
        self.config = config
        self._backend: RemoteConfig = config.backend
        self._endpoint = Endpoint.from_config(self._backend)
        self._redactor = Redactor([self._endpoint.pat] if self._endpoint.pat else [])
        self._redactor.install()
        self._policy = RetryPolicy(self._backend)
        self._sync = SyncHttp(self._endpoint, self._backend, self._policy, self._redactor, wrap_http_transport)
        self._async = AsyncHttp(self._endpoint, self._backend, self._policy, self._redactor, wrap_http_transport)
        self._backoff = Backoff.from_config(self._backend)
        self._turns = RoleTurns(on_unanswered=self._skip_unanswered)
        self._skips: set[asyncio.Task] = set()  # sequence-skip POSTs in flight
        self._generate_calls = GenerateCoalescer(
            self._send_in_turn, take_turn=lambda: self._take_turn((TARGET_SAMPLING,))
        )
        self._training_ops: OpBatcher | None = None  # built at open, when the service offers batch_submit
        self._lock = threading.Lock()
        self._service: ServiceInfo | None = None
        self._job: JobRef | None = None
        self._created = False
        self._attached = False
        self._closed = False
        self._warned_zero_fill = False
        # Optimizer steps submitted so far: the service has no LR schedule, so the client applies
        # config.training.lr_schedule by sending each step's learning_rate.
        self._steps_submitted = int((handle or {}).get("global_step") or 0)
        self._routes: dict[str, Callable[[Request], Exchange[Any]]] = {
            OP_FWD_BWD: self._fwd_bwd,
            OP_FORWARD: self._forward,
            OP_STEP: self._step,
            OP_GENERATE: self._generate,
            OP_WEIGHT_SYNC: self._weight_sync,
            OP_SAVE: self._json_op("save", lambda body: {"checkpoint_type": body.get("checkpoint_type", "resumable")}),
            OP_LOAD: self._load,
            OP_LIST_CHECKPOINTS: self._list_checkpoints,
            OP_GET_CHECKPOINT: self._get_checkpoint,
            OP_DELETE_CHECKPOINT: self._delete_checkpoint,
            OP_RESET_PREFIX_CACHE: self._reset_prefix_cache,
            OP_CANCEL: self._cancel_op,
        }
        if handle is not None:
            job_id = handle.get("job_id")
            if not job_id:
                raise ConfigError("a remote handle needs 'job_id'; pass what Client.handle() returned")
            self._job = JobRef(str(job_id), {k: list(v) for k, v in (handle.get("sub_jobs") or {}).items()})

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def capabilities(self) -> frozenset[str]:  # type: ignore[override]
        """Ops executed here or on the service; before ``open`` every op is assumed."""
        if self._service is None:
            return OPS
        extra = {OP_FORWARD} if self._backend.allow_zero_logprobs else set()
        return frozenset(self._service.ops & OPS) | _NOOP_OPS | extra

    def probe_capabilities(self) -> frozenset[str]:
        """Ask the service what it offers (``GET /capabilities``) without creating a job."""
        with self._lock:
            self._check_not_closed("probe")
            if self._service is None:
                self._service = run_sync(probe_service(), self._sync)
        return self.capabilities

    def open(self) -> None:
        with self._lock:
            self._check_not_closed("open")
            if not self._attached:
                try:
                    run_sync(self._attach(), self._sync)
                except BaseException:
                    self._sync.close()  # a failed open leaves no connection behind; a retry reconnects
                    raise

    async def aopen(self) -> None:
        self._check_not_closed("open")
        if not self._attached:
            try:
                await run_async(self._attach(), self._async)
            except BaseException:
                await self._async.aclose()
                raise

    def _attach(self) -> Exchange[None]:
        service = yield from probe_service()
        self._service = service
        self._policy.retry_restart_statuses = service.managed
        if self._job is None:
            body = job_create_body(self.config, self._backend.experiment_name)
            job_id = yield from create_job(body, idempotent=service.idempotency_keys)
            self._job, self._created = JobRef(job_id), True
            _log.info("created job %s on %s", job_id, self._endpoint.origin)
        job = yield from wait_running(
            self._job.job_id, backoff=self._backoff, timeout_s=self.config.job_ready_timeout_s
        )
        expected = {
            "training": 1,
            "sampling": int(self.config.num_sampling_workers > 0),
            "log_probability": int(self.config.num_log_prob_workers > 0),
        }
        known = {k: v for k, v in self._job.sub_jobs.items() if v}
        self._job = JobRef(self._job.job_id, {**sub_jobs_of(self._job.job_id, job, expected), **known})
        if self._batching:
            self._training_ops = OpBatcher(
                self._send_in_turn,
                self._send_batch_in_turn,
                take_turn=lambda: self._take_turn((TARGET_TRAINING,)),
                max_ops=service.max_batch_ops,
                max_bytes=self._max_post_bytes // 2,  # room for the frame's own header and JSON
            )
        self._attached = True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._should_cancel():
                with contextlib.suppress(Exception):
                    run_sync(self._cancel_exchange(), self._sync)
        finally:
            self._sync.close()
            self._async.close_sync()
            self._redactor.uninstall()

    async def aclose(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._skips:
                await asyncio.wait(set(self._skips), timeout=_SKIP_WAIT_S)
            if self._should_cancel():
                with contextlib.suppress(Exception):
                    await run_async(self._cancel_exchange(), self._async)
        finally:
            for task in self._skips:
                task.cancel()
            # Sends still in flight would otherwise retry or poll on a client built after this close.
            await self._generate_calls.cancel()
            if self._training_ops is not None:
                await self._training_ops.cancel()
            await self._async.aclose()
            self._sync.close()
            self._redactor.uninstall()

    def _should_cancel(self) -> bool:
        return self._created and self._job is not None and self._backend.cancel_on_shutdown

    def _cancel_exchange(self) -> Exchange[dict[str, Any]]:
        assert self._job is not None
        yield Call(
            "POST",
            f"/{self._job.job_id}:cancel",
            "cancel job",
            retry=Retry.NEVER,
            final=frozenset({409}),
            timeout_s=_CANCEL_TIMEOUT_S,
        )
        return {}

    def handle_info(self) -> dict[str, Any]:
        if self._job is None:
            raise ConfigError("this remote client has no job yet; call open() before handle()")
        return {
            "backend": "remote",
            "job_id": self._job.job_id,
            "sub_jobs": {k: list(v) for k, v in self._job.sub_jobs.items()},
            "global_step": self._steps_submitted,
            **self._endpoint.public(),
        }

    @property
    def job_id(self) -> str | None:
        return self._job.job_id if self._job else None

    # --- delivery --------------------------------------------------------------------------------
    def handle(self, request: Request) -> Any:
        self._check_not_closed(request.op)
        if not self._attached:
            self.open()
        return run_sync(self._exchange(request), self._sync)

    async def handle_async(self, request: Request) -> Any:
        self._check_not_closed(request.op)
        if not self._attached:
            await self.aopen()
        if request.op == OP_GENERATE:
            return await self._generate_calls.submit(request)
        batcher = self._training_ops if self._batching else None
        if batcher is not None and request.op in _BATCHED_OPS and request.target == TARGET_TRAINING:
            size = _payload_bytes(request.body.get("batch"))
            if size <= self._max_post_bytes // 2:
                return await batcher.submit(request, size)
        if batcher is not None:
            batcher.seal()  # an op called after this one must not join a batch that goes before it
        roles = _roles_of(request)
        if TARGET_SAMPLING in roles:
            self._generate_calls.seal()
        return await self._send_in_turn(request, self._take_turn(roles))

    def _take_turn(self, roles: tuple[str, ...]) -> Turn:
        numbered = self._service is not None and self._service.sequenced_submit
        return self._turns.take(roles, numbered=numbered)

    async def _send_batch_in_turn(self, requests: list[Request], turn: Turn) -> list[Outcome]:
        """Several training ops in one numbered POST (``batch_submit``); one outcome per op."""
        return await self._run_in_turn(lambda: self._batch_exchange(requests), turn)

    async def _send_in_turn(self, request: Request, turn: Turn) -> Any:
        """Send once every earlier op of the same roles was accepted; free the next at acceptance."""
        return await self._run_in_turn(lambda: self._exchange(request), turn)

    async def _run_in_turn(self, exchange: Callable[[], Exchange[Any]], turn: Turn) -> Any:
        try:
            await turn.wait()
            if turn.sequence is None:  # ops called in this same loop turn take their turns behind us now
                await asyncio.sleep(0)
            may_hold = _MAY_HOLD.set(turn.may_hold)
            numbered = _NUMBERED.set(turn if turn.sequence is not None else None)
            try:
                return await run_async(exchange(), self._async, on_submitted=turn.accepted)
            finally:
                _MAY_HOLD.reset(may_hold)
                _NUMBERED.reset(numbered)
        except asyncio.CancelledError:
            turn.given_up()
            raise
        finally:
            turn.release()

    def _skip_unanswered(self, sequence: str) -> None:
        """A numbered op failed before the service accepted it: skip its number so later ops are not held."""
        if self._job is None or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._send_skip(sequence))
        self._skips.add(task)
        task.add_done_callback(self._skips.discard)

    async def _send_skip(self, sequence: str) -> None:
        try:
            await run_async(self._skip_exchange(sequence), self._async)
        except Exception as exc:  # the ops behind it get 409 sequence_gap after the service's timeout
            _log.warning("could not skip %s on the service: %s", sequence, exc)

    def _skip_exchange(self, sequence: str) -> Exchange[None]:
        yield Call(
            "POST",
            f"/{self._job_id}/operation",
            OP_SEQUENCE_SKIP,
            json={"operation_type": OP_SEQUENCE_SKIP, "payload": {}},
            idempotency_key=str(uuid.uuid4()),
            sequence=sequence,
        )

    def _check_not_closed(self, op: str) -> None:
        if self._closed:
            raise ClientClosedError(f"cannot run {op!r}: the client was shut down; build a new client")

    def _exchange(self, request: Request) -> Exchange[Any]:
        if request.op in _NOOP_OPS:
            return _constant({})
        handler = self._routes.get(request.op)
        if handler is None:
            return _raise(UnsupportedOpError(f"{request.op!r} is not available on the remote backend"))
        return handler(request)

    @property
    def _service_ops(self) -> frozenset[str]:
        return self._service.ops if self._service is not None else frozenset()

    @property
    def _job_id(self) -> str:
        assert self._job is not None, "open() attaches the job before any op runs"
        return self._job.job_id

    @property
    def _batching(self) -> bool:
        """Whether training ops called together may share one POST (``batch_submit``, numbered POSTs)."""
        service = self._service
        return (
            self._backend.batch_training_ops
            and service is not None
            and service.sequenced_submit
            and service.max_batch_ops > 1
        )

    @property
    def _max_post_bytes(self) -> int:
        limit = self._service.max_post_bytes if self._service is not None else None
        return min(self._backend.max_post_bytes, limit or self._backend.max_post_bytes)

    @property
    def _long_poll_s(self) -> float:
        """The ``?wait=`` of a poll; 0 when the service cannot hold answers or the config turned it off."""
        if self._service is None or not self._service.long_poll:
            return 0.0
        return min(self._backend.long_poll_s, self._service.max_long_poll_s or self._backend.long_poll_s)

    def _hold(self) -> tuple[dict[str, str], float | None]:
        """``(params, timeout_s)`` for a submitting POST: ask for the answer inline when it may wait."""
        hold_s = self._long_poll_s
        if hold_s <= 0 or self._service is None or not self._service.inline_wait or not _MAY_HOLD.get():
            return {}, None
        return {"wait": f"{hold_s:.3f}"}, self._backend.request_timeout_s + hold_s

    def _poll(self, accepted: Any, what: str, *, inline_ok: bool = False) -> Exchange[dict[str, Any]]:
        """Poll the request an accepting answer names; an inline answer is returned as it is.

        An answer that already carries the request's status (``?wait=``) is read as the first poll.
        """
        yield Submitted()
        body = accepted if isinstance(accepted, Mapping) else {}
        request_id = body.get("request_id")
        if not request_id:
            if inline_ok:
                return dict(body)
            raise RequestFailedError(f"{what}: the service answered without a request_id to poll: {body!r:.200}")
        answered = body if self._service is not None and self._service.inline_wait and "status" in body else None
        return (
            yield from poll_request(
                self._job_id,
                str(request_id),
                what=what,
                backoff=self._backoff,
                timeout_s=self._backend.request_timeout_s,
                long_poll_s=self._long_poll_s,
                answered=answered,
            )
        )

    # --- octet ops -------------------------------------------------------------------------------
    def _post_frame(
        self,
        path: str,
        what: str,
        frame: bytes,
        *,
        force_chunks: bool,
        replays: int,
        params: dict | None = None,
    ) -> Exchange[Any]:
        """POST ``frame`` (as a chunk group when forced or over the cap); replay from chunk 0 on restart."""
        chunks = wire.split_frame(
            frame, max_bytes=self._max_post_bytes, kind="request", operation=what, force=force_chunks
        )
        call_key = str(uuid.uuid4())
        hold_params, hold_timeout_s = self._hold()
        for replay in range(replays + 1):
            try:
                reply = None
                for index, chunk in enumerate(chunks):
                    key = call_key if len(chunks) == 1 and not force_chunks else f"{call_key}.{replay}.{index}"
                    last = index == len(chunks) - 1
                    reply = yield Call(
                        "POST",
                        path,
                        what,
                        content=chunk,
                        params={**(params or {}), **hold_params} if last and hold_params else params,
                        idempotency_key=key,
                        timeout_s=hold_timeout_s if last else None,
                        **(_numbered() if last else {}),
                    )
                    body = reply.body if isinstance(reply.body, Mapping) else {}
                    if index < len(chunks) - 1 and (not body.get("chunk_cached") or "request_id" in body):
                        raise RequestFailedError(
                            f"{what}: chunk {index} of {len(chunks)} was answered with {body!r:.200}, "
                            "expected {'chunk_cached': true}"
                        )
                return reply.body if reply is not None else {}
            except ChunkGroupRestartError:
                if replay == replays:
                    raise
                _log.warning("%s: the service lost chunk group; replaying it from chunk 0", what)
        raise AssertionError("unreachable")

    def _fwd_bwd(self, request: Request) -> Exchange[dict[str, Any]]:
        frame = wire.encode(request.body["batch"])
        path = f"/{self._job_id}/forward-backward"
        accepted = yield from self._post_frame(path, OP_FWD_BWD, frame, force_chunks=True, replays=_CHUNK_GROUP_REPLAYS)
        return (yield from self._poll(accepted, OP_FWD_BWD))

    def _forward(self, request: Request) -> Exchange[dict[str, Any]]:
        batch = request.body["batch"]
        if OP_FORWARD not in self._service_ops:
            if self._backend.allow_zero_logprobs:
                if not self._warned_zero_fill:
                    self._warned_zero_fill = True
                    _log.warning(
                        "the service has no 'forward' op: answering forward() with zero log-probs "
                        "(backend.allow_zero_logprobs=True)"
                    )
                return _zero_logprobs(batch)
            raise UnsupportedOpError(
                "the service has no 'forward' op (the managed endpoint lacks it); set "
                "backend.allow_zero_logprobs=True only for on-policy, single-epoch GRPO without KL, where "
                "zero log-probs are never read"
            )
        params = {"sub_job_type": "log_probability"} if request.target == TARGET_REFERENCE else None
        if params and self._job is not None and not self._job.first("log_probability"):
            raise InvalidRequestError("forward(reference=True) needs a reference role; set num_log_prob_workers=1")
        frame = wire.encode(batch, op_metadata=_TENSOR_RESPONSE)
        path = f"/{self._job_id}/forward"
        accepted = yield from self._post_frame(path, OP_FORWARD, frame, force_chunks=False, replays=0, params=params)
        return (yield from self._poll(accepted, OP_FORWARD))

    def _generate(self, request: Request) -> Exchange[dict[str, Any]]:
        params = request.body["sampling_params"]
        body = {
            "prompts": request.body["prompts"],
            "sampling_params": [_params_json(p) for p in params] if isinstance(params, list) else _params_json(params),
            "strict": False,
        }
        path = f"/{self._job_id}/generate"
        accepted = yield from self._post_frame(path, OP_GENERATE, wire.encode(body), force_chunks=False, replays=0)
        result = yield from self._poll(accepted, OP_GENERATE)
        # Only a DSSST1 result can hold tensors; walking a JSON one (thousands of samples) costs ms.
        return _tensors_to_lists(result) if isinstance(result, FrameResult) else result

    # --- JSON ops --------------------------------------------------------------------------------
    def _json_op(self, name: str, build: Callable[[dict[str, Any]], dict[str, Any]]):
        def exchange(request: Request) -> Exchange[dict[str, Any]]:
            hold_params, hold_timeout_s = self._hold()
            reply = yield Call(
                "POST",
                f"/{self._job_id}/{name}",
                name,
                json=build(dict(request.body)),
                params=hold_params or None,
                idempotency_key=str(uuid.uuid4()),
                timeout_s=hold_timeout_s,
                **_numbered(),
            )
            return (yield from self._poll(reply.body, name))

        return exchange

    def _step_body(self, request: Request) -> dict[str, float]:
        """Without an explicit rate, send the scheduled one (nothing for a flat schedule)."""
        index = self._steps_submitted
        self._steps_submitted += 1  # later steps start after this one (call order), so they see it
        rate = request.body.get("learning_rate")
        schedule = self.config.training.lr_schedule
        if rate is None and (schedule.kind != "constant" or schedule.warmup_steps > 0):
            # A decay to exactly 0 is sent as the smallest rate the API accepts (it requires > 0).
            rate = max(self.config.training.optimizer.lr * schedule.multiplier(index), _MIN_LR)
        return {} if rate is None else {"learning_rate": float(rate)}

    def _step(self, request: Request) -> Exchange[dict[str, Any]]:
        body = self._step_body(request)
        hold_params, hold_timeout_s = self._hold()
        try:
            reply = yield Call(
                "POST",
                f"/{self._job_id}/step",
                OP_STEP,
                json=body,
                params=hold_params or None,
                idempotency_key=str(uuid.uuid4()),
                timeout_s=hold_timeout_s,
                **_numbered(),
            )
        except BaseException:
            if _NUMBERED.get() is None:  # never accepted: the service did not count it
                self._steps_submitted -= 1  # (numbered steps run concurrently: a later one has its index already)
            raise
        return (yield from self._poll(reply.body, OP_STEP))

    def _batch_exchange(self, requests: list[Request]) -> Exchange[list[Outcome]]:
        """POST ``{job}/batch`` with the ops in call order, then read (or poll) each op's answer."""
        ops = [_batched(r, self._step_body) for r in requests]
        hold_params, hold_timeout_s = self._hold()
        reply = yield Call(
            "POST",
            f"/{self._job_id}/batch",
            "batch",
            content=wire.encode({"ops": ops}),
            params=hold_params or None,
            idempotency_key=str(uuid.uuid4()),
            timeout_s=hold_timeout_s,
            **_numbered(),
        )
        answers = reply.body.get("answers") if isinstance(reply.body, Mapping) else None
        if not isinstance(answers, list) or len(answers) != len(requests):
            raise RequestFailedError(
                f"batch of {len(requests)} ops: the service answered {reply.body!r:.200}, expected one answer per op"
            )
        outcomes: list[Outcome] = []
        for request, answer in zip(requests, answers, strict=True):
            if isinstance(answer, Mapping) and answer.get("request_id") is None and answer.get("status") == "failed":
                # refused before it queued: the error its own POST would have raised
                body = {"code": answer.get("code"), "message": answer.get("error")}
                status = int(answer.get("status_code") or 500)
                error = error_from_response(status, body, what=request.op, request_id=None, redactor=self._redactor)
                outcomes.append((False, error))
                continue
            try:
                outcomes.append((True, (yield from self._poll(answer, request.op))))
            except Exception as exc:  # this op failed (or could not be read); the others stand
                outcomes.append((False, exc))
        return outcomes

    def _load(self, request: Request) -> Exchange[dict[str, Any]]:
        body = {k: v for k, v in request.body.items() if v is not None}
        hold_params, hold_timeout_s = self._hold()
        reply = yield Call(
            "POST",
            f"/{self._job_id}/load",
            OP_LOAD,
            json=body,
            params=hold_params or None,
            idempotency_key=str(uuid.uuid4()),
            timeout_s=hold_timeout_s,
            **_numbered(),
        )
        result = yield from self._poll(reply.body, OP_LOAD)
        step = result.get("global_step", result.get("global_steps"))
        if isinstance(step, int):
            self._steps_submitted = step  # the schedule continues from the loaded step
        return result

    def _operation(
        self,
        operation_type: str,
        payload: dict[str, Any],
        *,
        sub_job_id: str | None = None,
        sub_job_type: str | None = None,
    ) -> Exchange[dict[str, Any]]:
        body: dict[str, Any] = {"operation_type": operation_type, "payload": payload}
        if sub_job_id:
            body["sub_job_id"] = sub_job_id
        if sub_job_type:
            body["sub_job_type"] = sub_job_type
        hold_params, hold_timeout_s = self._hold() if operation_type not in INLINE_OPERATIONS else ({}, None)
        reply = yield Call(
            "POST",
            f"/{self._job_id}/operation",
            operation_type,
            json=body,
            params=hold_params or None,
            idempotency_key=str(uuid.uuid4()),
            timeout_s=hold_timeout_s,
            **_numbered(),
        )
        return (yield from self._poll(reply.body, operation_type, inline_ok=operation_type in INLINE_OPERATIONS))

    def _weight_sync(self, request: Request) -> Exchange[dict[str, Any]]:
        assert self._job is not None
        source = self._job.first("training")
        targets = self._job.sub_jobs.get("sampling") or []
        if not targets:
            raise InvalidRequestError("sync_weights needs a sampling role; set num_sampling_workers=1 in the config")
        payload = {
            "source_sub_job_id": source,
            "target_sub_job_ids": list(targets),
            "weight_format": request.body.get("weight_format") or "vllm",
        }
        return (yield from self._operation(OP_WEIGHT_SYNC, payload, sub_job_id=source, sub_job_type="training"))

    def _reset_prefix_cache(self, request: Request) -> Exchange[dict[str, Any]]:
        if (
            self._job is None
            or not self._job.sub_jobs.get("sampling")
            or OP_RESET_PREFIX_CACHE not in self._service_ops
        ):
            return {}
        payload = {"drain": True, "timeout_s": 60.0, "retry_interval_s": 0.1}
        yield from self._operation(OP_RESET_PREFIX_CACHE, payload, sub_job_type="sampling")
        return {}

    def _list_checkpoints(self, request: Request) -> Exchange[dict[str, Any]]:
        reply = yield Call("GET", f"/{self._job_id}/checkpoints", OP_LIST_CHECKPOINTS)
        body = reply.body if isinstance(reply.body, Mapping) else {}
        return {"checkpoints": list(body.get("checkpoints") or [])}

    def _get_checkpoint(self, request: Request) -> Exchange[dict[str, Any]]:
        checkpoint_id = request.body["checkpoint_id"]
        listed = yield from self._list_checkpoints(request)
        entry = next((c for c in listed["checkpoints"] if c.get("checkpoint_id") == checkpoint_id), {})
        reply = yield Call(
            "POST",
            f"/{self._job_id}/checkpoints/{checkpoint_id}:export",
            OP_GET_CHECKPOINT,
            idempotency_key=str(uuid.uuid4()),
        )
        out = {**entry, **(reply.body or {})}
        if "global_steps" in out:
            out.setdefault("global_step", out["global_steps"])
        if "checkpoint_type" in out:
            out.setdefault("kind", out["checkpoint_type"])
        return out

    def _delete_checkpoint(self, request: Request) -> Exchange[dict[str, Any]]:
        yield Call(
            "DELETE",
            f"/{self._job_id}/checkpoints/{request.body['checkpoint_id']}",
            OP_DELETE_CHECKPOINT,
            final=frozenset({404}),
        )
        return {}

    def _cancel_op(self, request: Request) -> Exchange[dict[str, Any]]:
        result = yield from self._cancel_exchange()
        self._created = False  # cancelled on purpose: nothing left to cancel at shutdown
        return result


def _numbered() -> dict[str, Any]:
    """``Call`` fields of the op's numbered POST: its Icefloe-Sequence, and who to tell once it is written."""
    turn = _NUMBERED.get()
    return {} if turn is None else {"sequence": turn.sequence, "on_sent": turn.written, "on_lost": turn.lost}


def _constant(value: Any) -> Exchange[Any]:
    return value
    yield  # pragma: no cover - makes this a generator


def _raise(error: Exception) -> Exchange[Any]:
    raise error
    yield  # pragma: no cover - makes this a generator


def _params_json(params: SamplingParams) -> dict[str, Any]:
    return {k: v for k, v in params.model_dump(mode="json").items() if v is not None}


def _tensors_to_lists(value: Any) -> Any:
    """Generate results hold plain lists on every backend; DSSST1 may have carried tensors."""
    if isinstance(value, Mapping):
        return {k: _tensors_to_lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if all(isinstance(v, int | float | str | bool | None) for v in value):
            return value if isinstance(value, list) else list(value)  # JSON already: token ids, logprobs
        return [_tensors_to_lists(v) for v in value]
    if hasattr(value, "tolist") and hasattr(value, "shape"):
        return value.tolist()
    return value


def _zero_logprobs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``[B, S]`` zeros shaped like the batch's input ids (the allow_zero_logprobs path)."""
    import torch

    input_ids_BS = batch["kwargs"]["input_ids"]
    shape = tuple(input_ids_BS.shape)
    return {
        "logprobs": torch.zeros(shape, dtype=torch.float32),
        "entropy": torch.zeros(shape, dtype=torch.float32),
    }


def _batched(request: Request, step_body: Callable[[Request], dict[str, float]]) -> dict[str, Any]:
    """One op of a ``batch`` POST body."""
    if request.op == OP_FWD_BWD:
        return {"op": OP_FWD_BWD, "batch": request.body["batch"]}
    return {"op": OP_STEP, **step_body(request)}


def _payload_bytes(value: Any) -> int:
    """Bytes of the tensors inside ``value``: what a batched op adds to the POST."""
    if isinstance(value, Mapping):
        return sum(_payload_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_payload_bytes(v) for v in value)
    nbytes = getattr(value, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else 0


def _roles_of(request: Request) -> tuple[str, ...]:
    """The sub-job roles whose queues this op enters (weight sync enters both sides)."""
    if request.op == OP_WEIGHT_SYNC:
        return (TARGET_TRAINING, TARGET_SAMPLING)
    if request.target in (TARGET_TRAINING, TARGET_SAMPLING, TARGET_REFERENCE):
        return (request.target,)
    return ()
