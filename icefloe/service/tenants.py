"""Tenants: who owns which job, what each may see, and what each may still start.

A token names its tenant (``--token-file`` lines ``name: token``; a bare token is the shared tenant's).
A tenant sees and touches only the jobs it created, and through them their requests, checkpoints,
logs, metrics and download links, in both APIs: another tenant's job answers exactly as a job
that does not exist (404), so nobody learns what others run. The ``admin`` tenant sees every job.
A request that names a checkpoint (a ``{job_id}`` route, a ``source_job_id``, a create-time source)
reads it through :meth:`Tenancy.checkpoint` and nothing else. A job id a tenant chooses lives in its
own namespace, so creating one never tells of another tenant's job. Each tenant's limits (concurrent
jobs, LoRA jobs, slots) are checked when a job is created, under one lock, against the jobs it holds
then. Slots count the hosts the tenant's jobs are charged with (:mod:`icefloe.service.hosts.pool`): a
LoRA job that joins a host of its base takes none, one that starts a host takes its slot.
"""

from __future__ import annotations

import threading
from typing import Any

from icefloe.protocol import JOB_ACTIVE_STATES, ConflictError, InvalidRequestError, NotFoundError
from icefloe.service import store
from icefloe.service.hosts.pool import shared_base_key
from icefloe.service.jobs import JobManager
from icefloe.service.models import JobCreate
from icefloe.service.settings import ADMIN_TENANT, ServeSettings
from icefloe.service.specs import sub_job_specs

__all__ = ["Tenancy", "checkpoint", "sees"]

_OWNERS_KEPT = 100_000  # job owners cached in memory (they never change)


class Tenancy:
    """The owner of each job, read once from the store, and the admission of new jobs."""

    def __init__(self, settings: ServeSettings, db: store.Database) -> None:
        self.settings = settings
        self.db = db
        self._owners: dict[str, str] = {}
        self._admitting = threading.Lock()

    def sees(self, tenant: str, owner: str | None) -> bool:
        return sees(tenant, owner)

    def owner(self, job_id: str) -> str | None:
        owner = self._owners.get(job_id)
        if owner is None:
            owner = store.job_owner(self.db, job_id=job_id)
            if owner is not None:
                if len(self._owners) >= _OWNERS_KEPT:
                    self._owners.clear()
                self._owners[job_id] = owner
        return owner

    def check(self, tenant: str, job_id: str) -> None:
        """404, worded as for a job that does not exist, unless ``tenant`` may see the job."""
        if not self.sees(tenant, self.owner(job_id)):
            raise NotFoundError(f"job {job_id} not found")

    def checkpoint(self, tenant: str, *, job_id: str, checkpoint_id: str, where: str = "") -> dict[str, Any]:
        """The record of ``checkpoint_id`` in ``job_id``, if ``tenant`` may see that job (see :func:`checkpoint`)."""
        return checkpoint(self.db, tenant, self.owner(job_id), job_id=job_id, checkpoint_id=checkpoint_id, where=where)

    def owner_filter(self, tenant: str) -> str | None:
        """The owner a listing for ``tenant`` is limited to (None: every owner, for the admin)."""
        return None if tenant == ADMIN_TENANT else tenant

    def create(self, manager: JobManager, body: JobCreate, *, tenant: str, database: str, schema: str) -> str:
        """Create a job owned by ``tenant`` if its limits leave room; a source checkpoint must be the
        tenant's own. Raises :class:`ConflictError` naming the limit reached."""
        body = self._own_sources(tenant, self._own_job_id(tenant, body))
        # The count, the placement and the insert as one step: two creates cannot both take the last
        # place, and a host cannot start or go between the count and the placement.
        with self._admitting, manager.hosts.frozen():
            limits = self.settings.tenant_limits.get(tenant)
            if limits is not None:
                specs = sub_job_specs("admission", body, model_root=self.settings.model_root)
                held = store.active_jobs(self.db, owner=tenant, states=JOB_ACTIVE_STATES)
                key = shared_base_key(specs)
                starts = manager.hosts.new_slots(key, sum(s.num_slots for s in specs))
                _admit(
                    tenant,
                    limits.model_dump(),
                    jobs=len(held) + 1,
                    lora=sum(map(_is_lora, (row["spec"] for row in held))) + any(s.config.lora for s in specs),
                    slots=self._slots_held(tenant, manager, held) + starts,
                    starts_shared_host=key is not None and starts > 0,
                )
            job_id = manager.create(body, database=database, schema=schema, owner=tenant)
        self._owners[job_id] = tenant
        return job_id

    def _own_job_id(self, tenant: str, body: JobCreate) -> JobCreate:
        """``body`` with the job id it chooses in ``tenant``'s namespace (``<job_id>@<tenant>``) on a service
        with named tenants: two tenants choosing one id each get a job, so "already exists" only ever
        means a job of the caller's own. Chosen ids cannot hold ``@``; generated ones are UUIDs."""
        if body.job_id is None or not self.settings.tenant_tokens:
            return body
        return body.model_copy(update={"job_id": f"{body.job_id}@{tenant}"})

    def _slots_held(self, tenant: str, manager: JobManager, held: list[dict[str, Any]]) -> int:
        """The slots of the hosts ``tenant``'s active jobs are charged with: each dedicated host's, and the one
        slot of each shared host whose oldest job is the tenant's."""
        dedicated = sum(row["spec"].get("num_slots", 0) for row in held)
        return dedicated + sum(self.owner(job_id) == tenant for job_id in manager.hosts.holders())

    def _own_sources(self, tenant: str, body: JobCreate) -> JobCreate:
        """``body`` with each source checkpoint pinned to a job of ``tenant`` (404 if it has none by that id)."""
        changed = False
        configs = []
        for position, sub in enumerate(body.sub_job_configs):
            info = sub.source_checkpoint_info
            if info is None:
                configs.append(sub)
                continue
            where = f"sub_job_configs.{position}.source_checkpoint_info: "
            if info.source_job_id is not None:
                self.checkpoint(tenant, job_id=info.source_job_id, checkpoint_id=info.checkpoint_id, where=where)
                configs.append(sub)
                continue
            found = store.find_checkpoints(self.db, checkpoint_id=info.checkpoint_id)
            mine = [record["job_id"] for record in found if self.sees(tenant, self.owner(record["job_id"]))]
            if not mine:  # none, or only other tenants' (answered alike)
                raise NotFoundError(f"{where}checkpoint {info.checkpoint_id!r} not found")
            if len(mine) > 1:
                raise InvalidRequestError(f"{where}{info.checkpoint_id!r} exists in several jobs; set source_job_id")
            pinned = info.model_copy(update={"source_job_id": mine[0]})
            configs.append(sub.model_copy(update={"source_checkpoint_info": pinned}))
            changed = True
        return body.model_copy(update={"sub_job_configs": configs}) if changed else body


