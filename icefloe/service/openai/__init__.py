"""The OpenAI-compatible API on ``icefloe serve``: ``/completions``, ``/chat/completions`` and ``/models``
under ``/oai/v1`` (and ``/v1``), so the ``openai`` SDK, eval harnesses and chat UIs talk to any base
model or checkpoint of either API.

It is a mounted sub-app with its own error rules (OpenAI's error shape). Its callers authenticate
as the training API's do, with ``Authorization: Bearer <token>`` (the SDK's ``api_key``), checked by
the service's token layer, which names the tenant every lookup takes.
"""

from __future__ import annotations

from fastapi import FastAPI

from icefloe.service.openai.errors import install_error_handlers
from icefloe.service.openai.models import Loaded

__all__ = ["PREFIXES", "install_openai"]

PREFIXES = ("/oai/v1", "/v1")  # a client's base_url: http://host:port/oai/v1


def install_openai(app: FastAPI) -> None:
    """Mount the endpoint on ``app`` under each of :data:`PREFIXES`, on the app's jobs and tenants."""
    from icefloe.service.openai import routes

    sub = FastAPI(title="icefloe serve: OpenAI-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    state = app.state
    sub.state.loaded = Loaded(state.jobs, state.tenancy, getattr(state, "tinker", None))
    install_error_handlers(sub, state.settings.public_text)
    sub.include_router(routes.router)
    for prefix in PREFIXES:
        app.mount(prefix, sub)
