"""Sessions, models, sampling sessions and futures of the Tinker API, mapped onto jobs.

A Tinker model is one job with a training and a sampling sub-job on one slot (the sampler on the
trainer's device, ``n_gpus`` 0; LoRA from ``lora_config.rank``);
its training ops run on the training sub-job's ordered worker, in ``seq_id`` order: a POST is
answered at once with a future, and its op is queued once every number before it was used (queued,
or refused: a refused number counts as used). The SDK relies on that answer: it sends chunks 2..n of
a big forward_backward first and sends chunk 1 only once they were answered. A resent number gets the
future it got the first time. A future is a request of the request table (or, for a model being
created, the job reaching ``running``); ``retrieve_future`` long-polls it through the table's waiters.
A trainer and a sampler take as many positions as the model has (its ``max_position_embeddings``).
A sampling session samples with its model's sampling sub-job, or with a sampling job of its own (a
base model, or weights saved earlier). ``retrieve_futures`` reports a sampling client's finished
sample futures in one long-poll, in place of one ``retrieve_future`` long-poll per sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icefloe.protocol import ConflictError, InvalidRequestError, NotFoundError
from icefloe.service import store
from icefloe.service.jobs import JobManager, LiveJob
from icefloe.service.models import JobCreate
from icefloe.service.specs import sub_job_specs

__all__ = ["CheckpointPath", "Future", "Model", "SamplingSession", "TinkerState", "remember"]

_log = logging.getLogger("icefloe.service.tinker")
_KINDS = ("weights", "sampler_weights")
_COPY_PREFIX = "copy-"  # model ids never start so: they are <session>:train:<n>
FUTURES_KEPT = 100_000  # futures, and answers kept per model or sampler for a resent seq_id
_CLONE_SEQ_BLOCK = 1_000_000_000  # a sampling client's seq_ids start at its clone number times this
_START_POLL_S = 0.05  # how often a waiter looks at a starting job's state (no event exists for it)
# The SDK sends a group's sample calls one by one (a few ms apart on a busy host): a call waits until
# none has arrived for GATHER_QUIET_S (at most GATHER_MAX_S), so they reach the sampler as one batch.
GATHER_QUIET_S = 0.008
GATHER_MAX_S = 0.05


@dataclass(frozen=True)
class CheckpointPath:
    """``tinker://<run>/<weights|sampler_weights>/<name>``: run = the model id that saved it."""

    run: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str) -> CheckpointPath:
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in _KINDS or not all(parts):
            raise InvalidRequestError(
                f"path must be tinker://<run>/<weights|sampler_weights>/<name> (no '/' inside a part); got {path!r}"
            )
        return cls(*parts)

    @property
    def copied(self) -> bool:  # a copy_weights run: its own name for another run's files
        return self.run.startswith(_COPY_PREFIX)

    @property
    def checkpoint_id(self) -> str:  # the job's checkpoint record
        return f"tinker-{self.run}-{self.kind}-{self.name}" if self.copied else f"tinker-{self.kind}-{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.run}/{self.kind}/{self.name}"


@dataclass
class Future:
    """What ``retrieve_future`` answers for one request id.

    ``request_id`` set: a request of the job's table, its stored result passed through ``render``
    (a JSON dict, or protobuf bytes); with ``part``, the result is a list and this future renders
    its ``part``-th entry (sample calls gathered into one request). A future may exist before its
    request does (a gathered sample call, a training op waiting for its turn): ``submitted`` gives the
    request id once queued. None of these: the job itself, ``render(None)`` once it runs.
    """

    job_id: str
    render: Callable[[Any], dict[str, Any] | bytes]
    request_id: str | None = None
    part: int | None = None
    rendered: dict[str, Any] | bytes | None = None  # rendered with a sibling, until first read
    gathering: _Gathering | None = None
    submitted: asyncio.Future[str] | None = None


@dataclass
class Model:
    model_id: str
    session_id: str
    job_id: str
    base_model: str
    lora_rank: int | None
    next_seq: int = 1
    taken: dict[int, dict[str, Any]] = field(default_factory=dict)  # seq_id -> the answer it got
    # seq_id -> what queues its op (None: refused) and the future its request id goes to, until its turn
    waiting: dict[int, tuple[Callable[[], str] | None, asyncio.Future[str] | None]] = field(default_factory=dict)
    sampler_path: str | None = None  # the saved weights the model's own sampler holds now


