"""The Tinker API (``/api/v1``) on ``icefloe serve``, so the ``tinker`` SDK and its cookbook run unmodified.

The protobuf classes come from the ``tinker`` package (``pip install icefloe[tinker]``); without it
every ``/api/v1`` route answers 501 naming that install.
"""

from __future__ import annotations

import importlib.util

from fastapi import FastAPI
from fastapi.responses import JSONResponse

__all__ = ["install_tinker"]

INSTALL_HINT = "the Tinker API needs the tinker package; pip install 'icefloe[tinker]'"


def install_tinker(app: FastAPI) -> None:
    """Serve the Tinker API on ``app`` (state on ``app.state.tinker``), or 501s without the extra."""
    if importlib.util.find_spec("tinker") is None:

        async def missing_extra(path: str) -> JSONResponse:
            return JSONResponse({"code": "not_implemented", "message": INSTALL_HINT}, status_code=501)

        app.add_api_route("/api/v1/{path:path}", missing_extra, methods=["GET", "POST"], include_in_schema=False)
        return
    from icefloe.service.tinker import routes, runs
    from icefloe.service.tinker.state import TinkerState

    gap_timeout_s = app.state.settings.sequence_gap_timeout_s
    window = app.state.settings.sequence_window
    app.state.tinker = TinkerState(app.state.jobs, app.state.tenancy, gap_timeout_s=gap_timeout_s, window=window)
    app.include_router(routes.router)
    app.include_router(runs.router)  # its catch-all last: what no route above serves is refused by name