def sees(tenant: str, owner: str | None) -> bool:
    """Whether ``tenant`` may see a job of ``owner`` (None: no such job)."""
    return owner is not None and tenant in (owner, ADMIN_TENANT)


def checkpoint(
    db: store.Database, tenant: str, owner: str | None, *, job_id: str, checkpoint_id: str, where: str = ""
) -> dict[str, Any]:
    """The record of ``checkpoint_id`` in ``job_id`` (owned by ``owner``), if ``tenant`` may see that job;
    else a 404 worded alike for an unknown job, another tenant's job and a checkpoint the job does not have."""
    record = store.get_checkpoint(db, job_id=job_id, checkpoint_id=checkpoint_id) if sees(tenant, owner) else None
    if record is None:
        raise NotFoundError(f"{where}checkpoint {checkpoint_id!r} not found in job {job_id}")
    return record


def _is_lora(spec: dict[str, Any]) -> bool:
    return any(sub["config"].get("peft_config") for sub in spec.get("sub_jobs", ()))


def _admit(
    tenant: str, limits: dict[str, int | None], *, jobs: int, lora: int, slots: int, starts_shared_host: bool
) -> None:
    wanted = {"max_jobs": (jobs, "active jobs"), "max_lora_adapters": (lora, "LoRA jobs")}
    wanted["max_slots"] = (slots, "slots")
    for key, (count, what) in wanted.items():
        limit = limits[key]
        if limit is not None and count > limit:
            why = ""
            if key == "max_slots" and starts_shared_host:
                why = " (no host of its base model, seed and dtype has room, so it would start one)"
            raise ConflictError(
                f"tenant {tenant!r} may hold {limit} {what} at once ({key}={limit} in the token file); this job would "
                f"make {count}{why}: finish or cancel one of its jobs first"
            )
