"""Jobs: the coordinator of their lifecycle, hosts, lanes and requests.

A job is placed on a model host (:mod:`icefloe.service.hosts.pool`) when it is created; then one thread
of its own walks it through :mod:`icefloe.service.lifecycle`: it opens the host, builds the job's
engines there and takes them down. Each sub-job has one lane on its host's workers, so the requests to a sub-job run in
submission order. An engine crash asks the job (or, when the host's engines died, every job on
the host) to stop as failed.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from icefloe.engines.host import Lane
from icefloe.protocol import (
    JOB_STATES,
    OP_FWD_BWD,
    SEGMENT_BY_JOB_TYPE,
    ClientClosedError,
    ConfigError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    RequestFailedError,
    UnsupportedOpError,
    WireError,
    normalize_job_state,
    normalize_job_type,
)
from icefloe.service import store
from icefloe.service.chunks import ChunkGroups
from icefloe.service.hosts.pool import HostFailed, HostKey, HostPool, ModelHost, fail_resumable, shared_base_key
from icefloe.service.hosts.process import EngineProcessDied
from icefloe.service.hosts.seam import JobEngines, Progress
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.joblog import JobLog, JobLogRouter
from icefloe.service.lifecycle import JobState
from icefloe.service.metrics import ServiceMetrics
from icefloe.service.requests import RequestTable
from icefloe.service.results import HeldResults, ResultPages, json_text, wants_dssst1
from icefloe.service.schemas import JobCreate
from icefloe.service.settings import SHARED_TENANT, ServeSettings
from icefloe.service.specs import SubJobSpec, body_warnings, sub_job_specs
from icefloe.service.streams import GenerateStream, OpenStreams, StreamBudget
from icefloe.service.work.items import HELD, FwdBwd, Item, Sample

__all__ = ["Entry", "JobManager", "LiveJob", "job_type_named"]

_log = logging.getLogger("icefloe.service.jobs")

# The caller's mistake: the request fails, the job stays up. Anything else is an engine crash.
_USER_ERRORS = (InvalidRequestError, ConfigError, WireError, UnsupportedOpError, ConflictError, ValueError, TypeError)
_IMAGE_TAG = "icefloe-local"
_CLOSE_TIMEOUT_S = 30.0  # service shutdown waits this long for the jobs' threads to release their engines
# An op past its deadline that has not stopped this much later is killed with its engines (and with
# a shared host's, every job on it fails): it did not reach a pass or decode step boundary.
_DEADLINE_GRACE_S = 5.0
_HELD_RESULTS = 10_000  # results of the Tinker and OpenAI APIs kept in memory until asked for (the oldest go first)
_SWEEP_EVERY_S = 60.0  # at most this often (and within the result TTL) expired result files are deleted


@dataclass
class LiveJob:
    """The in-memory side of a job this process runs: its state, engines, lanes, chunk groups, log."""

    job_id: str
    specs: dict[str, SubJobSpec]
    state: JobState
    log: JobLog
    chunks: ChunkGroups
    job_dir: Path
    host: ModelHost | None = None
    lanes: dict[str, Lane] = field(default_factory=dict)  # sub-job id -> its lane on the host's workers
    last_avg_loss: dict[str, float] = field(default_factory=dict)
    thread: threading.Thread | None = None
    lease_until: float = math.inf  # time.monotonic() after which a job with nothing in flight is cancelled
    lease_s: float = 0.0  # how long its last renewal extended the lease
    in_flight: dict[str, tuple[str, str, float]] = field(default_factory=dict)  # request id -> (sub-job, op, start)
    base_key: HostKey | None = None  # the base it can share with other LoRA jobs (None: a host of its own)
    owner: str = SHARED_TENANT  # the tenant that created it

    @property
    def status(self) -> str:
        return self.state.status

    @property
    def stopping(self) -> bool:
        return self.state.stop.is_set()

    @property
    def num_slots(self) -> int:
        """Slots a host of its own takes: one for a base LoRA jobs share, else n_gpus summed."""
        return 1 if self.base_key is not None else sum(s.num_slots for s in self.specs.values())

    @property
    def engines(self) -> JobEngines:
        assert self.host is not None and self.host.engines is not None, "a running job has engines"
        return self.host.engines

    def restart_clock(self, sub_job_id: str, at: float | None = None) -> None:
        """Count the deadline of the op running on ``sub_job_id`` from ``at`` (default now; ``math.inf``:
        not yet), e.g. a weight-sync's from its copy, not from its wait for the targets' queued work."""
        for request_id, (where, op, _) in list(self.in_flight.items()):
            if where == sub_job_id:
                self.in_flight[request_id] = (where, op, time.monotonic() if at is None else at)


class JobManager:
    """Creates, runs, cancels and reports jobs; queues requests on their sub-jobs' workers."""

    def __init__(self, settings: ServeSettings, db: store.Database, pool: SlotPool) -> None:
        self.settings = settings
        self.db = db
        self.pool = pool
        self.hosts = HostPool(settings, pool)
        self._live: dict[str, LiveJob] = {}
        self.requests = RequestTable(db)
        self.metrics = ServiceMetrics(
            db,
            open_requests=self.requests.open_rows,
            chunk_bytes=lambda: {job_id: job.chunks.held_bytes for job_id, job in list(self._live.items())},
            hosts=lambda: [(host.describe(), list(host.members)) for host in self.hosts.hosts()],
            max_reported_values=settings.max_job_metric_values,
        )
        self.requests.on_finish = self.metrics.request_finished
        self.results = ResultPages(
            inline_max_bytes=settings.inline_result_max_bytes,
            chunk_bytes=settings.result_chunk_bytes,
            ttl_s=settings.result_ttl_s,
        )
        self.streams = OpenStreams(StreamBudget(settings.max_stream_events_mb << 20))
        self.held = HeldResults(max_results=_HELD_RESULTS)  # the Tinker and OpenAI APIs' results
        self.log_router = JobLogRouter()  # attached to the "icefloe" logger by the app
        self._closing = threading.Event()

    # --- lifecycle ----------------------------------------------------------------------------
    def create(self, body: JobCreate, *, database: str, schema: str, owner: str = SHARED_TENANT) -> str:
        job_id = body.job_id or str(uuid.uuid4())
        taken = ConflictError(f"job {job_id} already exists; omit job_id to get a fresh one")
        if store.get_job(self.db, job_id=job_id) is not None:
            raise taken
        specs = sub_job_specs(job_id, body, model_root=self.settings.model_root)
        for spec in specs:
            self._checkpoint_folder(spec)  # refuse an unknown source checkpoint now, not at load time
        base_key = shared_base_key(specs)
        num_slots = 1 if base_key is not None else sum(s.num_slots for s in specs)
        if num_slots > self.pool.total:
            raise InvalidRequestError(
                f"the job needs {num_slots} slots (n_gpus summed over sub-jobs); this "
                f"service has {self.pool.total} {self.pool.kind} slots in all"
            )
        record = {
            "body": body.model_dump(mode="json", exclude_none=True, by_alias=True),
            "database": database,
            "schema": schema,
            "experiment_name": body.experiment_name or f"icefloe_{job_id.split('-')[0]}",
            "sub_jobs": [
                dict(sub_job_id=s.sub_job_id, job_type=s.job_type, model_name=s.model_name, config=s.public_config)
                for s in specs
            ],
            "warnings": body_warnings(body) + [warning for s in specs for warning in s.warnings],
            "num_slots": 0 if base_key is not None else num_slots,  # a dedicated host's, charged to its tenant
        }
        if not store.insert_job(self.db, job_id=job_id, status="pending", spec=record, owner=owner):
            raise taken
        job_dir = self.settings.job_dir(job_id)
        log = JobLog(job_dir / "logs", [s.sub_job_id for s in specs], shown=self.settings.public_text)
        chunks = ChunkGroups(
            max_bytes=self.settings.max_tenant_chunk_bytes,
            held_elsewhere=functools.partial(self._chunk_bytes_held, owner, but=job_id),
        )
        state = JobState(job_id, self.db, log)
        specs_by_id = {s.sub_job_id: s for s in specs}
        job = LiveJob(job_id, specs_by_id, state, log, chunks, job_dir, base_key=base_key, owner=owner)
        job.host = self.hosts.place(job)  # now, not on its thread: a tenant's next admission counts the host
        self._live[job_id] = job
        self.renew(job_id)
        log.write(f"job created with sub-jobs {[s.sub_job_id for s in specs]}")
        self.log_router.bind(f"icefloe-lifecycle-{job_id}", log, None)  # loading its engines; ops: execute
        for spec in specs:
            for warning in spec.warnings:
                log.write(warning, level="WARNING", sub_job_id=spec.sub_job_id)
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"icefloe-lifecycle-{job_id}", daemon=True)
        job.thread.start()
        return job_id

    def _checkpoint_folder(self, spec: SubJobSpec) -> Path | None:
        info = spec.source_checkpoint
        if info is None:
            return None
        checkpoint_id, source_job = info["checkpoint_id"], info.get("source_job_id")
        where = f"source_checkpoint_info of {spec.sub_job_id}"
        if source_job is None:
            matches = store.find_checkpoints(self.db, checkpoint_id=checkpoint_id)
            if len(matches) > 1:
                raise InvalidRequestError(f"{where}: {checkpoint_id!r} exists in several jobs; set source_job_id")
            record = matches[0] if matches else None
        else:
            record = store.get_checkpoint(self.db, job_id=source_job, checkpoint_id=checkpoint_id)
        if record is None:
            in_job = f" in job {source_job}" if source_job else ""
            raise NotFoundError(f"{where}: checkpoint {checkpoint_id!r} not found{in_job}")
        return Path(record["path"])

    def _run(self, job: LiveJob) -> None:
        """The job's thread: open its host, start, run until a stop is asked for, release, record the outcome."""
        state = job.state
        try:
            if state.advance("placing"):
                checkpoints = {sid: p for sid, s in job.specs.items() if (p := self._checkpoint_folder(s)) is not None}
                assert job.host is not None  # placed by create
                placed = functools.partial(state.advance, "initializing")
                opened = job.host.open(
                    job, pool=self.pool, settings=self.settings, placed=placed, checkpoints=checkpoints
                )
                if opened:
                    job.lanes = job.host.lanes(job)
                    state.advance("running")
            state.stop.wait()
        except Exception as exc:  # any start failure fails the job, with its cause as the reason
            if not state.stop.is_set():  # else the start gave up because the job is stopping
                _log.warning("job %s failed to start: %s", job.job_id, exc)
                state.fail(
                    str(exc) if isinstance(exc, HostFailed) else f"initializing failed: {type(exc).__name__}: {exc}"
                )
        finally:
            self._release(job)
            state.finish()
            self._live.pop(job.job_id, None)  # its engines, lanes and chunk payloads go with it

    def _release(self, job: LiveJob) -> None:
        host = job.host
        if host is not None and not host.shared and host.engines is not None:
            host.engines.interrupt()  # no lane may stay blocked on a dedicated engine process's pipes
        for lane in job.lanes.values():
            lane.close()  # queued requests see the stop and are marked cancelled
        if host is not None:
            self.hosts.release(host, job)
        self.log_router.unbind(job.log)
        self.streams.close_job(job.job_id)  # events no one drained (the requests are over)

    def last_checkpoint(self, job_id: str) -> str | None:
        """The newest checkpoint a job saved (its id), for a failure reason to name."""
        records = store.list_checkpoints(self.db, job_id=job_id)
        return records[-1]["checkpoint_id"] if records else None

    def renew(self, job_id: str, ttl_s: float | None = None) -> None:
        """Extend the job's lease (every call on the job does; a client with nothing to send heartbeats)
        by ``ttl_s``, default the service's ``lease_ttl_s`` (0: no lease)."""
        job = self._live.get(job_id)
        ttl_s = self.settings.lease_ttl_s if ttl_s is None else ttl_s
        if job is not None and ttl_s:
            job.lease_until, job.lease_s = time.monotonic() + ttl_s, ttl_s

    def heartbeat(self, job_id: str) -> dict[str, Any]:
        self.renew(job_id)
        status = self.public(job_id)["status"]
        return {"job_id": job_id, "status": status, "lease_ttl_s": self.settings.lease_ttl_s}

    def watch(self) -> None:
        """Start the thread that kills the engines of an op that did not stop at its deadline (failing
        its job, or every job of a shared host), fails the jobs of a host whose engines died, cancels a
        job whose lease lapsed with nothing pending or running, and deletes expired result files."""
        settings = self.settings
        shortest = min(
            settings.lease_ttl_s or 10,
            settings.loaded_model_idle_s,
            settings.op_deadline_s,
            settings.result_ttl_s,
            *settings.op_deadlines_s.values(),
        )
        threading.Thread(target=self._watch, args=(min(1.0, max(0.02, shortest / 10)),), daemon=True).start()

    def _watch(self, tick: float) -> None:
        deadline_s, next_sweep = self.settings.deadline_s, 0.0
        while not self._closing.wait(tick):
            now = time.monotonic()
            if now >= next_sweep:  # at startup too: files a stopped service left behind
                next_sweep = now + min(_SWEEP_EVERY_S, self.settings.result_ttl_s)
                self.results.delete_expired(self.settings.data_dir / "jobs")
            for host in self.hosts.hosts():  # an op in flight reports a crash itself, naming the op
                idle = not any(member.in_flight for member in list(host.members.values()))
                why = host.engines.died() if idle and host.dead is None and host.engines is not None else None
                if why is not None:
                    host.fail(f"{why} ({host.host_id})", self.last_checkpoint)
            for job in [job for job in self._live.values() if not job.stopping]:
                # A resumable op stops itself at its first slice boundary past the deadline; one still
                # running a grace later is stuck in one pass (or is one long engine call): kill it.
                late = [
                    (where, op)
                    for where, op, at in list(job.in_flight.values())
                    if now - at > deadline_s(op) + _DEADLINE_GRACE_S
                ]
                host = job.host
                engines = host.engines if host is not None else None
                killable = engines.killable if engines is not None else None  # None: engines in this process
                if late and killable and host is not None and engines is not None:
                    where, op = late[0]
                    reason = (
                        f"{op} on {where} did not finish within its deadline of {deadline_s(op):g} s; killed {killable}"
                    )
                    if host.shared:  # every job on the host loses its engines; no reason names another's job
                        reason = f"{op} on {host.host_id} did not finish within its deadline of {deadline_s(op):g} s"
                        host.fail(f"{reason}; killed {killable}, shared by every job on it", self.last_checkpoint)
                    else:
                        fail_resumable(job, reason, self.last_checkpoint)
                    engines.kill()
                elif now > job.lease_until and not job.in_flight and not self.requests.has_open(job.job_id):
                    job.log.write(f"no call or heartbeat for {job.lease_s:g} s", level="WARNING")
                    job.state.cancel("client lease expired")

    def cancel(self, job_id: str, reason: str = "cancelled on request") -> dict[str, Any]:
        """Idempotent while cancelling/cancelled; 409 once the job terminated or failed."""
        job = self._live.get(job_id)
        if job is not None:
            return {"job_id": job_id, "status": job.state.cancel(reason)}
        status = self.row(job_id)["status"]
        if status not in ("cancelling", "cancelled"):
            raise ConflictError(f"job {job_id} is {status}; only an active job can be cancelled")
        return {"job_id": job_id, "status": status}

    def close(self) -> None:
        """Release every job's engines (service shutdown); records stay as they are. Each job's own
        thread releases them and is joined, so none writes to the store after it closes."""
        self._closing.set()
        jobs = list(self._live.values())
        for job in jobs:
            job.state.shut_down()
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for job in jobs:
            assert job.thread is not None
            job.thread.join(max(0.0, deadline - time.monotonic()))
            if job.thread.is_alive():
                _log.warning("%s still running at shutdown; its late writes to the store are dropped", job.thread.name)

    # --- reading ------------------------------------------------------------------------------
    def row(self, job_id: str) -> dict[str, Any]:
        """The job's stored record, 404 if unknown (a read: no lease renewal)."""
        row = store.get_job(self.db, job_id=job_id)
        if row is None:
            raise NotFoundError(f"job {job_id} not found")
        return row

    def public(self, job_id: str) -> dict[str, Any]:
        """The job as the API shows it; a read, so it renews no lease (a watcher must not keep a job alive)."""
        job = self._live.get(job_id)
        lease_left_s = job.lease_until - time.monotonic() if job is not None else math.inf
        answer = self._public(self.row(job_id))
        if job is not None:  # icefloe extensions: what `icefloe jobs show` prints
            answer["queue"] = self.requests.queue(job_id)
            answer["host"] = self.host_of(job)
            answer["lease_expires_in_s"] = round(max(0.0, lease_left_s), 1) if math.isfinite(lease_left_s) else None
        return answer

    def waiting(self, job_id: str) -> str | None:
        """Why the job waits in placing, while it does (every client shows it); else None. It counts
        the free slots (as ``/capacity`` does), never other tenants' jobs."""
        job = self._live.get(job_id)
        if job is None or job.status != "placing":
            return None
        host = job.host
        if host is not None and host.slots:  # another job of its base took the host's slot and starts it
            return f"waiting for its model host {host.host_id} to start"
        ahead, free = self.pool.waiting(job)
        mine = sum(isinstance(other, LiveJob) and other.owner == job.owner for other in ahead)
        slots = f"{job.num_slots} {self.pool.kind} slot(s): {free} of {self.pool.total} free"
        return f"waiting for {slots}, {mine} job(s) of yours ahead"

    def reason(self, row: dict[str, Any]) -> str | None:
        """The reason of a job's stored ``row``: why it waits while it does, else why it ended (the
        service's folders named, not spelled out)."""
        reason = self.waiting(row["job_id"]) or row["reason"]
        return self.settings.public_text(reason) if reason else reason

    def _chunk_bytes_held(self, owner: str, *, but: str) -> int:
        """Request chunks the tenant's other live jobs hold (their caps are one: the tenant's)."""
        return sum(
            job.chunks.held_bytes for job in list(self._live.values()) if job.owner == owner and job.job_id != but
        )

    def list_public(self, status: str | None, *, owner: str | None = None) -> list[dict[str, Any]]:
        """Jobs in ``status`` (any: None) owned by ``owner`` (anyone: None)."""
        wanted = normalize_job_state(status) if status else None
        if wanted is not None and wanted not in JOB_STATES:
            raise InvalidRequestError(f"status must be one of {', '.join(sorted(JOB_STATES))}; got {status!r}")
        answers = [self._public(r) for r in store.list_jobs(self.db, status=wanted, owner=owner)]
        for answer in answers:
            job = self._live.get(answer["job_id"])
            if job is not None and job.host is not None:
                answer["host"] = self.host_of(job)
        return answers

    def host_of(self, job: LiveJob) -> dict[str, Any] | None:
        """The job's model host as its tenant may see it: the jobs of that tenant on it, and the base's
        folder named, not spelled out."""
        if job.host is None:
            return None
        host = job.host.describe()
        host["num_jobs"] = sum(member.owner == job.owner for member in list(job.host.members.values()))
        if host["base_model"] is not None:
            host["base_model"] = self.settings.public_text(host["base_model"])
        return host

    def _public(self, row: dict[str, Any]) -> dict[str, Any]:
        spec, status = row["spec"], row["status"]
        sub_jobs = [
            {
                **{key: sub[key] for key in ("sub_job_id", "job_type", "model_name")},
                "status": status,
                "training_config" if sub["job_type"] == "training" else "inference_config": sub["config"],
            }
            for sub in spec["sub_jobs"]
        ]
        return {
            **{key: row[key] for key in ("job_id", "status", "created_at", "updated_at")},
            "reason": self.reason(row),
            "image_tag": "" if status in ("pending", "placing") else _IMAGE_TAG,
            "experiment_name": spec["experiment_name"],
            "sub_jobs": sub_jobs,
            "warnings": spec.get("warnings", []),
        }

    def experiment_run(self, job_id: str) -> dict[str, str]:
        spec = self.row(job_id)["spec"]
        name = ".".join([spec["database"], spec["schema"], spec["experiment_name"]]).upper()
        return {"experiment_name": name, "experiment_run_name": job_id}

    def capacity(self) -> dict[str, Any]:
        in_use, total = self.pool.in_use, self.pool.total
        gpus, gpus_in_use = (total, in_use) if self.pool.kind == "gpu" else (0, 0)
        return {
            "has_reservation": False,
            "max_total_gpus": gpus,
            "reserved_gpus": 0,
            "in_use_gpus": gpus_in_use,
            "available_gpus": max(0, gpus - gpus_in_use),
            "slot_kind": self.pool.kind,
            "max_total_slots": total,
            "in_use_slots": in_use,
            "available_slots": max(0, total - in_use),
        }

    def live_job(self, job_id: str) -> LiveJob | None:
        """The job's in-memory side while this process runs it, else None (a read: no lease renewal)."""
        return self._live.get(job_id)

    def live(self, job_id: str) -> LiveJob:
        """The running job behind ``job_id``: 404 if unknown, 409 naming the state and its reason otherwise."""
        job = self._live.get(job_id)  # jobs of this process: no SQLite read on the hot path
        self.renew(job_id)
        if job is None or job.status != "running":
            row = self.row(job_id)
            reason = (job.state.stop_reason if job is not None else None) or self.reason(row)  # the row may lag
            why = f" ({reason})" if reason else ""
            status = job.status if job is not None else row["status"]
            raise ConflictError(f"job {job_id} is {status}{why}; this call needs it running")
        return job

    def resolve_sub_job(
        self, job: LiveJob, *, sub_job_id: str | None, sub_job_type: str | None, default_type: str | None
    ) -> str:
        """The sub-job a call addresses, from its routing hints (both given = they must agree)."""
        kinds = {sid: spec.job_type for sid, spec in job.specs.items()}
        return _pick_sub_job(job.job_id, kinds, sub_job_id, sub_job_type, default_type)

    def tail_logs(
        self, job_id: str, *, sub_job_id: str | None, sub_job_type: str | None, cursor: str | None, max_lines: int
    ) -> dict[str, Any]:
        """A page of a sub-job's log; works in every state, also for jobs of an earlier process."""
        row = self.row(job_id)
        kinds = {s["sub_job_id"]: s["job_type"] for s in row["spec"]["sub_jobs"]}
        target = _pick_sub_job(job_id, kinds, sub_job_id, sub_job_type, None)
        return self.job_log(job_id).tail(target, cursor=cursor, max_lines=max_lines)

    def job_log(self, job_id: str) -> JobLog:
        """The job's log, to read; also of a job an earlier process ran."""
        job = self._live.get(job_id)
        if job is not None:
            return job.log
        return JobLog(self.settings.job_dir(job_id) / "logs", [], shown=self.settings.public_text)

    # --- requests -----------------------------------------------------------------------------
    def execute(
        self, op: str, entries: list[Entry], run: Callable[[list], Any], *, again: bool = False
    ) -> Generator[None, None, list[None]]:
        """Run the entries that may still run as one call of ``run`` and record each outcome (on its
        request, or as an event of its stream) as soon as ``run`` gives it, a slice per ``next()``; the
        worker runs other lanes' work between slices.

        ``run(items)`` returns one result per item, or an iterator that runs them a slice per ``next()``
        and yields ``{index: result}`` for the items finished meanwhile, or a :class:`Progress` for one
        still running, which goes to its request as news (:meth:`RequestTable.report`). Between slices,
        an op past its deadline (or whose jobs all stopped) is stopped there: closing the iterator drops
        it in the engines. What the engines log meanwhile goes to the logs of the jobs whose requests are
        pending. A batch of several jobs that fails is run ``again`` one entry at a time, so a failure is
        recorded on the request that caused it alone (a forward-backward that fails leaves no gradient
        behind, so each entry run again adds its own once); so is one of one job refused as invalid."""
        live = entries if again else [e for e in entries if self._may_run(e.job, e.request_id)]
        if not live:
            return [None] * len(entries)
        started = time.monotonic()
        # Each job's first request is watched for its deadline (an entry run again: still, from the first start).
        firsts = {} if again else {e.job.job_id: e for e in reversed(live)}
        for e in firsts.values():
            e.job.in_flight[e.request_id] = (e.sub_job_id, op, started)
        pending = dict(enumerate(live))  # index -> entry whose result is not recorded yet
        serving = self.log_router.serving
        try:
            with serving((e.job.log, e.sub_job_id) for e in live):
                outcome = run([e.item for e in live])
            slices = iter([dict(enumerate(outcome))]) if isinstance(outcome, list) else outcome
            while True:
                with serving((e.job.log, e.sub_job_id) for e in pending.values()):
                    done = next(slices, None)
                if done is None:
                    break
                for index, result in done.items():
                    if isinstance(result, Progress):
                        self.requests.report(pending[index].request_id, result)
                        continue
                    entry = pending.pop(index)
                    numbers = (  # what the metrics read of a result: its numbers, never its tensors
                        {k: v for k, v in result.items() if isinstance(v, int | float)}
                        if isinstance(result, dict)
                        else None
                    )
                    self.metrics.engine_ran(entry.job.job_id, entry.sub_job_id, op, started, numbers)
                    self._record_result(entry, result)
                if not pending:
                    break
                yield  # the worker's other lanes take their turn
                if self._stopped_between_slices(op, list(pending.values()), started):
                    getattr(slices, "close", lambda: None)()
                    return [None] * len(entries)
            if pending:
                raise RuntimeError(f"{op} ended without a result for {len(pending)} of its {len(live)} requests")
        except Exception as exc:  # every failure is recorded on its requests
            rest = list(pending.values())
            if isinstance(exc, InvalidRequestError):  # a stream's prompts run again one by one, as they came
                rest = [part for e in rest for part in self._prompt_by_prompt(e)]
            if len({e.job.job_id for e in rest}) > 1 or (len(rest) > 1 and isinstance(exc, InvalidRequestError)):
                for e in rest:
                    yield from self.execute(op, [e], run, again=True)
            else:
                self._record_failure(rest, op, exc)
        finally:
            for e in firsts.values():
                e.job.in_flight.pop(e.request_id, None)
        return [None] * len(entries)

    def _prompt_by_prompt(self, entry: Entry) -> list[Entry]:
        """A stream's entry of several prompts as one entry per prompt; any other entry as it is."""
        item = entry.item
        if entry.request_id not in self.streams or not isinstance(item, Sample) or len(item.prompts) < 2:
            return [entry]
        return [replace(entry, item=one) for one in item.one_by_one()]

    def _stopped_between_slices(self, op: str, pending: list[Entry], started: float) -> bool:
        """Stop an op at a slice boundary when its jobs all stopped (its requests are cancelled) or when
        it passed its deadline: then its requests fail and so does each job they belong to, naming
        its own sub-job only (the op may share its passes with other jobs' requests)."""
        if all(e.job.stopping for e in pending):
            for e in pending:
                why = f"job {e.job.job_id} stopped: {e.job.state.stop_reason}"
                self.requests.finish(e.request_id, status="cancelled", error=why)
                self.streams.close(e.request_id)
            return True
        deadline_s = self.settings.deadline_s(op)
        if time.monotonic() - started <= deadline_s:
            return False
        reasons: dict[str, str] = {}
        for e in pending:
            reason = reasons.setdefault(
                e.job.job_id,
                f"{op} on {e.sub_job_id} did not finish within its deadline of {deadline_s:g} s; "
                "stopped at its next pass or decode step",
            )
            stream = self.streams.get(e.request_id)
            if stream is not None:
                self._push(e.request_id, stream, e.item, error=reason)
            else:
                self.requests.finish(e.request_id, status="failed", error=reason)
        for e in {e.job.job_id: e for e in pending}.values():
            e.job.log.write(reasons[e.job.job_id], level="ERROR", sub_job_id=e.sub_job_id)
            fail_resumable(e.job, reasons[e.job.job_id], self.last_checkpoint)
        return True

    def _may_run(self, job: LiveJob, request_id: str) -> bool:
        stream = self.streams.get(request_id)
        if stream is not None and stream.overflow is not None:  # its prompts failed when its events overflowed
            return False
        if job.stopping:
            why = f"job {job.job_id} stopped before this request ran: {job.state.stop_reason}"
            self.requests.finish(request_id, status="cancelled", error=why)
            return False
        if self.requests.start(request_id, "streaming" if stream is not None else "running"):
            return True
        self.streams.close(request_id)  # cancel-request took it: its stream has nothing to show
        return False

    def _record_result(self, entry: Entry, result: Any) -> None:
        """Keep ``result`` as the engine made it until the API that asked renders it, when polled: in memory
        for a held API, else in the request's row as JSON (or a DSSST1 frame on disk, for tensors or when
        the request asks for one), which outlives a restart."""
        request_id, item = entry.request_id, entry.item
        stream = self.streams.get(request_id)
        try:
            if isinstance(item, FwdBwd) and item.op == OP_FWD_BWD:  # a save records it with the checkpoint
                entry.job.last_avg_loss[entry.sub_job_id] = float(result["avg_loss"])
            if stream is not None:
                self._push(request_id, stream, item, result=result)
                return
            if entry.api in HELD:
                self.held.put(request_id, result)
                self.requests.finish(request_id, status="done")
                return
            as_json = isinstance(item, Sample) and item.as_json  # each sample is JSON text already
            if not wants_dssst1(entry.op_metadata):
                text = "[" + ",".join(result) + "]" if as_json else json_text(result)
                if text is not None:
                    self.requests.finish(request_id, status="done", result_json=text)
                    return
            result = [json.loads(sample) for sample in result] if as_json else result
            path = ResultPages.write_frame(result, entry.job.job_dir / "results" / f"{uuid.uuid4().hex}.dssst1")
            self.requests.finish(request_id, status="done", result_path=path)
        except Exception as exc:  # an unencodable result fails the request, not the job
            self.requests.finish(request_id, status="failed", error=f"the result could not be stored: {exc}")

    def _record_failure(self, entries: list[Entry], op: str, exc: Exception) -> None:
        """Record a failed run on its entries (all of one job); an engine crash fails the job, or,
        when the host's engines died, every job on the host."""
        job, sub_job_id = entries[0].job, entries[0].sub_job_id
        if job.stopping and isinstance(exc, ClientClosedError):  # cut short by the job stopping
            for e in entries:
                self.requests.finish(e.request_id, status="cancelled", error=f"job {job.job_id} stopped: {exc}")
            return
        message = "; ".join([f"{type(exc).__name__}: {exc}", *getattr(exc, "__notes__", ())])
        for e in entries:
            stream = self.streams.get(e.request_id)
            if stream is not None:
                self._push(e.request_id, stream, e.item, error=message)
            else:
                self.requests.finish(e.request_id, status="failed", error=message)
        if isinstance(exc, _USER_ERRORS) or (isinstance(exc, RequestFailedError) and exc.category == "user"):
            job.log.write(f"{op} failed: {message}", level="WARNING", sub_job_id=sub_job_id)
            return
        job.log.write(f"{op} crashed the engine: {message}", level="ERROR", sub_job_id=sub_job_id)
        host = job.host
        if host is not None and host.shared and isinstance(exc, EngineProcessDied):
            cause = f"the engines of {host.host_id} died during {op}: {exc}"  # no job id: the host is shared
            host.fail(cause, self.last_checkpoint)
        else:
            fail_resumable(job, f"{sub_job_id} crashed during {op}: {message}", self.last_checkpoint)

    def _push(self, request_id: str, stream: GenerateStream, item: Any, **outcome: Any) -> None:
        """One prompt's result or error as an event of its stream; the last prompt's finishes the request."""
        counts = stream.push(item, **outcome)
        if counts is not None:
            self.requests.finish(request_id, status="done", result_json=counts)


