"""The Tinker API on ``icefloe serve``, so the ``tinker`` SDK and its cookbook run unmodified.

It is an app of its own, mounted at :data:`TINKER_PREFIX` with its own auth adapter
(:data:`TINKER_ACCESS`: the SDK sends its key as ``X-API-Key``) and its own error rules (no 409:
the SDK retries every 409 for up to two hours, so a conflict, such as a finished session, a stopped
job or a tenant's limit, answers 400, which it reports at once). The protobuf classes come from the
``tinker`` package (``pip install icefloe[tinker]``); without it every route answers 501 naming that
install.
"""

from __future__ import annotations

import importlib.util

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import State

from icefloe.service.errors import install_error_handlers
from icefloe.service.middleware import Access

__all__ = ["INSTALL_HINT", "TINKER_ACCESS", "TINKER_PREFIX", "tinker_app"]

INSTALL_HINT = "the Tinker API needs the tinker package; pip install 'icefloe[tinker]'"
TINKER_PREFIX = "/api/v1"
TINKER_ACCESS = Access(api_key_header=b"x-api-key")


def tinker_app(state: State) -> FastAPI:
    """The Tinker API's app over the service's ``state`` (its jobs, tenancy and settings), which
    gains ``state.tinker``; or an app of 501s without the extra."""
    app = FastAPI(title="icefloe serve: Tinker API", openapi_url=None)
    app.state = state
    install_error_handlers(app, conflict_status=400)
    if importlib.util.find_spec("tinker") is None:

        async def missing_extra(path: str) -> JSONResponse:
            return JSONResponse({"code": "not_implemented", "message": INSTALL_HINT}, status_code=501)

        app.add_api_route("/{path:path}", missing_extra, methods=["GET", "POST"], include_in_schema=False)
        return app
    from icefloe.service.tinker import routes, runs
    from icefloe.service.tinker.state import TinkerState

    settings = state.settings
    state.tinker = TinkerState(
        state.jobs,
        state.tenancy,
        gap_timeout_s=settings.sequence_gap_timeout_s,
        window=settings.sequence_window,
        held_ahead_bytes=settings.max_held_ahead_mb << 20,
    )
    app.include_router(routes.router)
    app.include_router(runs.router)  # its catch-all last: what no route above serves is refused by name
    return app
