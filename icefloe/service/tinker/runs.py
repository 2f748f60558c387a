"""The Tinker API's REST routes (``RestClient``): the models this server offers, training runs and their
checkpoints (listed, copied, downloaded, deleted) and sessions, each within the caller's tenant. A route the SDK
knows that no route here or in :mod:`.routes` serves is refused by name (404), never a bare 404.

Runs and checkpoints are read from the store, so they are listed after a restart too.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response

from icefloe.protocol import InvalidRequestError, NotFoundError
from icefloe.service import store
from icefloe.service.routes import SettingsDep, TenantDep
from icefloe.service.routes.checkpoints import download_links
from icefloe.service.settings import ServeSettings
from icefloe.service.tinker.routes import Body, State
from icefloe.service.tinker.state import CheckpointPath, TinkerState

__all__ = ["router"]

router = APIRouter(tags=["tinker"])  # mounted at TINKER_PREFIX

_CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
_MAX_OFFSET = 2**63 - 1  # SQLite's largest integer
_MAX_PAGE = 1000
_MAX_LISTED = 1000  # model folders listed per level of --model-root


# --- the server ---------------------------------------------------------------------------------
@router.get("/get_server_capabilities")
async def get_server_capabilities(settings: SettingsDep) -> dict[str, Any]:
    """The models a run may start from: the tiny presets, and each model folder under ``--model-root``
    by the name create_model takes (never the server's path for it)."""
    return {"supported_models": await asyncio.to_thread(_served_models, settings)}


def _served_models(settings: ServeSettings) -> list[dict[str, Any]]:
    from icefloe.engines.models import TINY_PRESETS

    models = [(f"tiny:{name}", preset.max_position_embeddings) for name, preset in sorted(TINY_PRESETS.items())]
    if settings.model_root is not None:
        models += _model_folders(settings.model_root.resolve())
    return [{"model_name": name, "max_context_length": length, "trainable": True, "sampleable": True}
            for name, length in models]  # fmt: skip


def _model_folders(root: Path) -> list[tuple[str, int | None]]:
    """(name under ``root``, context length) of each model folder one or two levels down (org/name)."""
    found: list[tuple[str, int | None]] = []

    def visit(folder: Path, name: str, depth: int) -> None:
        try:
            real = folder.resolve()
            if not real.is_relative_to(root) or not real.is_dir():
                return  # a link out of the root: create_model refuses it too
            if (real / "config.json").is_file():
                found.append((name, _context_length(real / "config.json")))
            elif depth < 2:
                for child in sorted(real.iterdir())[:_MAX_LISTED]:
                    visit(child, f"{name}/{child.name}" if name else child.name, depth + 1)
        except (OSError, RuntimeError):  # unreadable, or a link loop: not offered
            return

    visit(root, "", 0)
    return found


def _context_length(config: Path) -> int | None:
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    length = values.get("max_position_embeddings") or values.get("n_positions") if isinstance(values, dict) else None
    return length if isinstance(length, int) else None


# --- training runs ------------------------------------------------------------------------------
def _page(limit: int, offset: int) -> None:
    if not 1 <= limit <= _MAX_PAGE or not 0 <= offset <= _MAX_OFFSET:
        raise InvalidRequestError(
            f"limit must be in [1, {_MAX_PAGE}] and offset in [0, {_MAX_OFFSET}]; got {limit}, {offset}"
        )


@router.get("/training_runs")
async def list_training_runs(state: State, tenant: TenantDep, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    _page(limit, offset)
    owner = state.tenancy.owner_filter(tenant)
    rows, total = await asyncio.to_thread(store.list_tinker_runs, state.db, owner=owner, limit=limit, offset=offset)
    runs = [await asyncio.to_thread(_training_run, state.db, row) for row in rows]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, state: State, tenant: TenantDep) -> dict[str, Any]:
    state.model(run_id, tenant)  # 404 for another tenant's, or a sampler's id
    row = await asyncio.to_thread(store.get_tinker_run, state.db, run_id=run_id)
    assert row is not None
    return await asyncio.to_thread(_training_run, state.db, row)


def _training_run(db: store.Database, row: dict[str, Any]) -> dict[str, Any]:
    checkpoints = _checkpoints(store.list_checkpoints(db, job_id=row["job_id"]), row["run_id"])
    latest = {kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
              for kind in ("training", "sampler")}  # fmt: skip
    return {
        "training_run_id": row["run_id"],
        "base_model": row["base_model"],
        "model_owner": row["owner"],
        "is_lora": row["lora_rank"] is not None,
        "lora_rank": row["lora_rank"],
        "corrupted": False,
        "last_request_time": row["updated_at"],
        "last_checkpoint": latest["training"],
        "last_sampler_checkpoint": latest["sampler"],
    }


def _checkpoints(records: list[dict[str, Any]], run_id: str) -> list[dict[str, Any]]:
    """The SDK's checkpoint entries of a run's records (those saved through the training API skipped)."""
    entries = []
    for record in records:
        kind, _, name = record["checkpoint_id"].removeprefix("tinker-").partition("-")
        if kind not in _CHECKPOINT_TYPES or not name:
            continue  # saved through the training API (or a copy, listed under its own run), not a tinker:// path
        entries.append({
            "checkpoint_id": f"{kind}/{name}",
            "checkpoint_type": _CHECKPOINT_TYPES[kind],
            "time": record["created_at"],
            "tinker_path": str(CheckpointPath(run_id, kind, name)),
        })  # fmt: skip
    return entries


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, state: State, tenant: TenantDep) -> dict[str, Any]:
    model = state.model(model_id, tenant)  # from the store when its session ended or the service restarted
    records = await asyncio.to_thread(store.list_checkpoints, state.db, job_id=model.job_id)
    return {"checkpoints": _checkpoints(records, model_id)}


