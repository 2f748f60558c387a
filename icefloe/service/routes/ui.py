"""The dashboard at ``/ui``: static pages (uPlot charts shipped in ``ui/static``) whose script polls
``/ui/api/...``, which gathers what a page shows in one answer, and the API. A tenant sees its own
jobs only (the admin tenant every job). With auth on, ``/ui/login`` takes a token once and answers
with a cookie that holds a server-side session id (:mod:`icefloe.service.logins`), never the token;
``/ui/logout`` ends the session. No page may be framed by another site.
"""

from __future__ import annotations

import time
import urllib.parse
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from icefloe.protocol import ForbiddenError
from icefloe.service import store
from icefloe.service.jobs import JobManager
from icefloe.service.logins import SESSION_COOKIE, Logins
from icefloe.service.middleware import caller_of, matching_token
from icefloe.service.origins import foreign_origin
from icefloe.service.routes import JobsDep, SettingsDep, StoreDep, TenancyDep, TenantDep

__all__ = ["install_ui"]

_PAGES = Path(__file__).resolve().parent.parent / "ui"
_LOG_LINES = 200
_FAILED_SHOWN = 10
_CHECKPOINT_SHOWN = ("checkpoint_id", "global_steps", "avg_loss", "created_at", "checkpoint_type")  # not its path
# Every page: never inside another site's frame (a click there would act through the login cookie).
_PAGE_HEADERS = {
    "cache-control": "no-store",
    "x-frame-options": "DENY",
    "content-security-policy": "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
}

router = APIRouter(prefix="/ui", tags=["dashboard"], include_in_schema=False)


def install_ui(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=_PAGES / "static"), name="ui-static")


def _page(name: str, title: str, *stylesheets: str) -> HTMLResponse:
    """A page file holds its body; the head every page shares is written here once."""
    links = "".join(f'  <link rel="stylesheet" href="/ui/static/{sheet}">\n' for sheet in (*stylesheets, "app.css"))
    head = f'<!doctype html>\n<html lang="en">\n<head>\n  <meta charset="utf-8">\n  <title>icefloe {title}</title>\n'
    head += f"{links}</head>\n"
    body = (_PAGES / name).read_text(encoding="utf-8")
    return HTMLResponse(head + body, headers=_PAGE_HEADERS)


@router.get("")
async def jobs_page() -> HTMLResponse:
    return _page("jobs.html", "jobs")


@router.get("/jobs/{job_id}")
async def job_page(job_id: str) -> HTMLResponse:
    return _page("job.html", "job", "uPlot.min.css")


@router.get("/login")
async def login_form(settings: SettingsDep) -> Response:
    if not settings.auth_enabled:
        return RedirectResponse("/ui", status_code=303)
    return _page("login.html", "login")


@router.post("/login")
async def login(request: Request, settings: SettingsDep) -> Response:
    """A form post ``token=...``: a known token starts a session whose id is set as the cookie; an
    unknown one shows the form again. Too many failures from one address are refused (429) unchecked.
    A post a page of another origin sent is refused (403): it would sign the browser in as whoever
    that page chose, and what the user then does lands in that account."""
    foreign = foreign_origin(request.scope, settings.public_url)
    if foreign is not None:
        raise ForbiddenError(
            f"a login sent by a page of another origin ({foreign!r}) is refused; sign in on this service's own "
            "login page"
        )
    logins: Logins = request.app.state.logins
    address = request.client.host if request.client else ""
    logins.check(address)
    form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
    presented = (form.get("token") or [""])[0].strip()
    matched = matching_token(settings.token_tenants(), presented) if presented else None
    if matched is None:
        logins.failed(address)
        return RedirectResponse("/ui/login?failed=1", status_code=303)
    token, tenant = matched
    session_id = logins.start(tenant=tenant, caller=caller_of(token))
    answer = RedirectResponse("/ui", status_code=303)
    answer.set_cookie(
        SESSION_COOKIE, session_id, max_age=int(logins.ttl_s), httponly=True, samesite="strict", path="/",
        secure=request.url.scheme == "https" or (settings.public_url or "").startswith("https://"),
    )  # fmt: skip
    return answer


@router.post("/logout")
async def logout(request: Request) -> Response:
    """End the session: its id is refused from now on, wherever the cookie was copied to."""
    session_id = request.cookies.get(SESSION_COOKIE)
    if session_id:
        request.app.state.logins.end(session_id)
    answer = RedirectResponse("/ui/login", status_code=303)
    answer.delete_cookie(SESSION_COOKIE, path="/")
    return answer


