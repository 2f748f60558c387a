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
base model, or weights saved earlier). Each sample call is one request, queued at once: the host's
worker decodes the samples queued together, of any API and run, as one batch. ``retrieve_futures``
reports a sampling client's finished sample futures in one long-poll, in place of one
``retrieve_future`` long-poll per sample.
Sessions and runs (models and samplers) are rows of the store as well, each session owned by the
tenant that made it: what a finished session or a restart drops from memory is still found there.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from icefloe.protocol import (
    JOB_ACTIVE_STATES,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    TooManyRequestsError,
)
from icefloe.service import store
from icefloe.service.errors import retried
from icefloe.service.jobs import JobManager, LiveJob
from icefloe.service.limits import SEQUENCE_WINDOW, TenantBytes
from icefloe.service.routes.handlers import submit_weight_sync
from icefloe.service.schemas import JobCreate, WeightSyncPayload
from icefloe.service.specs import sub_job_specs
from icefloe.service.tenants import Tenancy
from icefloe.service.turns import Turns
from icefloe.service.work.door import enter
from icefloe.service.work.items import TINKER, Item, Sample, Save

__all__ = ["CheckpointPath", "Future", "Model", "SamplerSave", "SamplingSession", "Snapshot", "TinkerState", "Turn",
           "remember"]  # fmt: skip

