"""The remote backend: every op over the training API (``icefloe serve`` or the managed endpoint).

``handle`` fixes an op's place in line when it is called and hands its I/O to the client's own
loop, where it runs to its end even if the caller stops waiting. A service that advertises
``sequenced_submit`` (``icefloe serve``) queues numbered POSTs (``Icefloe-Sequence: <session>:<n>``)
in number order, so every op leaves at once and no number is ever left empty: an op that fails before
its numbered POST is accepted spends its number on the job's heartbeat. Against one without it
(the managed endpoint) an op's POST waits until every earlier op of its roles has been accepted (not
finished), so the ops still overlap on the service's queue. Forward-backward always goes as a chunk
group (a group id makes it run at most once); every mutating POST carries an ``Idempotency-Key``
reused across its retries. Ops the service lacks are answered here: sleep/wake with ``{}``, forward
with zeros only when ``backend.allow_zero_logprobs`` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

from icefloe import protocol as api
from icefloe import wire
from icefloe.client.remote import jobs
from icefloe.client.remote.http import Call, Endpoint, Http, Retry, TransportWrapper, json_body
from icefloe.client.remote.polling import Backoff, FrameResult, poll_request
from icefloe.client.transports.base import Transport, finished
from icefloe.config import ClientConfig, RemoteConfig

__all__ = ["RemoteTransport"]

_log = logging.getLogger("icefloe.client.remote")

_TENSOR_RESPONSE: Final = {"response_options": {"format": "dssst1", "delivery": "chunked"}}
_CANCEL_TIMEOUT_S: Final = 30.0
_MIN_LR: Final = 1e-12
# Statuses that spend a number on the service (refused for good); 5xx and 429 leave it for a retry.
_ANSWERED_FOR_GOOD: Final = frozenset(range(400, 500)) - {429}


@dataclass
class Turn:
    """One op's place in line: its number, or the acceptances it waits for and the one it gives."""

    sequence: str | None = None
    before: list[asyncio.Future[None]] = field(default_factory=list)
    accepted: asyncio.Future[None] | None = None
    released: bool = False

    def release(self) -> None:
        """Accepted, or ended without acceptance: the next op may send (call on the I/O loop)."""
        self.released = True
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(None)


Send = Callable[[Turn], Awaitable[Any]]  # an op's I/O, run on the I/O loop in its turn


