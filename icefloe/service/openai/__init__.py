"""The OpenAI-compatible API on ``icefloe serve``: ``/completions``, ``/chat/completions`` and ``/models``
under ``/oai/v1`` (and ``/v1``), so the ``openai`` SDK, eval harnesses and chat UIs talk to any base
model or checkpoint of either API.

It is an app of its own, mounted at each of :data:`PREFIXES`, with its own auth adapter
(:data:`OPENAI_ACCESS`: the SDK sends its ``api_key`` as ``Authorization: Bearer``) and its own error
rules: every refusal, a missing token's included, in OpenAI's ``{"error": {...}}`` shape.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.datastructures import State

from icefloe.service.middleware import Access
from icefloe.service.openai.errors import install_error_handlers
from icefloe.service.openai.served import Loaded

__all__ = ["OPENAI_ACCESS", "PREFIXES", "openai_app"]

PREFIXES = ("/oai/v1", "/v1")  # a client's base_url: http://host:port/oai/v1
OPENAI_ACCESS = Access()  # a bearer token on every path


def openai_app(state: State) -> FastAPI:
    """The OpenAI API's app over the service's ``state`` (its jobs, tenancy, settings and, when
    mounted first, the Tinker API's checkpoints), which gains ``state.openai``: the loaded models."""
    from icefloe.service.openai import routes

    app = FastAPI(title="icefloe serve: OpenAI-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    app.state = state
    tinker = getattr(state, "tinker", None)
    state.openai = Loaded(state.jobs, state.tenancy, tinker, max_loaded=state.settings.max_loaded_models)
    install_error_handlers(app, state.settings.public_text)
    app.include_router(routes.router)
    return app
