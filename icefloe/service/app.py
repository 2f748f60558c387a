"""Build the FastAPI app of ``icefloe serve`` and run it on uvicorn.

The jobs a previous process left active are failed when the app starts, which :func:`serve` and
:class:`ServerThread` do only once its socket is bound: lock, bind, recover, so a service that
cannot start harms nothing. The API docs' assets come from the ``fastapi-offline`` package.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import socket
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.routing import Mount

from icefloe.service.edge import api_layers, install_edge, service_layers
from icefloe.service.errors import install_error_handlers
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.joblog import ENGINE_LOGGER, TokenRedactor
from icefloe.service.jobs import JobManager
from icefloe.service.lifecycle import fail_interrupted_jobs
from icefloe.service.logins import Logins
from icefloe.service.middleware import training_access
from icefloe.service.openai import OPENAI_ACCESS, PREFIXES, openai_app
from icefloe.service.routes import capabilities, checkpoints, compute, jobs, metrics, operations, requests
from icefloe.service.routes.ui import install_ui
from icefloe.service.sequencing import Sequencing
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database, DataDirInUse, lock_data_dir, purge_expired
from icefloe.service.tenants import Tenancy
from icefloe.service.tinker import TINKER_ACCESS, TINKER_PREFIX, tinker_app

__all__ = ["ServerThread", "base_url", "create_app", "serve", "uvicorn_options"]

_log = logging.getLogger("icefloe.service")
_REDACTED_LOGGERS = ("", "icefloe", "icefloe.service", "uvicorn", "uvicorn.error", "uvicorn.access")


def _redact(redactor: TokenRedactor, *, on: bool) -> None:
    """Attach the token filter to (or detach it from) the loggers and handlers a request could write through."""
    for name in _REDACTED_LOGGERS:
        logger = logging.getLogger(name)
        for target in (logger, *logger.handlers):
            target.removeFilter(redactor)  # never twice
            if on:
                target.addFilter(redactor)


def create_app(settings: ServeSettings, *, pool: SlotPool | None = None) -> FastAPI:
    """The service app for ``settings``; ``pool`` overrides slot detection (tests pin CPU slots).
    Raises :class:`DataDirInUse` when another service holds the data dir."""
    lock_fd = lock_data_dir(settings.data_dir)
    db = Database(settings.data_dir / "icefloe.sqlite3")
    purge_expired(db, idempotency_ttl_s=settings.idempotency_ttl_s)
    manager = JobManager(settings, db, pool or SlotPool.detect(settings.slots))
    redactor = TokenRedactor(settings.token_values())
    manager.log_router.addFilter(redactor)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        _redact(redactor, on=True)
        fail_interrupted_jobs(db)
        manager.watch()
        engine_logs = logging.getLogger(ENGINE_LOGGER)
        manager.log_router.attach(engine_logs)
        if settings.engines == "process":  # import torch in the forkserver now, not when the first job comes
            from icefloe.service.hosts.process import warm_forkserver

            threading.Thread(target=warm_forkserver, name="icefloe-forkserver-warmup", daemon=True).start()
        try:
            yield
        finally:
            await asyncio.to_thread(manager.close)
            db.close()
            unlock()
            manager.log_router.detach(engine_logs)
            _redact(redactor, on=False)

    app = FastAPIOffline(title="icefloe serve", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.db = db
    app.state.jobs = manager
    app.state.tenancy = Tenancy(settings, db)
    app.state.sequencing = Sequencing(
        gap_timeout_s=settings.sequence_gap_timeout_s, window=settings.sequence_window, unordered=_not_running(manager)
    )
    app.state.logins = Logins(
        ttl_s=settings.ui_session_ttl_s, max_failures_per_minute=settings.max_failed_logins_per_minute
    )
    unlock = weakref.finalize(app, os.close, lock_fd)  # at lifespan exit, or when an app never run is dropped
    install_error_handlers(app)
    app.add_api_route("/health", _health, methods=["GET"], tags=["health"])  # open: see middleware.OPEN_PATH
    app.include_router(checkpoints.files_router)
    app.include_router(operations.statements_router)
    # The data plane first (routes are matched in order); capabilities before jobs: /capacity must win over /{job_id}
    for module in (compute, requests, operations, capabilities, jobs, checkpoints, metrics):
        app.include_router(module.router)
    app.include_router(metrics.prometheus_router)  # GET /metrics
    app.router.routes[:0] = compute.STEP_ROUTES  # matched first: see icefloe.service.routes.compute
    install_ui(app)  # the dashboard, /ui
    # Each API has a stack of its own. The Tinker and OpenAI APIs' apps (each with its own auth adapter
    # and error rules) are mounted in front of this app's stack: the service's outermost layers hand
    # their requests over. Neither takes Icefloe-Sequence turns (Tinker orders by seq_id, from the body).
    edge = {"db": db, "logins": app.state.logins}
    tinker = tinker_app(app.state)
    openai = openai_app(app.state)  # after Tinker's: it serves Tinker's checkpoints
    for api, access, too_large in (
        (tinker, TINKER_ACCESS, "split the data into smaller calls"),
        (openai, OPENAI_ACCESS, "send fewer or shorter prompts per request"),
    ):
        install_edge(
            api,
            api_layers(
                settings,
                **edge,
                access=access,
                batches=False,
                routes_parse_json=True,
                sequencing=None,
                waited_answers=False,
                json_too_large=too_large,
            ),
        )
    mounts = [Mount(TINKER_PREFIX, tinker), *(Mount(prefix, openai) for prefix in PREFIXES)]
    training = api_layers(
        settings,
        **edge,
        access=training_access(settings),
        batches=True,
        routes_parse_json=False,
        sequencing=app.state.sequencing,
        waited_answers=True,
        json_too_large="send tensors as binary DSSST1 frames (application/octet-stream)",
    )
    install_edge(app, [*service_layers(settings, mounts), *training])
    _redact(redactor, on=True)
    return app


def _not_running(manager: JobManager) -> Callable[[dict[str, Any]], bool]:
    """True for a request on a job this process does not run: after a restart, the job's numbered POSTs
    have no earlier number to wait for (the session was lost with the old process)."""

    def not_running(scope: dict[str, Any]) -> bool:
        job_id = scope.get("path_params", {}).get("job_id")
        return job_id is not None and manager.live_job(job_id) is None

    return not_running


async def _health() -> dict[str, str]:
    return {"status": "ok"}


class ServerThread:
    """Run an app on uvicorn in a thread on a loopback port (0: a free one): ``with ServerThread(app) as url:``."""

    def __init__(self, app: Any, *, log_level: str = "warning", port: int = 0) -> None:
        import uvicorn

        settings = getattr(getattr(app, "state", None), "settings", None)
        connections = uvicorn_options(settings) if isinstance(settings, ServeSettings) else {}
        self._config = uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level=log_level, lifespan="on", **connections
        )
        self._server = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None
        self.base_url = ""

    def __enter__(self) -> str:
        sockets = [self._config.bind_socket()]  # bound before the app starts (and recovers)
        self._thread = threading.Thread(target=self._server.run, args=(sockets,), name="icefloe-serve", daemon=True)
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("icefloe serve did not start; see the log above for the cause")
            self._thread.join(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.base_url = base_url(host, port)
        return self.base_url

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()


def uvicorn_options(settings: ServeSettings) -> dict[str, Any]:
    """How uvicorn treats the service's connections: read deadlines (:mod:`icefloe.service.connections`),
    and ``X-Forwarded-*`` believed only from ``settings.forwarded_allow_ips`` (uvicorn's default
    believes any loopback peer, so a client beside the service could name any address it liked)."""
    from icefloe.service.connections import deadline_protocol

    protocol = deadline_protocol(header_timeout_s=settings.header_timeout_s, body_timeout_s=settings.body_timeout_s)
    proxies = list(settings.forwarded_allow_ips)
    return {"http": protocol, "proxy_headers": bool(proxies), "forwarded_allow_ips": proxies or None}


def base_url(host: str, port: int) -> str:
    """``http://host:port``, with an IPv6 host in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` for :func:`serve`.

    Raises:
        SystemExit: the port is taken or not ours to bind, in one line naming the address and the fix.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        busy = " (another process listens there: stop it, or pass --port with a free port)"
        raise SystemExit(
            f"icefloe serve: cannot listen on {base_url(host, port)}: {exc.strerror or exc}"
            + (busy if exc.errno == errno.EADDRINUSE else "")
        ) from None
    sock.set_inheritable(True)
    return sock


def serve(settings: ServeSettings, *, log_level: str = "info", sock: socket.socket | None = None) -> None:
    """Run the service in the foreground until interrupted: lock the data dir, bind (unless ``sock`` is
    already bound), then recover and serve."""
    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    try:
        app = create_app(settings)
    except DataDirInUse as exc:
        raise SystemExit(f"icefloe serve: {exc}") from None
    # The service's own lines (job state changes, one per training step) go to the console as uvicorn's do.
    service_log = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    log_config = {**LOGGING_CONFIG, "loggers": {**LOGGING_CONFIG["loggers"], "icefloe.service": service_log}}
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        log_config=log_config,
        access_log=settings.access_log,
        **uvicorn_options(settings),
    )
    url = base_url(settings.host, settings.port)
    _log.info("icefloe serve on %s (data in %s)", url, settings.data_dir)
    _log.info("dashboard: %s/ui", url)
    # What is alive now (torch, transformers, the app) lives as long as the process: a full collection
    # that walked it each time paused every request for 120-150 ms.
    gc.freeze()
    uvicorn.Server(config).run(sockets=[sock or listen(settings.host, settings.port)])