def remember(taken: dict[int, Any], seq_id: int, answer: Any) -> None:
    """Keep ``answer`` for a resend of ``seq_id``, and forget the one ``FUTURES_KEPT`` numbers before it."""
    taken[seq_id] = answer
    taken.pop(seq_id - FUTURES_KEPT, None)


@dataclass
class Completions:
    """One sampling client's sample futures for ``retrieve_futures``: those not reported yet, and
    those reported but not yet acknowledged (numbered by cursor, so a lost answer is sent again)."""

    pending: deque[str] = field(default_factory=lambda: deque(maxlen=FUTURES_KEPT))
    reported: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    cursor: int = 0
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set when a future joins ``pending``


@dataclass
class SamplingSession:
    sampling_session_id: str
    session_id: str
    job_id: str
    base_model: str
    model_path: str | None
    taken: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)  # seq_id -> its answer
    gathering: _Gathering | None = None  # the sample calls waiting to go out as one request
    clients: int = 1  # the original client is 0; each joined clone gets the next number
    completions: dict[int, Completions] = field(default_factory=dict)  # clone number -> its futures

    def track(self, seq_id: int | None, future_id: str) -> None:
        """Note a queued sample future for ``retrieve_futures`` of the client that sent ``seq_id``."""
        clone = (seq_id or 0) // _CLONE_SEQ_BLOCK
        queue = self.completions.setdefault(clone, Completions())
        queue.pending.append(future_id)
        queue.arrived.set()


@dataclass
class _Gathering:
    gathering_id: str  # its calls' futures are <gathering_id>.<index>
    items: list[Any]
    submitted: asyncio.Future[str]  # the request id the items went out under
    quiet_until: float
    deadline: float
    sender: asyncio.Task[None] | None = None
    cancelled: set[int] = field(default_factory=set)  # items cancelled, before or after it was sent
    size: int = 0  # how many items it was sent with (cancelled ones included)


