"""List, export (download links served here) and delete a job's checkpoints.

A download link is made on ``--public-url`` when the service has one, else on the address the
request came in on: never on the ``Host`` header, which the caller writes.
"""

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
from icefloe.service.routes import JobsDep, SettingsDep, StoreDep, TenancyDep, TenantDep, api_router
from icefloe.service.schemas import CheckpointExport, CheckpointList
from icefloe.service.settings import ServeSettings

__all__ = ["download_links", "files_router", "router"]

router = api_router("checkpoints")
files_router = APIRouter(tags=["files"])  # no bearer token: the link's secret is the credential


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
async def list_checkpoints(job_id: str, jobs: JobsDep, db: StoreDep) -> dict:
    jobs.public(job_id)
    return {"checkpoints": store.list_checkpoints(db, job_id=job_id)}


@router.post("/{job_id}/checkpoints/{checkpoint_id}:export", response_model=CheckpointExport)
async def export_checkpoint(
    job_id: str,
    checkpoint_id: str,
    request: Request,
    db: StoreDep,
    settings: SettingsDep,
    tenancy: TenancyDep,
    tenant: TenantDep,
) -> dict:
    record = tenancy.checkpoint(tenant, job_id=job_id, checkpoint_id=checkpoint_id)
    folder = Path(record["path"])
    if not folder.is_dir():
        raise NotFoundError(f"checkpoint {checkpoint_id} of job {job_id} has no files on disk any more")
    files, expires = download_links(request, db, settings, folder)
    expires_at = datetime.fromtimestamp(expires, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"checkpoint_id": checkpoint_id, "files": files, "expires_at": expires_at}


def download_links(
    request: Request, db: store.Database, settings: ServeSettings, folder: Path
) -> tuple[list[dict], float]:
    """A link per file under ``folder`` (``filename``, ``url``, ``size_bytes``), and when they expire."""
    expires = time.time() + settings.export_ttl_s
    if settings.public_url:
        base = settings.public_url
    else:
        server = request.scope.get("server")  # (host, port) of the socket the request came in on
        host, port = server if server and server[1] else (settings.host, settings.port)
        base = f"{request.url.scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    files = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        token = secrets.token_urlsafe(24)
        store.insert_file_link(db, token=token, path=str(path), expires_at=expires)
        url = base + files_router.url_path_for("download", token=token)  # the Tinker API asks from its own app
        files.append({"filename": str(path.relative_to(folder)), "url": url, "size_bytes": path.stat().st_size})
    return files, expires


@router.delete("/{job_id}/checkpoints/{checkpoint_id}", status_code=204)
async def delete_checkpoint(
    job_id: str, checkpoint_id: str, db: StoreDep, tenancy: TenancyDep, tenant: TenantDep
) -> Response:
    record = tenancy.checkpoint(tenant, job_id=job_id, checkpoint_id=checkpoint_id)
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
