"""List, export (download links served here) and delete a job's checkpoints."""

from __future__ import annotations

import secrets
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse

from icefloe.protocol import ExpiredError, NotFoundError
from icefloe.service import store
from icefloe.service.models import CheckpointExport, CheckpointList
from icefloe.service.routes import JobsDep, SettingsDep, StoreDep, api_router

__all__ = ["files_router", "router"]

router = api_router("checkpoints")
files_router = APIRouter(tags=["files"])  # no bearer token: the link's secret is the credential


def _checkpoint(db: store.Database, jobs, job_id: str, checkpoint_id: str) -> dict:
    jobs.public(job_id)  # 404 for an unknown job
    record = store.get_checkpoint(db, job_id=job_id, checkpoint_id=checkpoint_id)
    if record is None:
        raise NotFoundError(f"checkpoint {checkpoint_id} not found in job {job_id}")
    return record


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
async def list_checkpoints(job_id: str, jobs: JobsDep, db: StoreDep) -> dict:
    jobs.public(job_id)
    return {"checkpoints": store.list_checkpoints(db, job_id=job_id)}


@router.post("/{job_id}/checkpoints/{checkpoint_id}:export", response_model=CheckpointExport)
async def export_checkpoint(
    job_id: str, checkpoint_id: str, request: Request, jobs: JobsDep, db: StoreDep, settings: SettingsDep
) -> dict:
    record = _checkpoint(db, jobs, job_id, checkpoint_id)
    folder = Path(record["path"])
    if not folder.is_dir():
        raise NotFoundError(f"checkpoint {checkpoint_id} of job {job_id} has no files on disk any more")
    expires = time.time() + settings.export_ttl_s
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        token = secrets.token_urlsafe(24)
        store.insert_file_link(db, token=token, path=str(path), expires_at=expires)
        files.append(
            {
                "filename": str(path.relative_to(folder)),
                "url": str(request.url_for("download", token=token)),
                "size_bytes": path.stat().st_size,
            }
        )
    expires_at = datetime.fromtimestamp(expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"checkpoint_id": checkpoint_id, "files": files, "expires_at": expires_at}


@router.delete("/{job_id}/checkpoints/{checkpoint_id}", status_code=204)
async def delete_checkpoint(job_id: str, checkpoint_id: str, jobs: JobsDep, db: StoreDep) -> Response:
    record = _checkpoint(db, jobs, job_id, checkpoint_id)
    store.delete_checkpoint(db, job_id=job_id, checkpoint_id=checkpoint_id)
    shutil.rmtree(record["path"], ignore_errors=True)
    return Response(status_code=204)


@files_router.get("/files/{token}", name="download")
async def download(token: str, db: StoreDep) -> FileResponse:
    link = store.get_file_link(db, token=token)
    if link is None:
        raise NotFoundError("download link not found; export the checkpoint to get a new one")
    if link["expires_at"] < time.time():
        raise ExpiredError("download link expired; export the checkpoint again for a fresh link")
    path = Path(link["path"])
    if not path.is_file():
        raise NotFoundError("the file behind this link was deleted with its checkpoint")
    return FileResponse(path, filename=path.name, media_type="application/octet-stream")