class RemoteTransport(Transport):
    """A job on a training-API service; the constructor does no I/O, ``open`` creates or re-attaches."""

    def __init__(
        self,
        config: ClientConfig,
        handle: dict[str, Any] | None = None,
        *,
        wrap_http_transport: TransportWrapper | None = None,
    ) -> None:
        """``wrap_http_transport`` wraps the httpx transport (a proxy layer, or faults in tests)."""
        if not isinstance(config.backend, RemoteConfig):
            raise api.ConfigError(f"RemoteTransport needs backend.type='remote'; got {config.backend.type!r}")
        self.config = config
        self._backend: RemoteConfig = config.backend
        self._endpoint = Endpoint.from_config(self._backend)
        self._wrap = wrap_http_transport
        self._http = Http(self._endpoint, self._backend, wrap_http_transport)
        poll_s = self._backend.poll_interval_s
        self._backoff = Backoff(poll_s, self._backend.poll_multiplier, max(self._backend.poll_max_interval_s, poll_s))
        self._session, self._numbers = uuid.uuid4().hex, itertools.count()
        self._unspent: set[str] = set()  # numbers of failed ops the service has not been told of yet
        self._accepted: dict[str, asyncio.Future[None]] = {}  # by role: the last op's acceptance
        self._lock = threading.Lock()
        self._service: jobs.ServiceInfo | None = None
        self._max_post_bytes, self._long_poll_s = 0, 0.0  # the service's limits, once open
        self._job: jobs.JobRef | None = None
        self._created = self._attached = self._closed = False
        self._warned: set[str] = set()  # warnings given once per client
        self._lease: asyncio.Task | None = None  # the renewing task, kept so it is not collected
        self._creating: asyncio.Future[None] | None = None  # the create call, which close() waits out
        # Optimizer steps called so far: the service has no LR schedule, so the client applies
        # config.training.lr_schedule by sending each step's learning_rate.
        self._steps_called = int((handle or {}).get("global_step") or 0)
        # op -> (request -> the op's I/O, or its answer when no I/O is needed); run at call time
        self._routes: dict[str, Callable[[api.Request], Send | dict[str, Any]]] = {
            api.OP_FWD_BWD: self._fwd_bwd,
            api.OP_FORWARD: self._forward,
            api.OP_STEP: self._step,
            api.OP_GENERATE: self._generate,
            api.OP_WEIGHT_SYNC: self._weight_sync,
            api.OP_SAVE: lambda r: self._json_op("save", r.body),  # ops.save_checkpoint names the checkpoint_type
            api.OP_LOAD: self._load,
            api.OP_LIST_CHECKPOINTS: lambda r: lambda turn: self._list_checkpoints(),
            api.OP_GET_CHECKPOINT: lambda r: lambda turn: self._get_checkpoint(r.body["checkpoint_id"]),
            api.OP_DELETE_CHECKPOINT: lambda r: lambda turn: self._delete_checkpoint(r.body["checkpoint_id"]),
            api.OP_CANCEL: lambda r: lambda turn: self._cancel_job(by_op=True),
            **dict.fromkeys(api.MEMORY_OPS, lambda r: {}),
            **dict.fromkeys(api.ENGINE_OPERATIONS, self._engine_operation),
        }
        if handle is not None:
            job_id = handle.get("job_id")
            if not job_id:
                raise api.ConfigError("a remote handle needs 'job_id'; pass what Client.handle() returned")
            self._job = jobs.JobRef(str(job_id), {k: list(v) for k, v in (handle.get("sub_jobs") or {}).items()})

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def capabilities(self) -> frozenset[str]:  # type: ignore[override]
        """Ops executed here or on the service; before ``open`` every op is assumed."""
        if self._service is None:
            return api.OPS
        extra = {api.OP_FORWARD} if self._backend.allow_zero_logprobs else set()
        return frozenset(self._service.ops & api.OPS) | api.MEMORY_OPS | extra

    def probe_capabilities(self) -> frozenset[str]:
        """Ask the service what it offers (``GET /capabilities``) without creating a job."""
        with self._lock:
            self._check_not_closed("probe")
            if self._service is None:
                self._service = self._http.run(jobs.probe_service(self._http))
        return self.capabilities

    def open(self) -> None:
        with self._lock:
            self._check_not_closed("open")
            if not self._attached:
                try:
                    self._http.run(self._attach())
                except BaseException:  # a failed open leaves no job, connection or thread behind; a retry starts afresh
                    # Interrupted here (Ctrl-C) while the loop still runs the open, perhaps before the create
                    # answer was read: cancel the job on the loop now, before closing it cancels that read.
                    created = self._created or self._creating is not None
                    with contextlib.suppress(Exception):  # the lease ends the job if this fails
                        self._http.run(self._cancel_created())
                    self._http.close()
                    self._lease = self._creating = None  # they ran on the closed loop
                    if created:
                        self._job, self._created = None, False  # a retried open creates a fresh one
                    self._http = Http(self._endpoint, self._backend, self._wrap)
                    self._check_not_closed("open")  # closed while it waited: say so, not how the wait ended
                    raise

    async def _attach(self) -> None:
        service = self._service = await jobs.probe_service(self._http)
        self._http.policy.retry_restart_statuses = service.managed
        backend = self._backend
        self._max_post_bytes = min(backend.max_post_bytes, service.max_post_bytes or backend.max_post_bytes)
        # The ?wait= of a poll; 0 when the service cannot hold answers (or the config turned it off).
        long_poll = "long_poll" in service.extensions
        self._long_poll_s = (
            min(backend.long_poll_s, service.max_long_poll_s or backend.long_poll_s) if long_poll else 0.0
        )
        batching = "batch_requests" in service.extensions and backend.batch_requests
        self._http.batch_bytes = self._max_post_bytes if batching else 0
        if self._job is None:
            self._creating = asyncio.ensure_future(self._create_job(service))  # close() waits for it, to cancel
            await self._creating
        if service.lease_ttl_s and self._lease is None:  # from now: reading the job while it waits renews nothing
            self._lease = asyncio.get_running_loop().create_task(self._keep_lease(service.lease_ttl_s / 3))
        timeout_s = self.config.job_ready_timeout_s
        try:
            job = await jobs.wait_running(self._http, self._job.job_id, backoff=self._backoff, timeout_s=timeout_s)
        except BaseException:  # also interrupted (Ctrl-C, a cancelled open, close() while waiting)
            if self._created:  # given up: cancel the job, or it starts later and holds slots nobody uses
                with contextlib.suppress(Exception):
                    await self._cancel_job()
                self._job, self._created = None, False  # a retried open creates a fresh one
            raise
        known = {k: v for k, v in self._job.sub_jobs.items() if v}
        self._job = jobs.JobRef(self._job.job_id, {**jobs.sub_jobs_of(self._job.job_id, job, self.config), **known})
        self._attached = True

    async def _create_job(self, service: jobs.ServiceInfo) -> None:
        # retried fully only where the service honours idempotency keys, else only if never sent
        retry = Retry.TRANSIENT if "idempotency_keys" in service.extensions else Retry.CONNECT_ONLY
        body = jobs.job_create_body(self.config, self._backend.experiment_name)
        call = Call("POST", "", "create job", json=body, idempotency_key=str(uuid.uuid4()), retry=retry)
        answer = (await self._http.send(call)).body
        job_id = answer.get("job_id") if isinstance(answer, Mapping) else None
        if not job_id:
            raise api.JobFailedError("<none>", "not created", f"create job answered without a job_id: {answer!r:.200}")
        self._job, self._created, self._creating = jobs.JobRef(str(job_id)), True, None
        _log.info("created job %s on %s", job_id, self._endpoint.origin)

    async def _keep_lease(self, period_s: float) -> None:
        """Renew the job's lease while this client is open (the service cancels a job whose lease lapses)."""
        path = f"/{self._job_id}:heartbeat"
        call = Call("POST", path, "heartbeat", retry=Retry.NEVER, accept=frozenset({404}), timeout_s=period_s)
        while True:
            await asyncio.sleep(period_s)
            try:
                reply = await self._http.send(call)
            except Exception as exc:  # a missed renewal is tried again next period
                _log.warning("job %s: renewing its lease failed: %s", self._job_id, exc)
                continue
            status = reply.body.get("status") if isinstance(reply.body, Mapping) else None
            if reply.status_code == 404 or api.normalize_job_state(status or "") in api.JOB_TERMINAL_STATES:
                return

    def close(self) -> None:
        if self._closed:  # no lock: an open under way holds it, and closing the I/O loop interrupts that open
            return
        self._closed = True
        try:
            if self._backend.cancel_on_shutdown and (self._created or self._creating is not None):
                self._http.run(self._cancel_created())
        except Exception as exc:  # closing goes on: the job's lease ends it on the service
            _log.warning("could not cancel job %s: %s", self._job and self._job.job_id, exc)
        finally:
            self._http.close()

    async def _cancel_created(self) -> None:
        """Cancel the job this client created, once it knows it (an open under way reads its create answer)."""
        if self._creating is not None:
            await asyncio.wait([self._creating], timeout=_CANCEL_TIMEOUT_S)
        if self._created:
            self._created = False  # once: the open's own clean-up, if it comes next, finds nothing to cancel
            await self._cancel_job()

    async def _cancel_job(self, *, by_op: bool = False) -> dict[str, Any]:
        path = f"/{self._job_id}:cancel"
        # 409: the job ended already (failed, or cancelled by its lease): nothing left to cancel
        call = Call("POST", path, "cancel job", retry=Retry.NEVER, accept=frozenset({409}), timeout_s=_CANCEL_TIMEOUT_S)
        await self._http.send(call)
        if by_op:
            self._created = False  # cancelled on purpose: nothing left to cancel at shutdown
        return {}

    def handle_info(self) -> dict[str, Any]:
        if self._job is None:
            raise api.ConfigError("this remote client has no job yet; call open() before handle()")
        return {
            "backend": "remote",
            "job_id": self._job_id,
            "sub_jobs": {k: list(v) for k, v in self._ref.sub_jobs.items()},
            "global_step": self._steps_called,
            **self._endpoint.public(),
        }

    def log_metrics(self, metrics: dict[str, float], step: int) -> Future:
        """POST ``{job}/metrics`` when the service takes client metrics; else (the managed endpoint) send nothing."""
        self._check_not_closed("log_metrics")
        self.open()
        if "job_metrics" not in self._info.extensions:
            self._warn_once("the service keeps no client metrics (no job_metrics extension): log_metrics sends nothing")
            return super().log_metrics(metrics, step)
        body = {"step": step, "metrics": metrics}
        call = Call("POST", f"/{self._job_id}/metrics", "log_metrics", json=body, idempotency_key=str(uuid.uuid4()))
        return self._http.start(self._http.send(call))

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            _log.warning(message)

    # --- delivery --------------------------------------------------------------------------------
    def handle(self, request: api.Request) -> Future:
        """Take the op's turn now and hand its I/O to the I/O loop; refusals found here raise at once."""
        self._check_not_closed(request.op)
        self.open()  # a no-op once open; the clients open before their first op
        route = self._routes.get(request.op)
        if route is None:
            raise api.UnsupportedOpError(f"{request.op!r} is not available on the remote backend")
        with self._lock:  # call order = turn order, also for the step count a route reads
            send = route(request)
            if isinstance(send, dict):  # answered here
                return finished(send)
            turn = self._turn(_roles_of(request))
        return self._http.start(self._in_turn(send, turn))  # a caller that stops waiting does not stop it

    def _turn(self, roles: tuple[str, ...]) -> Turn:
        """A number, or the acceptances of the earlier ops of its roles; an op in no role waits for nothing."""
        if not roles:
            return Turn()
        if "sequenced_submit" in self._info.extensions:
            return Turn(sequence=f"{self._session}:{next(self._numbers)}")
        accepted = self._http.loop.create_future()
        before = [self._accepted[role] for role in roles if role in self._accepted]
        self._accepted.update(dict.fromkeys(roles, accepted))
        return Turn(before=before, accepted=accepted)

    async def _in_turn(self, send: Send, turn: Turn) -> Any:
        """Run the op's I/O in its turn; one that fails before acceptance still spends its number."""
        try:
            if turn.before:
                await asyncio.wait(turn.before)
            if turn.sequence is not None and self._unspent:  # this op's number waits for theirs
                unspent, self._unspent = self._unspent, set()
                await asyncio.gather(*map(self._spend, unspent))
            return await send(turn)
        except Exception:
            if turn.sequence is not None and not turn.released:  # never accepted: its number may be unheard
                await self._spend(turn.sequence)
            raise
        finally:
            turn.release()

    async def _spend(self, sequence: str) -> None:
        """Send a failed op's number on a POST the service answers without queuing anything (the job's
        heartbeat), so the ops numbered after it go in; kept for the next numbered op if this fails too."""
        path = f"/{self._job_id}:heartbeat"
        call = Call("POST", path, f"release {sequence}", sequence=sequence, accept=_ANSWERED_FOR_GOOD)
        try:
            await self._http.send(call)
        except Exception as exc:
            self._unspent.add(sequence)
            _log.warning("could not spend number %s of a failed op (sent again before the next op): %s", sequence, exc)

    def _check_not_closed(self, op: str) -> None:
        if self._closed:
            raise api.ClientClosedError(f"cannot run {op!r}: the client was shut down; build a new client")

    @property
    def _ref(self) -> jobs.JobRef:
        assert self._job is not None, "open() attaches the job before any op runs"
        return self._job

    @property
    def _job_id(self) -> str:
        return self._ref.job_id

    @property
    def _info(self) -> jobs.ServiceInfo:
        """What the service offers; ``open`` probes it before any op runs."""
        assert self._service is not None
        return self._service

    async def _submit(
        self,
        turn: Turn,
        path: str,
        what: str,
        *,
        json: bytes | None = None,
        frame: bytes | None = None,
        group: bool = False,
        params: dict[str, str] | None = None,
        inline: bool = False,
    ) -> dict[str, Any]:
        """POST the op's encoded JSON body or frame (a chunk group when ``group`` or over the cap), then poll. Only
        a numbered POST may ask for its answer inline: one in the accept-then-send line is answered at acceptance."""
        inline_wait = "inline_wait" in self._info.extensions
        hold_s = self._long_poll_s if turn.sequence is not None and inline_wait and not inline else 0.0
        cap = self._max_post_bytes
        bodies = [json] if frame is None else wire.split_frame(frame, max_bytes=cap, operation=what, force=group)
        key = str(uuid.uuid4())
        for replay in range(2 if group else 1):  # a group the service lost is replayed once
            try:
                for index, chunk in enumerate(bodies):
                    last = index == len(bodies) - 1
                    call = Call(
                        "POST",
                        f"/{self._job_id}/{path}",
                        what,
                        content=chunk,
                        content_type="application/json" if frame is None else "application/octet-stream",
                        params={**(params or {}), "wait": f"{hold_s:.3f}"} if last and hold_s else params,
                        idempotency_key=key if len(bodies) == 1 and not group else f"{key}.{replay}.{index}",
                        timeout_s=self._backend.request_timeout_s + hold_s if last and hold_s else None,
                        sequence=turn.sequence if last else None,  # a group queues with its last chunk
                    )
                    body = (await self._http.send(call)).body
                    body = body if isinstance(body, Mapping) else {}
                    if not last and (not body.get("chunk_cached") or "request_id" in body):
                        raise api.RequestFailedError(
                            f"{what}: chunk {index} of {len(bodies)} got {body!r:.200}, not {{'chunk_cached': true}}"
                        )
                break
            except api.ChunkGroupRestartError:
                if replay or not group:
                    raise
                _log.warning("%s: the service lost chunk group; replaying it from chunk 0", what)
        # the accepting answer is in hand: let the next op go, then poll (or read an inline answer)
        turn.release()
        request_id = body.get("request_id")
        if not request_id:
            if inline:
                return dict(body)
            raise api.RequestFailedError(f"{what}: the service answered without a request_id to poll: {body!r:.200}")
        return await poll_request(
            self._http,
            self._job_id,
            str(request_id),
            what=what,
            backoff=self._backoff,
            timeout_s=self._backend.request_timeout_s,
            long_poll_s=self._long_poll_s,
            answered=body if inline_wait and "status" in body else None,
        )

    # --- ops -------------------------------------------------------------------------------------
    def _fwd_bwd(self, request: api.Request) -> Send:
        frame = wire.encode(request.body["batch"])
        return lambda turn: self._submit(turn, "forward-backward", api.OP_FWD_BWD, frame=frame, group=True)

    def _forward(self, request: api.Request) -> Send | dict[str, Any]:
        batch = request.body["batch"]
        if api.OP_FORWARD not in self._info.ops:
            if not self._backend.allow_zero_logprobs:
                raise api.UnsupportedOpError(
                    "the service has no 'forward' op (the managed endpoint lacks it); set "
                    "backend.allow_zero_logprobs=True only for on-policy, single-epoch GRPO without KL, where "
                    "zero log-probs are never read"
                )
            self._warn_once("the service has no 'forward' op: forward() answers zero log-probs (allow_zero_logprobs)")
            return _zero_logprobs(batch)
        # The reference is addressed by job type; on a LoRA job without that sub-job the service
        # scores it on the trainer with the adapters disabled.
        params = {"sub_job_type": "log_probability"} if request.target == api.TARGET_REFERENCE else None
        if params and self.config.lora is None and not self._ref.first("log_probability"):
            raise api.InvalidRequestError("forward(reference=True) needs a reference role; set num_log_prob_workers=1")
        frame = wire.encode(batch, op_metadata=_TENSOR_RESPONSE)
        return lambda turn: self._submit(turn, "forward", api.OP_FORWARD, frame=frame, params=params)

    def _generate(self, request: api.Request) -> Send:
        params = request.body["sampling_params"]
        body = {
            "prompts": request.body["prompts"],
            "sampling_params": [_params_json(p) for p in params] if isinstance(params, list) else _params_json(params),
            "strict": False,
        }
        frame = wire.encode(body)

        async def send(turn: Turn) -> dict[str, Any]:
            result = await self._submit(turn, "generate", api.OP_GENERATE, frame=frame)
            # Only a DSSST1 result can hold tensors; walking a JSON one (thousands of samples) costs ms.
            return _tensors_to_lists(result) if isinstance(result, FrameResult) else result

        return send

    def _json_op(self, path: str, body: dict[str, Any], what: str | None = None, inline: bool = False) -> Send:
        content = json_body(body)  # now, so that a body which cannot be sent never takes a turn it leaves unused
        return lambda turn: self._submit(turn, path, what or path, json=content, inline=inline)

    def _step(self, request: api.Request) -> Send:
        """Send the scheduled rate unless one is given (none for a flat schedule); a failed step does not count."""
        rate = request.body.get("learning_rate")
        schedule = self.config.training.lr_schedule
        if rate is None and (schedule.kind != "constant" or schedule.warmup_steps > 0):
            # A decay to exactly 0 is sent as the smallest rate the API accepts (it requires > 0).
            rate = max(self.config.training.optimizer.lr * schedule.multiplier(self._steps_called), _MIN_LR)
        submit = self._json_op(api.OP_STEP, {} if rate is None else {"learning_rate": float(rate)})
        self._steps_called += 1

        async def send(turn: Turn) -> dict[str, Any]:
            try:
                return await submit(turn)
            except Exception:
                with self._lock:  # handle() counts under it
                    self._steps_called -= 1
                raise

        return send

    def _load(self, request: api.Request) -> Send:
        submit = self._json_op("load", request.body, api.OP_LOAD)

        async def send(turn: Turn) -> dict[str, Any]:
            result = await submit(turn)
            step = result.get("global_step", result.get("global_steps"))
            if isinstance(step, int):
                self._steps_called = step  # the schedule continues from the loaded step
            return result

        return send

    def _operation(self, operation_type: str, payload: dict[str, Any], **target: str | None) -> Send:
        """An ``{job}/operation`` POST; ``target`` names ``sub_job_id`` and/or ``sub_job_type``."""
        body = {"operation_type": operation_type, "payload": payload, **{k: v for k, v in target.items() if v}}
        return self._json_op("operation", body, operation_type, inline=operation_type in api.INLINE_OPERATIONS)

    def _weight_sync(self, request: api.Request) -> Send:
        source, targets = self._ref.first("training"), self._ref.sub_jobs.get("sampling") or []
        if not targets:
            raise api.InvalidRequestError("sync_weights needs a sampling role; set num_sampling_workers=1")
        payload = {
            "source_sub_job_id": source,
            "target_sub_job_ids": list(targets),
            "weight_format": request.body.get("weight_format") or ("lora" if self.config.lora else "vllm"),
        }
        return self._operation(api.OP_WEIGHT_SYNC, payload, sub_job_id=source, sub_job_type="training")

    def _engine_operation(self, request: api.Request) -> Send | dict[str, Any]:
        """An op of the engine table that the service runs through its operation route; ``{}`` where
        there is nothing to run it on (an optional role the job lacks, or a service without it)."""
        call = api.ENGINE_CALLS[request.op]
        if request.op not in self._info.ops or (call.optional and not self._ref.sub_jobs.get(call.role)):
            return {}
        return self._operation(request.op, request.body, sub_job_type=call.role)

    # --- checkpoints (job-level: not queued on a sub-job) ----------------------------------------
    async def _list_checkpoints(self) -> dict[str, Any]:
        return {"checkpoints": await jobs.list_checkpoints(self._http, self._job_id)}

    async def _get_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        listed = await jobs.list_checkpoints(self._http, self._job_id)
        entry = next((c for c in listed if c.get("checkpoint_id") == checkpoint_id), {})
        # read by ops.get_checkpoint, which names fields as every backend does
        return {**entry, **await jobs.export_checkpoint(self._http, self._job_id, checkpoint_id)}

    async def _delete_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        path = f"/{self._job_id}/checkpoints/{checkpoint_id}"
        await self._http.send(Call("DELETE", path, api.OP_DELETE_CHECKPOINT, final=frozenset({404})))
        return {}