class TinkerState:
    """Everything the Tinker routes keep between calls; lives on ``app.state.tinker``."""

    def __init__(self, manager: JobManager, *, gap_timeout_s: float, session_lease_s: float = 120.0) -> None:
        self.manager = manager
        self.gap_timeout_s = gap_timeout_s
        self.session_lease_s = session_lease_s  # the SDK heartbeats every 10 s
        # Off: per sample, the SDK's retrieve_future long-poll answers when the sample is done. On,
        # it long-polls retrieve_futures once per sampling client, then still fetches each result:
        # one request more per batch of samples, and more CPU on both sides (python -m bench tinker).
        self.advertise_retrieve_futures = False
        self.sessions: dict[str, str] = {}  # session id -> "active" | "finished"
        self.heartbeats: dict[str, float] = {}  # session id -> monotonic time of its last sign of life
        self._reaper: asyncio.Task[None] | None = None
        self.session_jobs: dict[str, list[str]] = {}
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.futures: dict[str, Future] = {}

    # --- sessions -----------------------------------------------------------------------------
    def create_session(self) -> str:
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = "active"
        self.session_jobs[session_id] = []
        self.heartbeat(session_id)
        if self._reaper is None:  # on the server's loop, which cancels it at shutdown
            self._reaper = asyncio.get_running_loop().create_task(self._reap_lapsed_sessions())
        return session_id

    def heartbeat(self, session_id: str) -> None:
        """The session lives on, and so do its jobs: their leases are renewed with it."""
        self.heartbeats[session_id] = time.monotonic()
        for job_id in self.session_jobs.get(session_id, []):
            self.manager.renew(job_id)

    async def _reap_lapsed_sessions(self) -> None:
        """The session is the lease: one whose heartbeats stop for ``session_lease_s`` is finished."""
        while True:
            await asyncio.sleep(min(5.0, self.session_lease_s / 2))
            now = time.monotonic()
            for session_id, status in list(self.sessions.items()):
                if status == "active" and now - self.heartbeats[session_id] > self.session_lease_s:
                    _log.warning(
                        "session %s sent no heartbeat for %g s; finishing it", session_id, self.session_lease_s
                    )
                    try:
                        why = f"its Tinker session sent no heartbeat for {self.session_lease_s:g} s"
                        await asyncio.to_thread(self.finish_session, session_id, why)
                    except Exception as exc:  # the service is shutting down under it
                        _log.warning("finishing lapsed session %s failed: %s", session_id, exc)

    def session(self, session_id: str) -> str:
        status = self.sessions.get(session_id)
        if status is None:
            raise NotFoundError(f"session {session_id} not found; create one with create_session")
        return status

    def finish_session(self, session_id: str, reason: str = "its Tinker session was finished") -> None:
        """End the session and cancel its jobs (models and samplers), each with ``reason``; idempotent."""
        self.session(session_id)
        self.sessions[session_id] = "finished"
        for job_id in self.session_jobs.get(session_id, []):
            with contextlib.suppress(ConflictError):  # failed or finished already
                self.manager.cancel(job_id, reason)

    # --- jobs ---------------------------------------------------------------------------------
    def create_job(
        self,
        session_id: str,
        base_model: str,
        *,
        lora_rank: int | None,
        training: bool,
        name: str,
        source: CheckpointPath | None = None,
        load_optimizer: bool = True,
        layers: dict[str, bool] | None = None,
    ) -> str:
        """A job for a Tinker model (``training``) or sampler; ``layers``: the ``train_attn`` /
        ``train_mlp`` / ``train_unembed`` flags of its LoRA adapter."""
        if self.session(session_id) != "active":
            raise ConflictError(f"session {session_id} is finished; create a new session")
        lora = {"peft_type": "Lora", "r": lora_rank, "lora_alpha": lora_rank, **(layers or {})}
        peft = {"peft_config": lora} if lora_rank else {}
        positions = self.context_length(base_model)
        sub_jobs: list[dict[str, Any]] = []
        if training:
            training_config = {**peft, "max_seq_len": positions, "load_optimizer_states": load_optimizer}
            sub_jobs.append({"job_type": "training", "model_name": base_model, "training_config": training_config})
        # A trainer's sampler shares its device (n_gpus 0): a model takes one slot, like the local backend.
        inference = {**peft, "max_seq_len": positions, "n_gpus": 0 if training else 1}
        sampling: dict[str, Any] = {"job_type": "sampling", "model_name": base_model, "inference_config": inference}
        sub_jobs.append(sampling)
        if source is not None:
            job_id = self.checkpoint_job(source)
            info = {"checkpoint_id": source.checkpoint_id, "source_job_id": job_id}
            sub_jobs[0]["source_checkpoint_info"] = info
        body = JobCreate.model_validate({"sub_job_configs": sub_jobs, "experiment_name": name})
        job_id = self.manager.create(body, database="tinker", schema=session_id)
        self.session_jobs[session_id].append(job_id)
        return job_id

    def context_length(self, base_model: str) -> int:
        """How many positions ``base_model`` has: its config.json's ``max_position_embeddings``."""
        from icefloe.engines.models import resolve_model

        body = JobCreate.model_validate({"sub_job_configs": [{"job_type": "sampling", "model_name": base_model}]})
        (spec,) = sub_job_specs("context-length", body, model_root=self.manager.settings.model_root)
        config = json.loads((resolve_model(spec.config.model) / "config.json").read_text())
        positions = config.get("max_position_embeddings") or config.get("n_positions")
        if not isinstance(positions, int):
            raise InvalidRequestError(
                f"base_model {base_model!r} has no max_position_embeddings in its config.json; add the model's "
                "context length there"
            )
        return positions

    async def running(self, job_id: str, timeout_s: float) -> LiveJob | None:
        """The job once it runs; None if it is still starting after ``timeout_s``."""
        with contextlib.suppress(ConflictError):  # the common case, from memory: it runs
            return self.manager.live(job_id)
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            status = self.manager.public(job_id)["status"]
            if status == "running":
                return self.manager.live(job_id)
            if status not in ("pending", "placing", "initializing"):
                raise ConflictError(f"job {job_id} is {status}: {self.manager.public(job_id)['reason'] or ''}")
            if asyncio.get_running_loop().time() >= deadline:
                return None
            await asyncio.sleep(_START_POLL_S)

    async def live(self, job_id: str) -> LiveJob:
        job = await self.running(job_id, timeout_s=600.0)
        if job is None:
            raise ConflictError(f"job {job_id} did not start within 600 s")
        return job

    def sub_job(self, job: LiveJob, job_type: str) -> str:
        return next(sid for sid, spec in job.specs.items() if spec.job_type == job_type)

    # --- models and their ordered ops ---------------------------------------------------------
    def model(self, model_id: str) -> Model:
        model = self.models.get(model_id)
        if model is None:
            raise NotFoundError(f"model {model_id} not found; create it with create_model")
        return model

    async def in_turn(
        self,
        model: Model,
        seq_id: int | None,
        render: Callable[[Any], Any],
        prepare: Callable[[], Awaitable[Callable[[], str]]],
    ) -> dict[str, Any]:
        """Answer op ``seq_id`` at once with a future; queue the op once every number before it is used.

        ``prepare`` checks the op and returns what queues it (returning its request id); a refusal is
        the POST's answer and uses up the number. A resent number gets the answer it got the first time.
        """
        if seq_id is not None and seq_id in model.taken:
            return model.taken[seq_id]
        try:
            queue = await prepare()
        except Exception:
            if seq_id is not None:
                self._in_order(model, seq_id, None, None)
            raise
        if seq_id is None:
            return {"request_id": self.future(model.job_id, render, queue())}
        if seq_id in model.taken:  # a resend that arrived while its first copy was being checked
            return model.taken[seq_id]
        submitted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        answer = {"request_id": self.future(model.job_id, render, submitted=submitted)}
        remember(model.taken, seq_id, answer)
        self._in_order(model, seq_id, queue, submitted)
        return answer

    def _in_order(
        self, model: Model, seq_id: int, queue: Callable[[], str] | None, submitted: asyncio.Future[str] | None
    ) -> None:
        """Queue op ``seq_id`` (``queue`` None: refused) once the numbers before it are used, and every
        op waiting behind it whose turn that makes; one still waiting after ``gap_timeout_s`` fails."""

        def send(queue: Callable[[], str] | None, submitted: asyncio.Future[str] | None) -> None:
            if queue is None or submitted is None:
                return
            try:
                submitted.set_result(queue())
            except Exception as exc:  # read through the future
                submitted.set_exception(exc)
                submitted.exception()

        if seq_id < model.next_seq:  # a late number (a resend of a refused op): its turn has passed
            send(queue, submitted)
            return
        model.waiting[seq_id] = (queue, submitted)
        while (entry := model.waiting.pop(model.next_seq, None)) is not None:
            model.next_seq += 1
            send(*entry)
        if seq_id in model.waiting:
            asyncio.get_running_loop().call_later(self.gap_timeout_s, self._gap_expired, model, seq_id, submitted)

    def _gap_expired(self, model: Model, seq_id: int, submitted: asyncio.Future[str] | None) -> None:
        entry = model.waiting.get(seq_id)
        if entry is None or entry[1] is not submitted:
            return  # its turn came
        del model.waiting[seq_id]
        model.taken.pop(seq_id, None)  # a resend waits anew
        if submitted is not None:
            submitted.set_exception(
                ConflictError(
                    f"seq_id {seq_id} of model {model.model_id} waited {self.gap_timeout_s:g} s for "
                    f"seq_id {model.next_seq}, which never arrived"
                )
            )
            submitted.exception()

    def future(
        self,
        job_id: str,
        render: Callable[[Any], Any],
        request_id: str | None = None,
        *,
        gathered: tuple[_Gathering, int] | None = None,
        submitted: asyncio.Future[str] | None = None,
    ) -> str:
        """A future for ``request_id``, for the job start (none given), for a call of a gathering
        (``gathered``: what :meth:`gather` returned), or for a request not queued yet (``submitted``)."""
        if gathered is not None:
            gathering, part = gathered
            future_id = f"{gathering.gathering_id}.{part}"
            self.futures[future_id] = Future(
                job_id, render, part=part, gathering=gathering, submitted=gathering.submitted
            )
        elif submitted is not None:
            future_id = f"{job_id}:op:{uuid.uuid4().hex}"
            self.futures[future_id] = Future(job_id, render, submitted=submitted)
        else:
            future_id = request_id or f"{job_id}:start:{uuid.uuid4().hex}"
            self.futures[future_id] = Future(job_id, render, request_id)
        while len(self.futures) > FUTURES_KEPT:  # the oldest first: long retrieved by now
            del self.futures[next(iter(self.futures))]
        return future_id

    def answer(self, future_id: str, future: Future, row: dict[str, Any]) -> dict[str, Any] | bytes:
        """The answer of a future whose request finished (``row``). The first part of a gathered
        request read renders every part, so its result is parsed once, not once per part; a part
        read again (a resent poll) is rendered anew."""
        if future.part is None:
            return future.render(result_of(row))
        if future.rendered is None:
            prefix = future_id.rpartition(".")[0]
            for part, result in enumerate(result_of(row)):
                sibling = self.futures.get(f"{prefix}.{part}")
                if sibling is not None and result is not None:  # None: cancelled before it was sent
                    sibling.rendered = sibling.render(result)
        answer, future.rendered = future.rendered, None
        if answer is None:  # a part cancelled before its gathering was sent
            return {"error": "cancelled by the caller before it was sent", "category": "user"}
        return answer

    async def request_of(self, future: Future, timeout_s: float) -> str | None:
        """The request a future reads; for a gathered call, once its gathering is sent (None if it
        is still gathering after ``timeout_s``). Raises the refusal of a refused gathering."""
        if future.request_id is None and future.submitted is not None:
            submitted = future.submitted
            await asyncio.wait([submitted], timeout=timeout_s)
            if submitted.done():
                future.request_id = submitted.result()
        return future.request_id

    def cancel(self, future_id: str) -> None:
        """Drop a future's request if it has not started, once every future sharing it was cancelled;
        a request that runs or ran is left as it is."""
        future = self.futures.get(future_id)
        if future is None:
            raise NotFoundError(f"future {future_id} not found")
        request_id, gathering = future.request_id, future.gathering
        if gathering is not None:
            gathering.cancelled.add(future.part or 0)  # before it is sent: left out of it
            sent = gathering.submitted
            if not sent.done() or sent.exception() is not None or len(gathering.cancelled) < gathering.size:
                return  # still gathering, refused (nothing was queued), or wanted by another call
            request_id = sent.result()
        if request_id is not None:  # None: a model being created; its session's end cancels it
            with contextlib.suppress(NotFoundError):  # long finished and forgotten
                self.manager.requests.cancel(future.job_id, request_id, why="cancelled by the caller")

    async def completions(
        self, sampler: SamplingSession, clone: int, prev_cursor: int, wait_s: float
    ) -> tuple[list[dict[str, Any]], int]:
        """The sample futures of a sampling client finished after ``prev_cursor``, and the new cursor;
        waits up to ``wait_s`` for the first if none has finished yet (a long-poll)."""
        queue = sampler.completions.setdefault(clone, Completions())
        queue.reported = [(cursor, c) for cursor, c in queue.reported if cursor > prev_cursor]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            self._report_finished(queue)
            remaining = deadline - loop.time()
            if queue.reported or remaining <= 0:
                return [c for _, c in queue.reported], queue.cursor
            if queue.pending:  # futures finish in about the order they were queued
                future = self.futures[queue.pending[0]]
                with contextlib.suppress(Exception):  # a refused gathering: reported failed above
                    if (request_id := await self.request_of(future, remaining)) is not None:
                        await self.manager.requests.wait(future.job_id, request_id, deadline - loop.time())
            else:
                queue.arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(queue.arrived.wait(), remaining)

    def _report_finished(self, queue: Completions) -> None:
        still: deque[str] = deque(maxlen=FUTURES_KEPT)
        for future_id in queue.pending:
            future = self.futures.get(future_id)
            if future is None:
                continue  # forgotten long ago
            outcome = self._outcome(future)
            if outcome is None:
                still.append(future_id)
            else:
                queue.cursor += 1
                queue.reported.append((queue.cursor, {"state": outcome, "request_id": future_id}))
        queue.pending = still

    def _outcome(self, future: Future) -> str | None:
        """``finished`` or ``failed`` once a future's request ended (a refused gathering: failed)."""
        if future.request_id is None:
            submitted = future.submitted
            assert submitted is not None  # a sample future
            if not submitted.done():
                return None  # still gathering
            if submitted.exception() is not None:
                return "failed"
            future.request_id = submitted.result()
        if self.manager.requests.is_open(future.request_id):
            return None
        row = self.manager.requests.get(future.job_id, future.request_id)
        return "finished" if row["status"] == "done" else "failed"

    def gather(self, sampler: SamplingSession, item: Any, submit: Callable[[list[Any]], str]) -> tuple[_Gathering, int]:
        """Add ``item`` to the sampler's gathering of the sample calls arriving now.

        Returns the gathering and the item's index in it. Once no call has arrived for
        ``GATHER_QUIET_S`` (at most ``GATHER_MAX_S`` after the first), ``submit(items)`` sends them
        as one request (which still batches with other sessions' requests on the sampler), an item
        cancelled meanwhile as None, and ``submitted`` gets the request id. The caller answers at once
        with a future id, so the client's polls overlap the gathering instead of following it.
        """
        loop = asyncio.get_running_loop()
        now = loop.time()
        gathering = sampler.gathering
        if gathering is None:
            gathering = _Gathering(uuid.uuid4().hex, [], loop.create_future(), now + GATHER_QUIET_S, now + GATHER_MAX_S)
            sampler.gathering = gathering
            gathering.sender = loop.create_task(self._send_gathered(sampler, gathering, submit))
        part = len(gathering.items)
        gathering.items.append(item)
        gathering.quiet_until = now + GATHER_QUIET_S
        return gathering, part

    async def _send_gathered(
        self, sampler: SamplingSession, gathering: _Gathering, submit: Callable[[list[Any]], str]
    ) -> None:
        loop = asyncio.get_running_loop()
        while (wait := min(gathering.quiet_until, gathering.deadline) - loop.time()) > 0:
            await asyncio.sleep(wait)
        sampler.gathering = None
        items = [None if part in gathering.cancelled else item for part, item in enumerate(gathering.items)]
        gathering.items, gathering.size = [], len(items)  # the request holds them now
        try:
            if len(gathering.cancelled) == len(items):
                raise ConflictError("cancelled by the caller before it was sent")
            await self.live(sampler.job_id)  # a job waiting for slots: sent once it runs
            gathering.submitted.set_result(submit(items))
        except Exception as exc:  # every call of the gathering gets the refusal, through its future
            gathering.submitted.set_exception(exc)
            gathering.submitted.exception()  # read here, so no poll is needed to consume it

    # --- checkpoints --------------------------------------------------------------------------
    def checkpoint_job(self, path: CheckpointPath) -> str:
        """The job that saved ``path`` (from this process's models, or the store)."""
        model = self.models.get(path.run)
        if model is not None and store.get_checkpoint(
            self.manager.db, job_id=model.job_id, checkpoint_id=path.checkpoint_id
        ):
            return model.job_id
        for record in store.find_checkpoints(self.manager.db, checkpoint_id=path.checkpoint_id):
            if path.copied:  # the copy's record names its run
                return record["job_id"]
            row = store.get_job(self.manager.db, job_id=record["job_id"])
            if row is not None and row["spec"].get("experiment_name") == path.run:
                return record["job_id"]
        raise NotFoundError(f"checkpoint {path} not found; save it with save_weights or save_weights_for_sampler")

    def copy_checkpoint(self, source: CheckpointPath) -> CheckpointPath:
        """A new run's name for ``source``'s files (``tinker://copy-<hex>/<kind>/<name>``), recorded on
        the job that saved them: nothing is duplicated, and nothing trains under the copy's run."""
        job_id = self.checkpoint_job(source)
        record = store.get_checkpoint(self.manager.db, job_id=job_id, checkpoint_id=source.checkpoint_id)
        assert record is not None
        copy = CheckpointPath(f"{_COPY_PREFIX}{uuid.uuid4().hex}", source.kind, source.name)
        store.upsert_checkpoint(
            self.manager.db, job_id=job_id, checkpoint_id=copy.checkpoint_id, global_steps=record["global_steps"],
            avg_loss=record["avg_loss"], checkpoint_type=record["checkpoint_type"], path=record["path"],
        )  # fmt: skip
        return copy

    def checkpoint_folder(self, path: CheckpointPath) -> Path:
        job_id = self.checkpoint_job(path)
        record = store.get_checkpoint(self.manager.db, job_id=job_id, checkpoint_id=path.checkpoint_id)
        assert record is not None
        return Path(record["path"])

    def base_model_of(self, path: CheckpointPath) -> tuple[str, int | None, dict[str, bool]]:
        """The base model, LoRA rank and adapted layer kinds of the run that saved ``path``."""
        row = store.get_job(self.manager.db, job_id=self.checkpoint_job(path))
        assert row is not None
        first = row["spec"]["body"]["sub_job_configs"][0]
        section = first.get("training_config") or first.get("inference_config") or {}
        peft = section.get("peft_config") or {}
        layers = {key: peft[key] for key in ("train_attn", "train_mlp", "train_unembed") if key in peft}
        return first["model_name"], peft.get("r"), layers


def result_of(row: dict[str, Any]) -> Any:
    return json.loads(row["result"]) if row.get("result") else None