_log = logging.getLogger("icefloe.service.tinker")
_KINDS = ("weights", "sampler_weights", "external_weights")  # "snapshot" (kept for a client) is never a caller's path
_COPY_PREFIX = "copy-"  # model ids never start so: they are <session>:train:<n>
FUTURES_KEPT = 100_000  # futures, and answers kept per model or sampler for a resent seq_id
_CLONE_SEQ_BLOCK = 1_000_000_000  # a sampling client's seq_ids start at its clone number times this
_START_POLL_S = 0.05  # how often a waiter looks at a starting job's state (no event exists for it)


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
                f"path must be tinker://<run>/<weights|sampler_weights|external_weights>/<name> (no '/' inside a "
                f"part); got {path[:200]!r}"
            )
        return cls(*parts)

    def copy(self) -> CheckpointPath:
        """A new run's name for the same files (``tinker://copy-<hex>/<kind>/<name>``)."""
        return CheckpointPath(f"{_COPY_PREFIX}{uuid.uuid4().hex}", self.kind, self.name)

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
    (a JSON dict, or protobuf bytes) when polled. A future may exist before its request does (a
    sample call on a job still starting, a training op waiting for its turn): ``submitted`` gives the
    request id once queued. None of these: the job itself, ``render(None)`` once it runs.
    """

    job_id: str
    render: Callable[[Any], dict[str, Any] | bytes]
    request_id: str | None = None
    submitted: asyncio.Future[str] | None = None
    tag: str | None = None  # a sample call's tag, which stops it once it runs (SamplingEngine.cancel)
    cancelled: bool = False  # by cancel_future before its request was queued: it never is


@dataclass
class Model:
    model_id: str
    session_id: str
    job_id: str
    base_model: str
    lora_rank: int | None
    turns: Turns
    owner: str
    taken: dict[int, dict[str, Any]] = field(default_factory=dict)  # seq_id -> the answer it got
    holding: set[asyncio.Task[None]] = field(default_factory=set)  # ops waiting for their turn
    # The model's own sampler: how many syncs were queued into it, and the files (with the request
    # that writes them) of the weights the last one carries; None when it carries no files (inflight).
    sampler_version: int = 0
    sampler_files: Snapshot | None = None
    sampler_saves: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)  # session seq -> first save


@dataclass(frozen=True)
class Snapshot:
    """Saved weights a snapshot sampling client keeps: their checkpoint, and the save request writing it."""

    path: CheckpointPath
    save_request_id: str


@dataclass
class SamplerSave:
    """A ``save_weights_for_sampler``: a save of ``path`` (``save``; None for an unnamed ``inflight`` one,
    which keeps no files) and a sync of ``sub_job_id``'s weights into the model's sampler; ``answer`` is
    filled in when it is queued. ``session_seq`` names the sampling client it makes, a ``snapshot`` one
    pinned to these weights."""

    model: Model
    path: CheckpointPath
    sub_job_id: str
    save: Save | None
    answer: dict[str, Any]
    session_seq: int | None = None
    named: bool = False
    snapshot: bool = False


class Turn:
    """An ordered op of a model in ``seq_id`` order (:meth:`TinkerState.turn`), used as a ``with`` block.

    ``answer``: a resend's first answer (None for a number not taken). An exception inside the block,
    before :meth:`queue`, uses the number up: the refusal is the POST's answer. :meth:`queue` answers at
    once with a future and queues the op now when every number before it was used, else from a task that
    holds it until then (chunks of one batch may come in any order).
    """

    def __init__(self, state: TinkerState, model: Model, seq_id: int | None) -> None:
        self.state, self.model, self.seq_id = state, model, seq_id
        self.answer: dict[str, Any] | None = model.taken.get(seq_id) if seq_id is not None else None
        self._queued = False

    def __enter__(self) -> Turn:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if isinstance(error, Exception) and self.seq_id is not None and not self._queued and not retried(error):
            self.model.turns.use(self.seq_id)

    def queue(
        self, job: LiveJob, item: Item | SamplerSave, render: Callable[[Any], Any], tenant: str | None = None
    ) -> dict[str, Any]:
        """Queue ``item`` on ``job`` in its turn; the answer, a future whose result ``render`` answers."""
        state, model, seq_id = self.state, self.model, self.seq_id
        held = seq_id is not None and seq_id not in model.taken and seq_id > model.turns.next
        size = _tensor_bytes(item) if held else 0
        if held:  # refused past the tenant's budget: a retry keeps the number (see __exit__)
            state.hold_ahead(model, seq_id, size)
        self._queued = True
        door: Callable[[LiveJob, Any], str] = (  # a sampler save is a save and a sync; any other op, one item
            state.save_for_sampler
            if isinstance(item, SamplerSave)
            else functools.partial(enter, state.manager, api=TINKER, tenant=tenant)
        )
        if seq_id is None:
            return {"request_id": state.future(model.job_id, render, door(job, item))}
        if seq_id in model.taken:  # a resend that arrived while its first copy was being checked
            return model.taken[seq_id]
        submitted: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        answer = {"request_id": state.future(model.job_id, render, submitted=submitted)}
        remember(model.taken, seq_id, answer)
        if seq_id > model.turns.next:  # held by a task of its own until its turn
            task = asyncio.get_running_loop().create_task(self._queue_in_turn(door, job, item, submitted))
            model.holding.add(task)
            task.add_done_callback(model.holding.discard)
            task.add_done_callback(lambda _: state.held_ahead.give(model.owner, size))
            return answer
        try:  # its turn, or a late resend of a refused op: now; a refusal is read through the future
            submitted.set_result(door(job, item))
        except Exception as exc:
            submitted.set_exception(exc)
            submitted.exception()
        model.turns.use(seq_id)
        return answer

    async def _queue_in_turn(
        self, door: Callable[[LiveJob, Any], str], job: LiveJob, item: Item | SamplerSave, submitted: asyncio.Future
    ) -> None:
        assert self.seq_id is not None
        missing = await self.model.turns.wait(self.seq_id)
        try:
            if missing is not None:
                raise ConflictError(
                    f"seq_id {self.seq_id} of model {self.model.model_id} waited {self.state.gap_timeout_s:g} s "
                    f"for seq_id {missing}, which never arrived; it did not run, and the model moves on past it"
                )
            submitted.set_result(door(job, item))
        except Exception as exc:  # read through the future
            submitted.set_exception(exc)
            submitted.exception()
        if missing is None:
            self.model.turns.use(self.seq_id)


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
    owner: str
    taken: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)  # seq_id -> its answer
    clients: int = 1  # the original client is 0; each joined clone gets the next number
    completions: dict[int, Completions] = field(default_factory=dict)  # clone number -> its futures
    # A snapshot client on its model's own sampler: the model, the sync it was made on and its files.
    # Once a later sync is queued there, its next call moves it to a sampler job of its own (from the files).
    model_id: str | None = None
    pinned: int | None = None
    snapshot: Snapshot | None = None
    moving: asyncio.Task[None] | None = None

    def track(self, seq_id: int | None, future_id: str) -> None:
        """Note a queued sample future for ``retrieve_futures`` of the client that sent ``seq_id``."""
        clone = (seq_id or 0) // _CLONE_SEQ_BLOCK
        queue = self.completions.setdefault(clone, Completions())
        queue.pending.append(future_id)
        queue.arrived.set()


@dataclass
class _Session:
    owner: str
    heartbeat: float  # time.monotonic() of its last sign of life
    jobs: list[str] = field(default_factory=list)  # its models' and samplers' jobs


class TinkerState:
    """Everything the Tinker routes keep between calls; lives on ``app.state.tinker``.

    Active sessions, their models and samplers live in memory; every session, model and sampler is
    also a row of the store (``tinker_sessions``, ``tinker_runs``), so after a restart, or once a
    finished session is pruned from memory, its runs and checkpoints are still listed and loadable.
    Every lookup takes the caller's tenant: another tenant's session, model, sampler, future or
    checkpoint answers as one that does not exist.
    """

    def __init__(
        self,
        manager: JobManager,
        tenancy: Tenancy,
        *,
        gap_timeout_s: float,
        window: int = SEQUENCE_WINDOW,
        session_lease_s: float = 120.0,
        held_ahead_bytes: int = 256 << 20,
    ) -> None:
        self.manager = manager
        self.held_ahead = TenantBytes(held_ahead_bytes)  # tensors of ops waiting for their turn: see hold_ahead
        self.tenancy = tenancy
        self.db = manager.db
        self.gap_timeout_s = gap_timeout_s
        self.window = window
        self.session_lease_s = session_lease_s  # the SDK heartbeats every 10 s
        # Off: per sample, the SDK's retrieve_future long-poll answers when the sample is done. On,
        # it long-polls retrieve_futures once per sampling client, then still fetches each result:
        # one request more per batch of samples, and more CPU on both sides (python -m bench tinker).
        self.advertise_retrieve_futures = False
        self.sessions: dict[str, _Session] = {}  # the active ones; a finished session is pruned
        self._reaper: asyncio.Task[None] | None = None
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, SamplingSession] = {}
        self.futures: dict[str, Future] = {}
        self._sending: set[asyncio.Task[None]] = set()  # sample calls waiting for their job to start
        store.finish_active_tinker_sessions(self.db)  # a previous process's: their jobs failed with it

    # --- sessions -----------------------------------------------------------------------------
    def create_session(self, tenant: str) -> str:
        session_id = uuid.uuid4().hex
        store.insert_tinker_session(self.db, session_id=session_id, owner=tenant)
        self.sessions[session_id] = _Session(tenant, time.monotonic())
        if self._reaper is None:  # on the server's loop, which cancels it at shutdown
            self._reaper = asyncio.get_running_loop().create_task(self._reap_lapsed_sessions())
        return session_id

    def heartbeat(self, session_id: str) -> None:
        """The session lives on, and so do its jobs: their leases are renewed with it."""
        session = self.sessions[session_id]
        session.heartbeat = time.monotonic()
        for job_id in session.jobs:
            self.manager.renew(job_id)

    async def _reap_lapsed_sessions(self) -> None:
        """The session is the lease: one whose heartbeats stop for ``session_lease_s`` is finished."""
        while True:
            await asyncio.sleep(min(5.0, self.session_lease_s / 2))
            now = time.monotonic()
            for session_id, session in list(self.sessions.items()):
                if now - session.heartbeat > self.session_lease_s:
                    _log.warning(
                        "session %s sent no heartbeat for %g s; finishing it", session_id, self.session_lease_s
                    )
                    try:
                        why = f"its Tinker session sent no heartbeat for {self.session_lease_s:g} s"
                        await asyncio.to_thread(self.finish_session, session_id, session.owner, why)
                    except Exception as exc:  # the service is shutting down under it
                        _log.warning("finishing lapsed session %s failed: %s", session_id, exc)

    def session(self, session_id: str, tenant: str) -> str:
        """``active`` or ``finished``; 404 for a session that is not the tenant's."""
        session = self.sessions.get(session_id)
        owner = session.owner if session is not None else None
        if session is None:
            row = store.get_tinker_session(self.db, session_id=session_id)
            owner = row["owner"] if row is not None else None
        if not self.tenancy.sees(tenant, owner):
            raise NotFoundError(f"session {session_id} not found; create one with create_session")
        return "active" if session is not None else "finished"

    def finish_session(self, session_id: str, tenant: str, reason: str = "its Tinker session was finished") -> None:
        """End the session, cancel its jobs (models and samplers) with ``reason`` and forget it here; idempotent."""
        self.session(session_id, tenant)
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        store.finish_tinker_session(self.db, session_id=session_id)
        for job_id in session.jobs:
            with contextlib.suppress(ConflictError):  # failed or finished already
                self.manager.cancel(job_id, reason)
        for table in (self.models, self.samplers):
            for run_id in [run_id for run_id, run in table.items() if run.session_id == session_id]:
                del table[run_id]

    # --- jobs ---------------------------------------------------------------------------------
    def create_job(
        self,
        session_id: str,
        base_model: str,
        *,
        lora_rank: int | None,
        training: bool,
        name: str,
        tenant: str,
        source: CheckpointPath | None = None,
        load_optimizer: bool = True,
        layers: dict[str, bool] | None = None,
    ) -> str:
        """A job for a Tinker model (``training``) or sampler; ``layers``: the ``train_attn`` /
        ``train_mlp`` / ``train_unembed`` flags of its LoRA adapter."""
        if self.session(session_id, tenant) != "active":
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
            job_id = self.checkpoint_job(source, tenant)
            info = {"checkpoint_id": source.checkpoint_id, "source_job_id": job_id}
            sub_jobs[0]["source_checkpoint_info"] = info
        body = JobCreate.model_validate({"sub_job_configs": sub_jobs, "experiment_name": name})
        session = self.sessions[session_id]
        job_id = self.tenancy.create(self.manager, body, tenant=session.owner, database="tinker", schema=session_id)
        session.jobs.append(job_id)
        return job_id

    def context_length(self, base_model: str) -> int:
        """How many positions ``base_model`` has: its config.json's ``max_position_embeddings``."""
        from icefloe.engines.models import resolve_model

        body = JobCreate.model_validate({"sub_job_configs": [{"job_type": "sampling", "model_name": base_model}]})
        (spec,) = sub_job_specs("context-length", body, model_root=self.manager.settings.model_root)
        try:
            config = json.loads((resolve_model(spec.config.model) / "config.json").read_text())
        except (OSError, ValueError):  # ValueError: not JSON (the message would name the server's path)
            why = "its config.json cannot be read; fix the model folder"
            raise InvalidRequestError(f"base_model {base_model!r}: {why}") from None
        positions = None
        if isinstance(config, dict):
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
    def add_model(self, model_id: str, session_id: str, job_id: str, base_model: str, lora_rank: int | None) -> Model:
        owner = self.sessions[session_id].owner
        store.insert_tinker_run(
            self.db, run_id=model_id, kind="model", session_id=session_id, job_id=job_id, base_model=base_model,
            lora_rank=lora_rank, model_path=None,
        )  # fmt: skip
        model = self.models[model_id] = self._model(model_id, session_id, job_id, base_model, lora_rank, owner)
        return model

    def _model(
        self, model_id: str, session_id: str, job_id: str, base_model: str, lora_rank: int | None, owner: str
    ) -> Model:
        # the SDK numbers a model's ops from 1
        turns = Turns(gap_timeout_s=self.gap_timeout_s, window=self.window, first=1)
        return Model(model_id, session_id, job_id, base_model, lora_rank, turns, owner)

    def model(self, model_id: str, tenant: str) -> Model:
        """The tenant's model: live, or (its session finished, or the service restarted) from the store,
        where its ops fail naming its job's state and its checkpoints stay readable."""
        model = self.models.get(model_id)
        if model is None:
            row = store.get_tinker_run(self.db, run_id=model_id)
            if row is not None and row["kind"] == "model":
                model = self._model(
                    model_id, row["session_id"], row["job_id"], row["base_model"], row["lora_rank"], row["owner"]
                )
        if model is None or not self.tenancy.sees(tenant, model.owner):
            raise NotFoundError(f"model {model_id} not found; create it with create_model")
        return model

    def add_sampler(
        self, sampling_session_id: str, session_id: str, job_id: str, base_model: str, model_path: str | None
    ) -> SamplingSession:
        owner = self.sessions[session_id].owner
        store.insert_tinker_run(
            self.db, run_id=sampling_session_id, kind="sampler", session_id=session_id, job_id=job_id,
            base_model=base_model, lora_rank=None, model_path=model_path,
        )  # fmt: skip
        sampler = SamplingSession(sampling_session_id, session_id, job_id, base_model, model_path, owner)
        self.samplers[sampling_session_id] = sampler
        return sampler

    def sampler(self, sampling_session_id: str, tenant: str) -> SamplingSession:
        sampler = self.samplers.get(sampling_session_id)
        if sampler is None:
            row = store.get_tinker_run(self.db, run_id=sampling_session_id)
            if row is not None and row["kind"] == "sampler":
                sampler = SamplingSession(
                    sampling_session_id, row["session_id"], row["job_id"], row["base_model"], row["model_path"],
                    row["owner"],
                )  # fmt: skip
        if sampler is None or not self.tenancy.sees(tenant, sampler.owner):
            raise NotFoundError(
                f"sampling session {sampling_session_id} not found; create it with create_sampling_session"
            )
        return sampler

    def turn(self, model: Model, seq_id: int | None) -> Turn:
        """Op ``seq_id``'s turn, used as ``with state.turn(model, seq_id) as turn:`` (see :class:`Turn`).
        A number past the window, or one the model skipped, is refused here and stays unused."""
        if seq_id is not None and seq_id not in model.taken:
            if model.turns.beyond(seq_id):
                raise InvalidRequestError(
                    f"seq_id {seq_id} of model {model.model_id} is more than the sequence window ({self.window}) "
                    f"past the next one expected ({model.turns.next}); number a model's ops in order from 1"
                )
            if model.turns.late(seq_id):
                raise InvalidRequestError(
                    f"seq_id {seq_id} of model {model.model_id} came after the model moved on past it (an op behind "
                    f"it waited {self.gap_timeout_s:g} s for it); it did not run: call the op again"
                )
        return Turn(self, model, seq_id)

    def save_for_sampler(self, job: LiveJob, order: SamplerSave) -> str:
        """Save (when it keeps files) and sync into the model's sampler, filling ``order.answer`` in. A second
        save for one ``sampling_session_seq_id`` is the first one again: its request and answer."""
        model, session_seq = order.model, order.session_seq
        if session_seq is not None and session_seq in model.sampler_saves:
            request_id, first = model.sampler_saves[session_seq]
            order.answer.update(first)
            return request_id
        files = None
        if order.save is not None:
            files = Snapshot(order.path, enter(self.manager, job, order.save, api=TINKER))
            if order.named:
                order.answer["path"] = str(order.path)
        request_id = submit_weight_sync(self.manager, job, WeightSyncPayload(), order.sub_job_id, api=TINKER)
        model.sampler_version += 1
        model.sampler_files = files
        if session_seq is not None:  # an unnamed snapshot's folder has no path a caller may name
            sampler = self.model_sampler(model, session_seq, order.answer.get("path"))
            if order.snapshot:
                self.pin(sampler, model)
            order.answer["sampling_session_id"] = sampler.sampling_session_id
            remember(model.sampler_saves, session_seq, (request_id, dict(order.answer)))
        return request_id

    def model_sampler(self, model: Model, seq: int, model_path: str | None) -> SamplingSession:
        """A sampling session on the model's own sampler (an ``inflight`` client, until pinned)."""
        sampling_session_id = f"{model.session_id}:sample:{seq}"
        return self.add_sampler(sampling_session_id, model.session_id, model.job_id, model.base_model, model_path)

    def hold_ahead(self, model: Model, seq_id: int, size: int) -> None:
        """Count ``size`` bytes of an op that waits for an earlier seq_id against its tenant's budget; a
        429 past it, so one tenant cannot fill the service's memory with ops it never lets run."""
        held = self.held_ahead
        if not held.take(model.owner, size):
            raise TooManyRequestsError(
                f"seq_id {seq_id} of model {model.model_id} would wait for seq_id {model.turns.next}, and your ops "
                f"waiting for their turn already hold {held.held(model.owner) / 2**20:.0f} MiB (at most "
                f"{held.cap_bytes >> 20} MiB: icefloe serve --max-held-ahead-mb): send seq_id {model.turns.next} "
                "first, or retry this later"
            )

    def future(
        self,
        job_id: str,
        render: Callable[[Any], Any],
        request_id: str | None = None,
        *,
        submitted: asyncio.Future[str] | None = None,
        tag: str | None = None,
    ) -> str:
        """A future for ``request_id``, for the job start (none given), or for a request not queued yet
        (``submitted``); ``tag``: a sample call's ``SamplingParams.tag``."""
        if submitted is not None:
            future_id = f"{job_id}:op:{uuid.uuid4().hex}"  # its job first: see lost_future
            self.futures[future_id] = Future(job_id, render, submitted=submitted, tag=tag)
        else:
            future_id = request_id or f"{job_id}:start:{uuid.uuid4().hex}"
            self.futures[future_id] = Future(job_id, render, request_id, tag=tag)
        while len(self.futures) > FUTURES_KEPT:  # the oldest first: long retrieved by now
            del self.futures[next(iter(self.futures))]
        return future_id

    def sample(self, job: LiveJob, item: Sample, render: Callable[[Any], Any], *, tag: str) -> str:
        """A future for a sample call: queued now when its job runs, else as soon as it does."""
        if job.status == "running":
            return self.future(job.job_id, render, enter(self.manager, job, item, api=TINKER), tag=tag)
        loop = asyncio.get_running_loop()
        submitted: asyncio.Future[str] = loop.create_future()
        future_id = self.future(job.job_id, render, submitted=submitted, tag=tag)

        async def send() -> None:
            try:
                running = await self.live(job.job_id)
                if (future := self.futures.get(future_id)) is not None and future.cancelled:
                    raise ConflictError("cancelled by the caller before it was queued")
                submitted.set_result(enter(self.manager, running, item, api=TINKER))
            except Exception as exc:  # every poll of the future gets the refusal
                submitted.set_exception(exc)
                submitted.exception()

        task = loop.create_task(send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)
        return future_id

    async def request_of(self, future: Future, timeout_s: float) -> str | None:
        """The request a future reads, once it is queued (None if it is not after ``timeout_s``).
        Raises the refusal of a call that was not queued."""
        if future.request_id is None and future.submitted is not None:
            submitted = future.submitted
            await asyncio.wait([submitted], timeout=timeout_s)
            if submitted.done():
                future.request_id = submitted.result()
        return future.request_id

    def future_of(self, future_id: str, tenant: str) -> Future:
        """The tenant's future of that id; 404 for an unknown one or another tenant's."""
        future = self.futures.get(future_id)
        if future is None or not self.tenancy.sees(tenant, self.tenancy.owner(future.job_id)):
            raise NotFoundError(f"future {future_id} not found")
        return future

    def lost_future(self, future_id: str, tenant: str) -> dict[str, Any]:
        """The answer for a future this process never made (the service restarted since; a future's
        id begins with its job's, or is a request id of the table): a failure naming its job's state.
        404 when its job is unknown or another tenant's."""
        job_id = future_id.partition(":")[0]
        if store.get_job(self.db, job_id=job_id) is None and (row := store.get_request(self.db, request_id=future_id)):
            job_id = row["job_id"]
        if not self.tenancy.sees(tenant, self.tenancy.owner(job_id)):
            raise NotFoundError(f"future {future_id} not found")
        job = self.manager.public(job_id)
        if job["status"] in JOB_ACTIVE_STATES:  # forgotten: one of the oldest FUTURES_KEPT
            raise NotFoundError(f"future {future_id} not found (futures are kept for {FUTURES_KEPT} calls)")
        why = f"job {job_id} is {job['status']}" + (f": {job['reason']}" if job["reason"] else "")
        return {"error": f"{why}; the result of this call was not kept, so send it again", "category": "server"}

    def cancel(self, future_id: str, tenant: str) -> None:
        """Drop a future's request if it has not started (or is not queued yet); a sample that runs stops at
        its next decode step, the rest of its batch going on."""
        future = self.future_of(future_id, tenant)
        request_id, submitted = future.request_id, future.submitted
        if request_id is None and submitted is not None:
            if not submitted.done():
                future.cancelled = True
                return
            if submitted.exception() is not None:
                return  # refused: nothing was queued
            request_id = submitted.result()
        if request_id is None:  # a model being created; its session's end cancels it
            return
        self._stop_sample(future)
        with contextlib.suppress(NotFoundError):  # long finished and forgotten
            self.manager.requests.cancel(future.job_id, request_id, why="cancelled by the caller")

    def _stop_sample(self, future: Future) -> None:
        job = self.manager.live_job(future.job_id)
        running = job is not None and job.host is not None and job.host.engines is not None
        if running and not job.stopping and future.tag is not None:  # type: ignore[union-attr]
            job.engines.cancel(self.sub_job(job, "sampling"), [future.tag])

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
                with contextlib.suppress(Exception):  # a refused call: reported failed above
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
        """``finished`` or ``failed`` once a future's request ended (a call refused before it was queued: failed)."""
        if future.request_id is None:
            submitted = future.submitted
            assert submitted is not None  # a sample future
            if not submitted.done():
                return None  # its job is still starting
            if submitted.exception() is not None:
                return "failed"
            future.request_id = submitted.result()
        if self.manager.requests.is_open(future.request_id):
            return None
        row = self.manager.requests.get(future.job_id, future.request_id)
        return "finished" if row["status"] == "done" else "failed"

    # --- snapshots ----------------------------------------------------------------------------
    def pin(self, sampler: SamplingSession, model: Model) -> None:
        """Make ``sampler`` a snapshot client of the weights its model's own sampler holds now."""
        sampler.model_id, sampler.pinned, sampler.snapshot = model.model_id, model.sampler_version, model.sampler_files

    async def sampling_job(self, sampler: SamplingSession, tenant: str) -> str:
        """The job a sampler's next call runs on. A snapshot client still on its model's own sampler
        stays there while that sampler holds its weights; after a later sync it moves, once, to a
        sampler job of its own started from its files (an adapter on the shared base for LoRA)."""
        model = self.models.get(sampler.model_id) if sampler.pinned is not None and sampler.model_id else None
        if model is None or model.sampler_version == sampler.pinned:
            return sampler.job_id
        if sampler.moving is None:
            sampler.moving = asyncio.get_running_loop().create_task(self._move(sampler, model, tenant))
        try:
            await asyncio.shield(sampler.moving)
        except Exception:
            sampler.moving = None  # the next call tries again
            raise
        return sampler.job_id

    async def _move(self, sampler: SamplingSession, model: Model, tenant: str) -> None:
        snapshot = sampler.snapshot
        if snapshot is None:  # not reached: only a save with files pins a client
            raise ConflictError(f"sampling session {sampler.sampling_session_id} has no saved weights to keep")
        while True:  # its files are written by a save queued before the sync it was made on
            row = await self.manager.requests.wait(model.job_id, snapshot.save_request_id, 30.0)
            if row["status"] not in ("pending", "running"):
                break
        if row["status"] != "done":
            raise ConflictError(
                f"the weights of sampling session {sampler.sampling_session_id} were not saved "
                f"({row['status']}); save them again with save_weights_and_get_sampling_client"
            )
        base_model, rank, layers = await asyncio.to_thread(self.base_model_of, snapshot.path, tenant)
        job_id = await asyncio.to_thread(
            self.create_job, sampler.session_id, base_model, lora_rank=rank, training=False,
            name=sampler.sampling_session_id, tenant=tenant, source=snapshot.path, layers=layers,
        )  # fmt: skip
        sampler.job_id, sampler.pinned = job_id, None
        _log.info("sampling session %s keeps its snapshot on job %s", sampler.sampling_session_id, job_id)

    # --- checkpoints --------------------------------------------------------------------------
    def checkpoint_job(self, path: CheckpointPath, tenant: str) -> str:
        """The job that saved ``path``, if it is the tenant's (404 otherwise)."""
        if path.copied:  # the copy's record names its run
            candidates = [r["job_id"] for r in store.find_checkpoints(self.db, checkpoint_id=path.checkpoint_id)]
        elif (run := store.get_tinker_run(self.db, run_id=path.run)) is not None:
            candidates = [run["job_id"]] if run["kind"] == "model" else []
        else:  # saved before runs were recorded: the job is named after its run
            candidates = [
                record["job_id"]
                for record in store.find_checkpoints(self.db, checkpoint_id=path.checkpoint_id)
                if (row := store.get_job(self.db, job_id=record["job_id"])) is not None
                and row["spec"].get("experiment_name") == path.run
            ]
        for job_id in candidates:
            visible = self.tenancy.sees(tenant, self.tenancy.owner(job_id))
            if visible and store.get_checkpoint(self.db, job_id=job_id, checkpoint_id=path.checkpoint_id):
                return job_id
        raise NotFoundError(f"checkpoint {path} not found; save it with save_weights or save_weights_for_sampler")

    def checkpoint_record(self, path: CheckpointPath, tenant: str) -> dict[str, Any]:
        job_id = self.checkpoint_job(path, tenant)
        record = store.get_checkpoint(self.db, job_id=job_id, checkpoint_id=path.checkpoint_id)
        if record is None:  # deleted since
            raise NotFoundError(f"checkpoint {path} not found; save it with save_weights or save_weights_for_sampler")
        return record

    def base_model_of(self, path: CheckpointPath, tenant: str) -> tuple[str, int | None, dict[str, bool]]:
        """The base model, LoRA rank and adapted layer kinds of the run that saved ``path``."""
        row = store.get_job(self.db, job_id=self.checkpoint_job(path, tenant))
        assert row is not None
        first = row["spec"]["body"]["sub_job_configs"][0]
        section = first.get("training_config") or first.get("inference_config") or {}
        peft = section.get("peft_config") or {}
        layers = {key: peft[key] for key in ("train_attn", "train_mlp", "train_unembed") if key in peft}
        return first["model_name"], peft.get("r"), layers


def _tensor_bytes(item: Any) -> int:
    """What an item's batch holds in tensors (0 for an item without one)."""
    batch = getattr(item, "batch", None)
    if batch is None:
        return 0
    sections = (batch.get("kwargs") or {}, batch.get("context") or {})
    return sum(t.nbytes for section in sections for t in section.values() if hasattr(t, "nbytes"))
