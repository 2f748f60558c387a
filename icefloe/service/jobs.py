"""Jobs: lifecycle, placement and the execution of their requests.

A job moves ``pending → placing`` (waiting for slots) ``→ initializing`` (engines load on the job's
lifecycle thread) ``→ running``. Cancel moves it ``→ cancelling → cancelled → terminated`` once
its engines are released and its slots freed; a load failure or an engine crash moves it to
``failed`` with a reason naming the cause. Each sub-job has one FIFO :class:`RoleWorker`, so the
requests to a sub-job execute in submission order; every request is recorded in SQLite and its
long-pollers are woken the moment it finishes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icefloe.protocol import (
    JOB_TERMINAL_STATES,
    ClientClosedError,
    ConfigError,
    InvalidRequestError,
    RequestFailedError,
    UnsupportedOpError,
    WireError,
    normalize_job_state,
)
from icefloe.service import store
from icefloe.service.chunks import ChunkGroups
from icefloe.service.errors import bad_request, conflict, not_found
from icefloe.service.joblog import JobLog, JobLogRouter
from icefloe.service.models import JobCreate
from icefloe.service.placement import SlotPool
from icefloe.service.results import JsonText, ResultPages, json_text, wants_dssst1
from icefloe.service.runtime import JobEngines, make_engine_host
from icefloe.service.settings import ServeSettings
from icefloe.service.specs import SEGMENT_BY_JOB_TYPE, TYPED_CONFIG_KEYS, SubJobSpec, sub_job_specs
from icefloe.service.waiters import RequestWaiters

__all__ = ["JobManager", "LiveJob"]

_log = logging.getLogger("icefloe.service.jobs")

_FINISHED_ROWS_KEPT = 256  # rows of just-finished requests kept in memory for their pollers
# The caller's mistake: the request fails, the job stays up. Anything else is an engine crash.
_USER_ERRORS = (InvalidRequestError, ConfigError, WireError, UnsupportedOpError, ValueError, TypeError)
_IMAGE_TAG = "icefloe-local"


@dataclass
class LiveJob:
    """The in-memory side of a job this process runs: engines, workers, chunk groups, logs."""

    job_id: str
    specs: dict[str, SubJobSpec]
    log: JobLog
    chunks: ChunkGroups
    job_dir: Path
    status: str = "pending"
    host: JobEngines | None = None
    workers: dict[str, Any] = field(default_factory=dict)  # sub-job id -> RoleWorker
    slots: list[int] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    cancelled_requests: set[str] = field(default_factory=set)
    last_avg_loss: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    teardown_started: bool = False
    bring_up_done: bool = False  # set by the lifecycle thread as it leaves _bring_up, under ``lock``

    @property
    def num_slots(self) -> int:
        return sum(spec.num_slots for spec in self.specs.values())


class JobManager:
    """Creates, runs, cancels and reports jobs; submits requests to their sub-jobs' workers."""

    def __init__(self, settings: ServeSettings, db: store.Database, pool: SlotPool) -> None:
        self.settings = settings
        self.db = db
        self.pool = pool
        self.waiters = RequestWaiters()
        self.results = ResultPages(
            inline_max_bytes=settings.inline_result_max_bytes, chunk_bytes=settings.result_chunk_bytes
        )
        self.streams: dict[str, Any] = {}  # request id -> GenerateStream of a generate-stream request
        self.log_router = JobLogRouter()  # attached to the "icefloe" logger by the app
        self._live: dict[str, LiveJob] = {}
        self._lock = threading.Lock()
        # Long-polls answer from memory, never from SQLite on the event loop: the rows of unfinished
        # requests (as inserted), and of just-finished ones (result as JSON text), kept by the worker
        # thread that finished them as it writes the same values to SQLite.
        self._open: dict[str, dict[str, Any]] = {}
        self._finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._threads: list[threading.Thread] = []
        self._closing = False

    # --- lifecycle ----------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Fail jobs a previous process left active; their checkpoints stay usable."""

        def reason_for(job_id: str) -> str:
            saved = store.list_checkpoints(self.db, job_id=job_id)
            if not saved:
                return "service restarted; no checkpoint was saved"
            latest = max(saved, key=lambda c: (c["global_steps"], c["created_at"]))
            return (
                f"service restarted; resume from checkpoint {latest['checkpoint_id']} (create a job with "
                f"source_checkpoint_info={{checkpoint_id: {latest['checkpoint_id']!r}, source_job_id: {job_id!r}}})"
            )

        failed = store.fail_interrupted_jobs(self.db, reason_for=reason_for)
        for job_id in failed:
            _log.warning("job %s was active when the service stopped; marked failed", job_id)
        return failed

    def create(self, body: JobCreate, *, database: str, schema: str) -> str:
        job_id = body.job_id or str(uuid.uuid4())
        if store.get_job(self.db, job_id=job_id) is not None:
            raise conflict(f"job {job_id} already exists; omit job_id to get a fresh one")
        specs = sub_job_specs(job_id, body)
        for spec in specs:
            self._checkpoint_folder(spec)  # refuse an unknown source checkpoint now, not at load time
        if sum(s.num_slots for s in specs) > self.pool.total:
            raise bad_request(
                f"the job needs {sum(s.num_slots for s in specs)} slots (n_gpus summed over sub-jobs); this "
                f"service has {self.pool.total} {self.pool.kind} slots in all"
            )
        experiment = body.experiment_name or f"icefloe_{job_id.split('-')[0]}"
        record = {
            "body": body.model_dump(mode="json", exclude_none=True, by_alias=True),
            "database": database,
            "schema": schema,
            "experiment_name": experiment,
            "sub_jobs": [
                {
                    "sub_job_id": s.sub_job_id,
                    "job_type": s.job_type,
                    "model_name": s.config.model,
                    "config": s.public_config,
                }
                for s in specs
            ],
        }
        if not store.insert_job(self.db, job_id=job_id, status="pending", spec=record):
            raise conflict(f"job {job_id} already exists; omit job_id to get a fresh one")
        job_dir = self.settings.job_dir(job_id)
        live = LiveJob(
            job_id=job_id,
            specs={s.sub_job_id: s for s in specs},
            log=JobLog(job_dir / "logs", [s.sub_job_id for s in specs]),
            chunks=ChunkGroups(job_id),
            job_dir=job_dir,
        )
        with self._lock:
            self._live[job_id] = live
        self.log_router.bind(f"icefloe-lifecycle-{job_id}", live.log, None)
        for spec in specs:
            self.log_router.bind(f"icefloe-{spec.sub_job_id}", live.log, spec.sub_job_id)
        live.log.write(f"job created with sub-jobs {[s.sub_job_id for s in specs]}")
        for spec in specs:
            unused = sorted(set(spec.public_config) - TYPED_CONFIG_KEYS)
            if unused:
                live.log.write(
                    f"passthrough keys recorded, not used by local engines: {unused}",
                    level="WARNING",
                    sub_job_id=spec.sub_job_id,
                )
        self._start_thread(f"lifecycle-{job_id}", self._bring_up, live)
        return job_id

    def _start_thread(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"icefloe-{name}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _set_status(self, job: LiveJob, status: str, reason: str | None = None) -> None:
        job.status = status
        store.update_job(self.db, job_id=job.job_id, status=status, reason=reason)
        job.log.write(
            f"job is {status}" + (f": {reason}" if reason else ""), level="ERROR" if status == "failed" else "INFO"
        )

    def _checkpoint_folder(self, spec: SubJobSpec) -> Path | None:
        info = spec.source_checkpoint
        if info is None:
            return None
        checkpoint_id, source_job = info["checkpoint_id"], info.get("source_job_id")
        where = f"source_checkpoint_info of {spec.sub_job_id}"
        if source_job is None:
            matches = store.find_checkpoints(self.db, checkpoint_id=checkpoint_id)
            if len(matches) > 1:
                raise bad_request(f"{where}: {checkpoint_id!r} exists in several jobs; set source_job_id")
            record = matches[0] if matches else None
        else:
            record = store.get_checkpoint(self.db, job_id=source_job, checkpoint_id=checkpoint_id)
        if record is None:
            raise not_found(
                f"{where}: checkpoint {checkpoint_id!r} not found" + (f" in job {source_job}" if source_job else "")
            )
        return Path(record["path"])

    def _advance(self, job: LiveJob, status: str) -> bool:
        """Move a starting job on to ``status`` unless a cancel came first (then False)."""
        with job.lock:
            if job.stopping.is_set():
                return False
            self._set_status(job, status)
            return True

    def _bring_up(self, job: LiveJob) -> None:
        """Lifecycle thread: wait for slots, load the engines, start the workers."""
        from icefloe.engines.host import RoleWorker

        try:
            if not self._advance(job, "placing"):
                self._teardown(job, "cancelled")
                return
            slots = self.pool.acquire(job.num_slots, cancelled=job.stopping)
            if slots is None:
                self._teardown(job, "cancelled")
                return
            job.slots = slots
            devices, cursor = {}, 0
            for sub_job_id, spec in job.specs.items():
                devices[sub_job_id] = self.pool.device(slots[cursor])
                cursor += spec.num_slots
            if not self._advance(job, "initializing"):
                self._teardown(job, "cancelled")
                return
            checkpoints = {sid: p for sid, s in job.specs.items() if (p := self._checkpoint_folder(s)) is not None}
            job.host = make_engine_host(self.settings.engines, list(job.specs.values()), devices, checkpoints)
            job.host.start(lambda message: job.log.write(message))
            # No linger for company: a remote client already merges its concurrent generates, and
            # requests that arrive while a sampler is busy batch up behind it anyway.
            job.workers = {sid: RoleWorker(sid, linger_s=0.0) for sid in job.specs}
            if not self._advance(job, "running"):
                self._teardown(job, "cancelled")
        except Exception as exc:  # any load failure fails the job, with its cause as the reason
            _log.warning("job %s failed to start: %s", job.job_id, exc)
            self._teardown(job, "failed", reason=f"initializing failed: {type(exc).__name__}: {exc}")
        finally:
            with job.lock:
                job.bring_up_done = True
                orphaned = job.stopping.is_set() and not job.teardown_started
            if orphaned:  # a shutdown came after the last `stopping` check above: release the engines now
                self._teardown(job, "cancelled")

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Idempotent while cancelling/cancelled; 409 once the job terminated or failed."""
        row = self._row(job_id)
        status = row["status"]
        if status in ("cancelling", "cancelled"):
            return {"job_id": job_id, "status": status}
        if status in JOB_TERMINAL_STATES:
            raise conflict(f"job {job_id} is {status}; only an active job can be cancelled")
        job = self._live.get(job_id)
        if job is None:
            raise conflict(f"job {job_id} is {status} but not run by this service process")
        with job.lock:
            if job.stopping.is_set():
                return {"job_id": job_id, "status": job.status}
            job.stopping.set()
            self._set_status(job, "cancelling")
            running = job.workers and job.host is not None
        if running:  # otherwise the lifecycle thread sees the flag and tears down
            self._start_thread(f"teardown-{job_id}", self._teardown, job, "cancelled")
        return {"job_id": job_id, "status": "cancelling"}

    def _fail(self, job: LiveJob, reason: str) -> None:
        job.stopping.set()
        self._start_thread(f"teardown-{job.job_id}", self._teardown, job, "failed", reason)

    def _teardown(self, job: LiveJob, final: str, reason: str | None = None) -> None:
        """Stop workers, release engines and slots; ``final`` is ``cancelled`` or ``failed``."""
        with job.lock:
            if job.teardown_started:
                return
            job.teardown_started = True
        job.stopping.set()
        interrupt = getattr(job.host, "interrupt", None)
        if interrupt is not None:
            interrupt()  # an engine process: no thread may stay blocked on its pipes
        for worker in job.workers.values():
            worker.close()  # queued requests see `stopping` and are marked cancelled
        if job.host is not None:
            try:
                job.host.close()
            except Exception as exc:  # a failing close must not keep the slots
                _log.warning("job %s: closing engines failed: %s", job.job_id, exc)
        if job.slots:
            self.pool.release(job.slots)
            job.slots = []
        self.log_router.unbind(job.log)
        if self._closing and final == "cancelled" and job.status != "cancelling":
            return  # service shutdown, not a cancel: recover() fails the job at the next start
        if final == "failed":
            self._set_status(job, "failed", reason or "failed")
        else:
            self._set_status(job, "cancelled")
            self._set_status(job, "terminated")

    def close(self, *, join_timeout_s: float = 30.0) -> None:
        """Release every job's engines (service shutdown); records stay as they are.

        Every release goes through :meth:`_teardown`, which runs once per job. A job still starting
        is left to its lifecycle thread: closing its host while ``host.start`` runs would race the
        start, so the thread sees ``stopping`` when the start returns and tears down itself. Then the
        lifecycle and teardown threads are joined, so none writes to the store after it closes.
        """
        self._closing = True
        with self._lock:
            jobs = list(self._live.values())
        for job in jobs:
            with job.lock:
                job.stopping.set()
                started = job.bring_up_done  # else _bring_up still owns the job and tears it down itself
            if started:
                self._teardown(job, "cancelled")
        deadline = time.monotonic() + join_timeout_s
        while True:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive() and t is not threading.current_thread()]
            if not alive or time.monotonic() >= deadline:
                break
            alive[0].join(timeout=max(0.0, deadline - time.monotonic()))
        for thread in alive:
            _log.warning("%s still running at shutdown; its late writes to the store are dropped", thread.name)

    # --- reading ------------------------------------------------------------------------------
    def _row(self, job_id: str) -> dict[str, Any]:
        row = store.get_job(self.db, job_id=job_id)
        if row is None:
            raise not_found(f"job {job_id} not found")
        return row

    def public(self, job_id: str) -> dict[str, Any]:
        return self._public(self._row(job_id))

    def list_public(self, status: str | None) -> list[dict[str, Any]]:
        wanted = normalize_job_state(status) if status else None
        return [self._public(r) for r in store.list_jobs(self.db, status=wanted)]

    def _public(self, row: dict[str, Any]) -> dict[str, Any]:
        spec = row["spec"]
        status = row["status"]
        sub_jobs = []
        for sub in spec["sub_jobs"]:
            key = "training_config" if sub["job_type"] == "training" else "inference_config"
            sub_jobs.append(
                {
                    "sub_job_id": sub["sub_job_id"],
                    "job_type": sub["job_type"],
                    "status": status,
                    "model_name": sub["model_name"],
                    key: sub["config"],
                }
            )
        placed = status not in ("pending", "placing")
        return {
            "job_id": row["job_id"],
            "status": status,
            "reason": row["reason"],
            "created_at": row["created_at"],
            "updated_at": row["updated_at"],
            "image_tag": _IMAGE_TAG if placed else "",
            "experiment_name": spec["experiment_name"],
            "sub_jobs": sub_jobs,
        }

    def experiment_run(self, job_id: str) -> dict[str, str]:
        spec = self._row(job_id)["spec"]
        name = ".".join([spec["database"], spec["schema"], spec["experiment_name"]]).upper()
        return {"experiment_name": name, "experiment_run_name": job_id}

    def capacity(self) -> dict[str, Any]:
        in_use = self.pool.in_use
        gpus = self.pool.total if self.pool.kind == "gpu" else 0
        gpus_in_use = in_use if self.pool.kind == "gpu" else 0
        return {
            "has_reservation": False,
            "max_total_gpus": gpus,
            "reserved_gpus": 0,
            "in_use_gpus": gpus_in_use,
            "available_gpus": max(0, gpus - gpus_in_use),
            "slot_kind": self.pool.kind,
            "max_total_slots": self.pool.total,
            "in_use_slots": in_use,
            "available_slots": max(0, self.pool.total - in_use),
        }

    def live(self, job_id: str, *, allowed: tuple[str, ...] = ("running",)) -> LiveJob:
        """The running job behind ``job_id``: 404 if unknown, 409 naming the state otherwise."""
        job = self._live.get(job_id)  # jobs of this process: no SQLite read on the hot path
        status = job.status if job is not None else self._row(job_id)["status"]
        if job is None or status not in allowed:
            raise conflict(f"job {job_id} is {status}; this call needs it {' or '.join(allowed)}")
        return job

    def resolve_sub_job(
        self, job: LiveJob, *, sub_job_id: str | None, sub_job_type: str | None, default_type: str | None
    ) -> str:
        """The sub-job a call addresses, from its routing hints (both given = they must agree)."""
        if sub_job_id is not None:
            if sub_job_id not in job.specs:
                raise bad_request(
                    f"sub_job_id {sub_job_id!r} is not part of job {job.job_id}; its sub-jobs are {sorted(job.specs)}"
                )
            if sub_job_type is not None and _job_type(sub_job_type) != job.specs[sub_job_id].job_type:
                raise bad_request(
                    f"sub_job_id {sub_job_id!r} is a {job.specs[sub_job_id].job_type} sub-job, "
                    f"but sub_job_type says {sub_job_type!r}"
                )
            return sub_job_id
        wanted = _job_type(sub_job_type) if sub_job_type is not None else default_type
        if wanted is None:
            return next(iter(job.specs))
        matches = [sid for sid, spec in job.specs.items() if spec.job_type == wanted]
        if not matches:
            raise bad_request(f"job {job.job_id} has no {wanted} sub-job; its sub-jobs are {sorted(job.specs)}")
        if len(matches) > 1 and sub_job_type is not None:
            raise bad_request(f"sub_job_type {sub_job_type!r} matches {matches}; pass sub_job_id to pick one")
        return matches[0]

    # --- requests -----------------------------------------------------------------------------
    def submit(
        self,
        job: LiveJob,
        sub_job_id: str,
        op: str,
        fn: Callable[[], Any],
        *,
        op_metadata: dict[str, Any] | None = None,
    ) -> str:
        """Record a request and queue ``fn`` on the sub-job's worker; returns the request id."""
        request_id = self.record_request(job, sub_job_id, op, op_metadata or {})
        with self._refused_if_stopped(job, request_id):
            job.workers[sub_job_id].submit(self._execute, job, request_id, op, fn, op_metadata or {})
        return request_id

    def submit_batchable(
        self,
        job: LiveJob,
        sub_job_id: str,
        op: str,
        item: Any,
        run_batch: Callable[[list[Any]], list[Any]],
        *,
        op_metadata: dict[str, Any] | None = None,
    ) -> str:
        """Like :meth:`submit`, but consecutive items of ``op`` on this worker run as one batch."""
        request_id = self.record_request(job, sub_job_id, op, op_metadata or {})
        entry = (request_id, item, op_metadata or {})
        with self._refused_if_stopped(job, request_id):
            job.workers[sub_job_id].submit_batchable(
                op, entry, lambda entries: self._execute_batch(job, op, entries, run_batch)
            )
        return request_id

    @contextlib.contextmanager
    def _refused_if_stopped(self, job: LiveJob, request_id: str) -> Iterator[None]:
        """A cancel that closed the workers after the state check answers 409, not 500."""
        try:
            yield
        except ClientClosedError:
            self.finish_request(request_id, status="cancelled", error=f"job {job.job_id} is {job.status}")
            raise conflict(f"job {job.job_id} is {job.status}; this call needs it running") from None

    def record_request(self, job: LiveJob, sub_job_id: str, op: str, op_metadata: dict[str, Any]) -> str:
        request_id = f"{sub_job_id}:{op}:{uuid.uuid4().hex}"
        created_at = store.insert_request(
            self.db, request_id=request_id, job_id=job.job_id, sub_job_id=sub_job_id, op=op, op_metadata=op_metadata
        )
        row = {
            "request_id": request_id,
            "job_id": job.job_id,
            "sub_job_id": sub_job_id,
            "op": op,
            "status": "pending",
            "created_at": created_at,
            "updated_at": created_at,
            "error": "",
            "result": None,
            "result_path": None,
            "op_metadata": op_metadata,
        }
        with self._lock:
            self._open[request_id] = row
        return request_id

    def _skip(self, job: LiveJob, request_id: str) -> bool:
        if _abandoned(job, request_id):
            why = (
                "cancelled by cancel-request"
                if request_id in job.cancelled_requests
                else f"job {job.job_id} stopped ({job.status}) before this request ran"
            )
            self.finish_request(request_id, status="cancelled", error=why)
            return True
        return False

    def _execute(self, job: LiveJob, request_id: str, op: str, fn: Callable[[], Any], op_metadata: dict) -> None:
        if self._skip(job, request_id):
            return
        self.mark_started(request_id)
        try:
            result = fn()
        except Exception as exc:  # every failure is recorded on the request
            self._record_failure(job, [request_id], op, exc)
        else:
            self._record_result(job, request_id, result, op_metadata)

    def _execute_batch(
        self, job: LiveJob, op: str, entries: list[tuple[str, Any, dict]], run_batch: Callable[[list[Any]], list]
    ) -> list[None]:
        live = [e for e in entries if not self._skip(job, e[0])]
        if live:
            for request_id, _, _ in live:
                self.mark_started(request_id)
            try:
                results = run_batch([item for _, item, _ in live])
            except Exception as exc:  # the whole batch failed together
                self._record_failure(job, [e[0] for e in live], op, exc)
            else:
                for (request_id, _, op_metadata), result in zip(live, results, strict=True):
                    self._record_result(job, request_id, result, op_metadata)
        return [None] * len(entries)

    def _start_unless_abandoned(self, job: LiveJob, request_id: str) -> bool:
        """Mark a request running unless it was cancelled; atomic with :meth:`cancel_request`."""
        with self._lock:
            if _abandoned(job, request_id):
                return False
            opened = self._open.get(request_id)
            if opened is not None and opened["status"] != "running":
                opened["status"], opened["updated_at"] = "running", store.now_iso()
            return True

    def mark_started(self, request_id: str, status: str = "running") -> None:
        """In memory only: pollers read open requests from memory, and a restart fails them either way.

        A request sent ahead is marked then and again when its turn comes; it keeps the first time.
        """
        now = store.now_iso()
        with self._lock:
            opened = self._open.get(request_id)
            if opened is not None and opened["status"] != status:
                opened["status"], opened["updated_at"] = status, now

    def _record_result(self, job: LiveJob, request_id: str, result: Any, op_metadata: dict[str, Any]) -> None:
        try:
            if wants_dssst1(op_metadata):
                text = None
                result = json.loads(result) if isinstance(result, JsonText) else result
            else:
                text = json_text(result)
            if text is None:
                path = ResultPages.write_frame(result, job.job_dir / "results" / f"{uuid.uuid4().hex}.dssst1")
                self.finish_request(request_id, status="done", result_path=path)
            else:
                self.finish_request(request_id, status="done", result_json=text)
        except Exception as exc:  # an unencodable result fails the request, not the job
            self.finish_request(request_id, status="failed", error=f"the result could not be stored: {exc}")

    def _record_failure(self, job: LiveJob, request_ids: list[str], op: str, exc: Exception) -> None:
        if job.stopping.is_set() and isinstance(exc, ClientClosedError):  # cut short by the job stopping
            for request_id in request_ids:
                self.finish_request(request_id, status="cancelled", error=f"job {job.job_id} stopped: {exc}")
            return
        message = f"{type(exc).__name__}: {exc}"
        for request_id in request_ids:
            self.finish_request(request_id, status="failed", error=message)
        sub_job_id = request_ids[0].rsplit(":", 2)[0] if request_ids else None
        if isinstance(exc, _USER_ERRORS) or (isinstance(exc, RequestFailedError) and exc.category == "user"):
            job.log.write(f"{op} failed: {message}", level="WARNING", sub_job_id=sub_job_id)
            return
        job.log.write(f"{op} crashed the engine: {message}", level="ERROR", sub_job_id=sub_job_id)
        self._fail(job, f"{sub_job_id} crashed during {op}: {message}")

    def finish_request(
        self,
        request_id: str,
        *,
        status: str,
        error: str = "",
        result_json: str | None = None,
        result_path: str | None = None,
    ) -> None:
        updated_at = store.update_request(
            self.db, request_id=request_id, status=status, error=error, result_json=result_json, result_path=result_path
        )
        finished = {"status": status, "updated_at": updated_at, "error": error, "result": result_json}
        with self._lock:
            opened = self._open.pop(request_id, None)
            if opened is not None:
                self._finished[request_id] = {**opened, **finished, "result_path": result_path}
                while len(self._finished) > _FINISHED_ROWS_KEPT:
                    self._finished.popitem(last=False)
        self.waiters.notify(request_id)

    def _is_open(self, job_id: str, request_id: str) -> bool:
        with self._lock:
            opened = self._open.get(request_id)
        return opened is not None and opened["job_id"] == job_id

    def _memory_row(self, job_id: str, request_id: str) -> dict[str, Any] | None:
        """The row of an open or just-finished request (result as JSON text), without touching SQLite."""
        with self._lock:
            row = self._open.get(request_id) or self._finished.get(request_id)
            return dict(row) if row is not None and row["job_id"] == job_id else None

    def cancel_request(self, job: LiveJob, request_id: str) -> dict[str, Any]:
        """Cancel a request that has not started; one that runs or ran is left as it is."""
        with self._lock:  # atomic with _start_unless_abandoned: an op handed to its engine is not cancelled
            opened = self._open.get(request_id)
            status = opened["status"] if opened is not None and opened["job_id"] == job.job_id else None
            if status == "pending":
                job.cancelled_requests.add(request_id)
        if status is None:
            row = self._memory_row(job.job_id, request_id) or store.get_request(self.db, request_id=request_id)
            if row is None or row["job_id"] != job.job_id:
                raise not_found(f"request {request_id} not found in job {job.job_id}")
            status = row["status"]
        return {
            "request_id": request_id,
            "cancelled": status == "pending",
            "status": "cancelled" if status == "pending" else status,
        }

    def request_row(self, job_id: str, request_id: str, *, raw_result: bool = False) -> dict[str, Any]:
        if job_id not in self._live:
            self._row(job_id)  # 404 for an unknown job
        row = self._memory_row(job_id, request_id)
        if row is not None and not raw_result and row["result"] is not None:
            row["result"] = json.loads(row["result"])
        if row is None:
            row = store.get_request(self.db, request_id=request_id, raw_result=raw_result)
        if row is None or row["job_id"] != job_id:
            raise not_found(f"request {request_id} not found in job {job_id}")
        return row

    async def wait_for_request(
        self, job_id: str, request_id: str, timeout_s: float, *, raw_result: bool = False
    ) -> dict[str, Any]:
        """The request row, after waiting up to ``timeout_s`` for it to finish (long-poll).

        ``raw_result`` keeps a JSON result as text, so an answer can carry it without re-encoding.
        """
        if job_id not in self._live:
            self._row(job_id)  # 404 for an unknown job
        if timeout_s > 0 and self._is_open(job_id, request_id):
            await self.waiters.wait(
                request_id,
                timeout_s=min(timeout_s, self.settings.max_long_poll_s),
                finished=lambda: not self._is_open(job_id, request_id),
            )
        row = self._memory_row(job_id, request_id) if raw_result else None
        return row if row is not None else self.request_row(job_id, request_id, raw_result=raw_result)

    def tail_logs(
        self, job_id: str, *, sub_job_id: str | None, sub_job_type: str | None, cursor: str | None, max_lines: int
    ) -> dict[str, Any]:
        """A page of a sub-job's log; works in every state, also for jobs of an earlier process."""
        row = self._row(job_id)
        subs = {s["sub_job_id"]: s["job_type"] for s in row["spec"]["sub_jobs"]}
        if sub_job_id is not None:
            if sub_job_id not in subs:
                raise bad_request(
                    f"sub_job_id {sub_job_id!r} is not part of job {job_id}; its sub-jobs are {sorted(subs)}"
                )
            target = sub_job_id
        elif sub_job_type is not None:
            matches = [sid for sid, kind in subs.items() if kind == _job_type(sub_job_type)]
            if len(matches) != 1:
                raise bad_request(f"sub_job_type {sub_job_type!r} matches {matches}; pass sub_job_id to pick one")
            target = matches[0]
        else:
            target = next(iter(subs))
        job = self._live.get(job_id)
        log = job.log if job is not None else JobLog(self.settings.job_dir(job_id) / "logs", list(subs))
        return log.tail(target, cursor=cursor, max_lines=max_lines, finished=row["status"] in JOB_TERMINAL_STATES)


def _abandoned(job: LiveJob, request_id: str) -> bool:
    """The request must not run: cancelled by cancel-request, or its job is stopping."""
    return request_id in job.cancelled_requests or job.stopping.is_set()


def _job_type(sub_job_type: str) -> str:
    text = sub_job_type.strip().lower().removeprefix("job_type_")
    by_segment = {segment: job_type for job_type, segment in SEGMENT_BY_JOB_TYPE.items()}
    if text in SEGMENT_BY_JOB_TYPE:
        return text
    if text in by_segment:
        return by_segment[text]
    raise bad_request(f"sub_job_type must be one of {sorted(SEGMENT_BY_JOB_TYPE)}; got {sub_job_type!r}")