@dataclass(frozen=True, slots=True)
class Entry:
    """One queued request (or one item of a stream) as its lane holds it."""

    job: LiveJob
    sub_job_id: str
    request_id: str
    item: Item
    op_metadata: dict[str, Any]
    api: str  # the API that asked: where its result waits (work.items.HELD)


def _pick_sub_job(
    job_id: str, kinds: dict[str, str], sub_job_id: str | None, sub_job_type: str | None, default_type: str | None
) -> str:
    """The sub-job id ``sub_job_id`` / ``sub_job_type`` name among ``kinds`` (id -> job type)."""
    wanted = job_type_named(sub_job_type) if sub_job_type is not None else None
    if sub_job_id is not None:
        if sub_job_id not in kinds:
            raise InvalidRequestError(
                f"sub_job_id {sub_job_id!r} is not part of job {job_id}; its sub-jobs are {sorted(kinds)}"
            )
        if wanted is not None and wanted != kinds[sub_job_id]:
            raise InvalidRequestError(
                f"sub_job_id {sub_job_id!r} is a {kinds[sub_job_id]} sub-job, but sub_job_type says {sub_job_type!r}"
            )
        return sub_job_id
    wanted = wanted or default_type
    if wanted is None:
        return next(iter(kinds))
    matches = [sid for sid, kind in kinds.items() if kind == wanted]
    if not matches:
        raise InvalidRequestError(f"job {job_id} has no {wanted} sub-job; its sub-jobs are {sorted(kinds)}")
    if len(matches) > 1 and sub_job_type is not None:
        raise InvalidRequestError(f"sub_job_type {sub_job_type!r} matches {matches}; pass sub_job_id to pick one")
    return matches[0]


def job_type_named(sub_job_type: str) -> str:
    """The job type a ``sub_job_type`` hint names (``JOB_TYPE_LOG_PROB``, ``log_probability``, ...)."""
    text = normalize_job_type(sub_job_type)
    if text not in SEGMENT_BY_JOB_TYPE:
        raise InvalidRequestError(f"sub_job_type must be one of {sorted(SEGMENT_BY_JOB_TYPE)}; got {sub_job_type!r}")
    return text
