"""The one door: every item of every API (and the ``operation`` route's engine ops) enters the lanes here.

:func:`enter` checks that the tenant may touch every job, sub-job and checkpoint the item names, so a
route cannot forget it; writes the request row; and queues the item on its sub-job's lane, where
:meth:`JobManager.execute` runs it, watches its deadline and counts it in the metrics.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from icefloe.engines.host import SyncGate, Work
from icefloe.protocol import ClientClosedError, ConflictError, InvalidRequestError, NotFoundError
from icefloe.service import store, tenants
from icefloe.service.jobs import Entry, JobManager, LiveJob
from icefloe.service.work.items import TRAINING, Item, Load, WeightSync, run_batch, run_one

__all__ = ["enter"]


def enter(
    jobs: JobManager,
    job: LiveJob,
    item: Item,
    *,
    api: str = TRAINING,
    tenant: str | None = None,
    op_metadata: dict | None = None,
    stream: Any = None,
) -> str:
    """Queue ``item`` on ``job`` for the API ``api``; returns its request id.

    ``tenant``: the caller's (None: the job's owner; a route reaches a job only once its caller may see
    it). A checkpoint of another tenant's job answers as one that does not exist (404). An item with a
    ``batch_key`` runs with the items of that key queued beside it, on any lane of the host (whatever job
    each belongs to). ``stream``: a GenerateStream whose ``items`` are queued in place of ``item`` and
    whose outcomes are pushed to it as events. A weight sync parks its targets' lanes behind their queued
    work and starts once they are (a :class:`SyncGate`). ``api`` reads and renders the result.
    """
    tenant = job.owner if tenant is None else tenant
    if not tenants.sees(tenant, job.owner):
        raise NotFoundError(f"job {job.job_id} not found")
    _check_sub_jobs(job, (*item.targets, item.source) if isinstance(item, WeightSync) else (item.sub_job_id,))
    if isinstance(item, Load):
        folder = _checkpoint_folder(jobs, job, tenant, item.source_job_id, item.checkpoint_id)
        item = dataclasses.replace(item, folder=folder)
    op_metadata = op_metadata or {}
    request_id = jobs.requests.add(job.job_id, item.sub_job_id, item.op, op_metadata)
    if stream is not None:
        jobs.streams.open(request_id, stream)
    lane = job.lanes[item.sub_job_id]
    gate: SyncGate | None = None
    try:
        if isinstance(item, WeightSync):
            gate = _parked(jobs, job, item.targets, item.source, request_id)
            item = dataclasses.replace(item, gate=gate)
        batch_key = getattr(item, "batch_key", None)
        if batch_key is None:
            run = functools.partial(_run_one, job, jobs.db)
            entry = Entry(job, item.sub_job_id, request_id, item, op_metadata, api)
            lane.put(Work(fn=jobs.execute, args=(item.op, [entry], run), ready=gate and gate.may_start))
        else:  # run with the entries of one batch (see Lane.submit_batchable)
            execute = functools.partial(jobs.execute, item.op, run=functools.partial(run_batch, job))
            for one in [item] if stream is None else stream.items:
                entry = Entry(job, item.sub_job_id, request_id, one, op_metadata, api)
                lane.put(Work(key=batch_key, item=entry, run_batch=execute))
    except BaseException as exc:
        if gate is not None:
            gate.release()
        if not isinstance(exc, ClientClosedError):
            raise
        why = f"job {job.job_id} is stopping: {job.state.stop_reason}"  # a stop closed the lanes after the state check
        jobs.requests.finish(request_id, status="cancelled", error=why)
        jobs.streams.close(request_id)
        raise ConflictError(f"{why}; this call needs it running") from None
    return request_id


def _check_sub_jobs(job: LiveJob, named: Sequence[str]) -> None:
    unknown = sorted(sid for sid in named if sid not in job.specs)
    if unknown:
        raise InvalidRequestError(
            f"{unknown} are not sub-jobs of job {job.job_id}; its sub-jobs are {sorted(job.specs)}"
        )


def _checkpoint_folder(jobs: JobManager, job: LiveJob, tenant: str, source_job_id: str, checkpoint_id: str) -> Path:
    """Where a checkpoint both the caller and the job (whose weights it becomes) may read lies."""
    owner = job.owner if source_job_id == job.job_id else store.job_owner(jobs.db, job_id=source_job_id)
    for who in {tenant, job.owner}:
        record = tenants.checkpoint(jobs.db, who, owner, job_id=source_job_id, checkpoint_id=checkpoint_id)
    return Path(record["path"])


def _parked(jobs: JobManager, job: LiveJob, targets: Sequence[str], source: str, request_id: str) -> SyncGate:
    """The targets' lanes parked behind their queued work, for the copy of request ``request_id``."""

    def abandoned() -> str | None:
        if job.stopping:
            return f"job {job.job_id} stopped before weight-sync could run"
        if not jobs.requests.is_open(request_id):
            return "the weight-sync request was cancelled"
        return None

    return SyncGate.parked([job.lanes[t] for t in targets], source=job.lanes[source], abandoned=abandoned)


def _run_one(job: LiveJob, db: store.Database, items: list[Item]) -> list[Any] | Iterator[dict[int, Any]]:
    (item,) = items
    return run_one(job, item, db)
