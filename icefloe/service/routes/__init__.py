"""One APIRouter per resource, each under the training API's path prefix.

The bearer token is checked before any route runs (:class:`icefloe.service.middleware.RequireToken`).
"""

from __future__ import annotations

from fastapi import APIRouter

__all__ = ["API_PREFIX", "api_router"]

# Any database / schema / endpoint names are accepted: one service answers for all of them.
API_PREFIX = "/api/v2/databases/{database}/schemas/{schema}/{endpoint}"


def api_router(tag: str) -> APIRouter:
    """A router under the training-API prefix."""
    return APIRouter(prefix=API_PREFIX, tags=[tag])