@router.get("/checkpoints")
async def list_user_checkpoints(state: State, tenant: TenantDep, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    """Every checkpoint of the tenant's runs, newest first."""
    _page(limit, offset)
    owner = state.tenancy.owner_filter(tenant)
    records = await asyncio.to_thread(store.owned_tinker_checkpoints, state.db, owner=owner, limit=limit, offset=offset)
    total = await asyncio.to_thread(store.count_tinker_checkpoints, state.db, owner=owner)
    entries = [entry for record in records for entry in _checkpoints([record], record["run_id"])]
    return {"checkpoints": entries, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


def _path(run_id: str, kind: str, name: str) -> CheckpointPath:
    return CheckpointPath.parse(str(CheckpointPath(run_id, kind, name)))


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
async def delete_checkpoint(run_id: str, kind: str, name: str, state: State, tenant: TenantDep) -> Response:
    """Delete the checkpoint's record, and its files unless another record (a copy) still names them."""
    path = _path(run_id, kind, name)
    await asyncio.to_thread(_delete, state, path, tenant)
    return Response(status_code=204)


def _delete(state: TinkerState, path: CheckpointPath, tenant: str) -> None:
    job_id = state.checkpoint_job(path, tenant)
    record = state.checkpoint_record(path, tenant)
    store.delete_checkpoint(state.db, job_id=job_id, checkpoint_id=path.checkpoint_id)
    if not state.db.fetch_one("SELECT 1 FROM checkpoints WHERE path = ?", (record["path"],)):
        shutil.rmtree(record["path"], ignore_errors=True)


@router.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl")
async def set_checkpoint_ttl(run_id: str, kind: str, name: str, state: State, tenant: TenantDep) -> dict[str, Any]:
    """Accepted and changes nothing, as ``ttl_seconds`` on a save: a checkpoint lives until it is deleted."""
    await asyncio.to_thread(state.checkpoint_record, _path(run_id, kind, name), tenant)  # 404 unless the tenant's
    return {}


@router.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(
    run_id: str, kind: str, name: str, request: Request, state: State, tenant: TenantDep, settings: SettingsDep
) -> dict[str, Any]:
    """A download link per file of the checkpoint (on ``--public-url`` when given), as the cookbook's
    ``weights.download`` fetches them."""
    record = await asyncio.to_thread(state.checkpoint_record, _path(run_id, kind, name), tenant)
    folder = Path(record["path"])
    if not folder.is_dir():
        raise NotFoundError(f"checkpoint tinker://{run_id}/{kind}/{name} has no files on disk any more")
    files, expires = await asyncio.to_thread(download_links, request, state.db, settings, folder)
    expires_at = datetime.fromtimestamp(expires, UTC).isoformat()
    return {"urls": {f["filename"]: f["url"] for f in files}, "expires": expires_at}


@router.post("/copy_weights")
async def copy_weights(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    """A new run's name for the source's files (``tinker://copy-<hex>/<kind>/<name>``), recorded on the job
    that saved them: nothing is duplicated. One service has no projects: destination_project_id,
    session_id and ttl_seconds are accepted and change nothing."""
    source = CheckpointPath.parse(body.text("source_path", max_chars=2048))
    return {"tinker_path": str(await asyncio.to_thread(_copy, state, source, tenant))}


def _copy(state: TinkerState, source: CheckpointPath, tenant: str) -> CheckpointPath:
    job_id = state.checkpoint_job(source, tenant)
    record = state.checkpoint_record(source, tenant)
    copy = source.copy()
    store.upsert_checkpoint(
        state.db, job_id=job_id, checkpoint_id=copy.checkpoint_id, global_steps=record["global_steps"],
        avg_loss=record["avg_loss"], checkpoint_type=record["checkpoint_type"], path=record["path"],
    )  # fmt: skip
    return copy


@router.post("/weights_info")
async def weights_info(body: Body, state: State, tenant: TenantDep) -> dict[str, Any]:
    path = CheckpointPath.parse(body.text("tinker_path", max_chars=2048))
    base_model, rank, _ = await asyncio.to_thread(state.base_model_of, path, tenant)
    return {"base_model": base_model, "is_lora": rank is not None, "lora_rank": rank}


# --- sessions -----------------------------------------------------------------------------------
_SCOPES = ("owned", "accessible")


@router.get("/sessions")
async def list_sessions(
    state: State, tenant: TenantDep, limit: int = 20, offset: int = 0, access_scope: str = "owned"
) -> dict[str, Any]:
    """The caller's session ids, newest first; ``accessible`` lets the admin list every tenant's."""
    _page(limit, offset)
    if access_scope not in _SCOPES:
        raise InvalidRequestError(f"access_scope must be one of {list(_SCOPES)}; got {access_scope[:40]!r}")
    owner = tenant if access_scope == "owned" else state.tenancy.owner_filter(tenant)
    ids = await asyncio.to_thread(store.list_tinker_sessions, state.db, owner=owner, limit=limit, offset=offset)
    return {"sessions": ids}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, state: State, tenant: TenantDep) -> dict[str, Any]:
    """A session's models (training runs) and sampling sessions; 404 for one that is not the caller's."""
    await asyncio.to_thread(state.session, session_id, tenant)
    runs = await asyncio.to_thread(store.session_tinker_runs, state.db, session_id=session_id)
    return {
        "training_run_ids": [run["run_id"] for run in runs if run["kind"] == "model"],
        "sampler_ids": [run["run_id"] for run in runs if run["kind"] == "sampler"],
        "user_metadata": None,
    }


# --- what is not served -------------------------------------------------------------------------
@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
async def not_served(path: str, request: Request) -> None:
    where = f"{request.scope.get('root_path', '')}/{path[:200]}"  # the mount's prefix, then the path
    raise NotFoundError(
        f"{request.method} {where} is not served by icefloe serve (publishing, projects, session search, "
        "audit logs, billing and custom losses on the server are not); docs/tinker.md lists what is"
    )