@router.get("/api/session")
async def session(request: Request, tenant: TenantDep) -> dict:
    """Who the page is signed in as, and the CSRF token its changes carry (None: a token caller)."""
    session_id = request.cookies.get(SESSION_COOKIE)
    live = request.app.state.logins.get(session_id) if session_id else None
    return {"tenant": tenant, "csrf_token": live.csrf_token if live is not None else None}


# --- what the pages show -----------------------------------------------------------------------
def _mode(spec: dict[str, Any]) -> str:
    """'LoRA r=N' when a trained sub-job has adapters, else 'full'."""
    for sub in spec["sub_jobs"]:
        peft = sub["config"].get("peft_config")
        if peft:
            return f"LoRA r={peft.get('r', '?')}"
    return "full"


def _lease(jobs: JobManager, job_id: str) -> str:
    live = jobs.live_job(job_id)
    if live is None or live.stopping:
        return "ended"
    if not jobs.settings.lease_ttl_s or live.lease_until == float("inf"):
        return "no lease"
    if jobs.requests.has_open(job_id):
        return "held (request in flight)"
    return f"expires in {max(0.0, live.lease_until - time.monotonic()):.0f} s"


def _row(jobs: JobManager, row: dict[str, Any], latest: dict[str, tuple[int, float]]) -> dict[str, Any]:
    """A jobs-table row; ``latest``: the job's metrics at their last steps (``store.latest_job_metrics``)."""
    job_id, spec = row["job_id"], row["spec"]
    value = {name: latest[name][1] for name in ("loss", "reward", "tokens_per_s") if name in latest}
    return {
        **{key: row[key] for key in ("job_id", "status", "created_at")},
        "reason": jobs.reason(row),
        "model": spec["sub_jobs"][0]["model_name"] if spec["sub_jobs"] else "",
        "mode": _mode(spec),
        "step": max((step for step, _ in latest.values()), default=None),
        **value,
        "lease": _lease(jobs, job_id),
        "host": _host(jobs, job_id),
    }


def _host(jobs: JobManager, job_id: str) -> str:
    """The model host a running job is on, and how many of its tenant's jobs are on it."""
    live = jobs.live_job(job_id)
    host = jobs.host_of(live) if live is not None else None
    if host is None:
        return "–"
    return f"{host['host_id']} ({host['num_jobs']}/{host['max_jobs']})" if host["shared"] else host["host_id"]


@router.get("/api/jobs")
async def jobs_table(jobs: JobsDep, db: StoreDep, tenancy: TenancyDep, tenant: TenantDep) -> dict:
    latest = store.latest_job_metrics(db)  # one query for every job; rows newest first
    rows = store.list_jobs(db, owner=tenancy.owner_filter(tenant))
    return {"jobs": [_row(jobs, row, latest.get(row["job_id"], {})) for row in reversed(rows)]}


@router.get("/api/jobs/{job_id}")
async def job_detail(job_id: str, jobs: JobsDep, db: StoreDep, tenancy: TenancyDep, tenant: TenantDep) -> dict:
    tenancy.check(tenant, job_id)
    row = jobs.row(job_id)  # 404 for an unknown job; watching a job does not keep its lease alive
    sub_jobs = row["spec"]["sub_jobs"]
    live, log = jobs.live_job(job_id), jobs.job_log(job_id)
    tails = [log.last(s["sub_job_id"], max_lines=_LOG_LINES) for s in sub_jobs]
    entries = {(e.get("ts"), e.get("msg")): e for tail in tails for e in tail}  # job-wide lines once
    return {
        **_row(jobs, row, store.latest_job_metrics(db, job_id=job_id).get(job_id, {})),
        "sub_jobs": [
            {
                **{key: s[key] for key in ("sub_job_id", "job_type", "model_name")},
                "engines": jobs.settings.engines,
                "slots": live.specs[s["sub_job_id"]].num_slots if live is not None else None,
            }
            for s in sub_jobs
        ],
        "queue": [
            {k: r[k] for k in ("request_id", "sub_job_id", "op", "status", "created_at")}
            for r in jobs.requests.open_rows(job_id)
        ],
        "failed": [
            {**failed, "error": jobs.settings.public_text(failed["error"] or "")}
            for failed in store.recent_failed_requests(db, job_id=job_id, limit=_FAILED_SHOWN)
        ],
        "checkpoints": [{k: c[k] for k in _CHECKPOINT_SHOWN} for c in store.list_checkpoints(db, job_id=job_id)],
        "log": sorted(entries.values(), key=lambda e: e.get("ts") or "")[-_LOG_LINES:],
    }
