"""One APIRouter per resource, each under the training API's path prefix and its bearer-token check."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from icefloe.service.deps import require_token

__all__ = ["API_PREFIX", "api_router"]

# Any database / schema / endpoint names are accepted: one service answers for all of them.
API_PREFIX = "/api/v2/databases/{database}/schemas/{schema}/{endpoint}"


def api_router(tag: str) -> APIRouter:
    """A router under the training-API prefix whose every route needs a valid bearer token."""
    return APIRouter(prefix=API_PREFIX, tags=[tag], dependencies=[Depends(require_token)])
