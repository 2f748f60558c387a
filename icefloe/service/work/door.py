"""The one door: every item of every API (and the ``operation`` route's engine ops) enters the lanes here.

:func:`enter` checks that the tenant may touch every job, sub-job and checkpoint the item names, so a
route cannot forget it; then :meth:`JobManager.submit` writes the request row and queues the item,
where its deadline is watched and its run counted in the metrics.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from icefloe.protocol import InvalidRequestError, NotFoundError
from icefloe.service import store, tenants
from icefloe.service.jobs import JobManager, LiveJob
from icefloe.service.work.items import TRAINING, Item, Load, WeightSync

__all__ = ["enter"]


def enter(
    jobs: JobManager,
    job: LiveJob,
    item: Item,
    *,
    api: str = TRAINING,
    tenant: str | None = None,
    op_metadata: dict | None = None,
    stream: object = None,
) -> str:
    """Queue ``item`` on ``job`` for the API ``api``; returns its request id.

    ``tenant``: the caller's (None: the job's owner; a route reaches a job only once its caller may see
    it). A checkpoint of another tenant's job answers as one that does not exist (404). ``stream``: a
    GenerateStream whose items are queued in place of ``item``.
    """
    tenant = job.owner if tenant is None else tenant
    if not tenants.sees(tenant, job.owner):
        raise NotFoundError(f"job {job.job_id} not found")
    named = (*item.targets, item.source) if isinstance(item, WeightSync) else (item.sub_job_id,)
    unknown = sorted(sid for sid in named if sid not in job.specs)
    if unknown:
        raise InvalidRequestError(
            f"{unknown} are not sub-jobs of job {job.job_id}; its sub-jobs are {sorted(job.specs)}"
        )
    if isinstance(item, Load):
        owner = job.owner if item.source_job_id == job.job_id else store.job_owner(jobs.db, job_id=item.source_job_id)
        for who in {tenant, job.owner}:  # the caller, and the job whose weights it becomes
            record = tenants.checkpoint(
                jobs.db, who, owner, job_id=item.source_job_id, checkpoint_id=item.checkpoint_id
            )
        item = dataclasses.replace(item, folder=Path(record["path"]))
    if isinstance(item, WeightSync):
        return _enter_weight_sync(jobs, job, item, api)
    return jobs.submit(job, item, api=api, op_metadata=op_metadata, stream=stream)


def _enter_weight_sync(jobs: JobManager, job: LiveJob, item: WeightSync, api: str) -> str:
    """Park the targets' lanes behind their queued work, then queue the copy to start once they are."""
    from icefloe.engines.host import SyncGate

    request: dict[str, str] = {}

    def abandoned() -> str | None:
        if job.stopping:
            return f"job {job.job_id} stopped before weight-sync could run"
        request_id = request.get("id")
        if request_id is not None and not jobs.requests.is_open(request_id):
            return "the weight-sync request was cancelled"
        return None

    gate = SyncGate.parked([job.lanes[t] for t in item.targets], source=job.lanes[item.source], abandoned=abandoned)
    try:
        request["id"] = jobs.submit(job, dataclasses.replace(item, gate=gate), api=api, ready=gate.may_start)
    except BaseException:
        gate.release()
        raise
    return request["id"]