def _params_json(params: api.SamplingParams) -> dict[str, Any]:
    return {k: v for k, v in params.model_dump(mode="json").items() if v is not None}


def _tensors_to_lists(value: Any) -> Any:
    """Generate results hold plain lists on every backend; DSSST1 may have carried tensors."""
    if isinstance(value, Mapping):
        return {k: _tensors_to_lists(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        if all(isinstance(v, int | float | str | bool | None) for v in value):
            return value if isinstance(value, list) else list(value)  # JSON already: token ids, logprobs
        return [_tensors_to_lists(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") and hasattr(value, "shape") else value


def _zero_logprobs(batch: Mapping[str, Any]) -> dict[str, Any]:
    """``[B, S]`` zeros shaped like the batch's input ids (the allow_zero_logprobs path)."""
    import torch

    zeros = torch.zeros(batch["kwargs"]["input_ids"].shape, dtype=torch.float32)
    return {"logprobs": zeros, "entropy": zeros.clone()}


def _roles_of(request: api.Request) -> tuple[str, ...]:
    """The sub-job roles whose queues this op enters (weight sync enters both sides)."""
    if request.op == api.OP_WEIGHT_SYNC:
        return (api.TARGET_TRAINING, api.TARGET_SAMPLING)
    if request.target in (api.TARGET_TRAINING, api.TARGET_SAMPLING, api.TARGET_REFERENCE):
        return (request.target,)
    return ()
