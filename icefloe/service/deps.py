"""Named dependencies, so a route's signature lists what it needs, and the bearer-token check.

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency on its thread pool,
and that hop alone cost about a millisecond per call on a loaded machine. The token check is
shared with the ``Idempotency-Key`` layer, which must apply the same rules before any replay.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Header, Request

from icefloe.protocol import UnauthenticatedError
from icefloe.service.jobs import JobManager
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database

__all__ = [
    "PAT_TOKEN_TYPE",
    "AuthDep",
    "JobsDep",
    "OctetBody",
    "SettingsDep",
    "StoreDep",
    "authenticate",
    "caller_scope",
    "require_token",
]

PAT_TOKEN_TYPE = "PROGRAMMATIC_ACCESS_TOKEN"


def authenticate(settings: ServeSettings, authorization: str | None, token_type: str | None) -> str | None:
    """The configured token the caller presented, or None when auth is off; 401 otherwise.

    Accepts ``Authorization: Bearer <token>``, optionally with the PAT form's
    ``X-Snowflake-Authorization-Token-Type: PROGRAMMATIC_ACCESS_TOKEN``.
    """
    if not settings.auth_enabled:
        return None
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise UnauthenticatedError("missing bearer token; send 'Authorization: Bearer <token>'")
    if token_type not in (None, PAT_TOKEN_TYPE):
        raise UnauthenticatedError(f"X-Snowflake-Authorization-Token-Type must be {PAT_TOKEN_TYPE} when sent")
    candidate = presented.strip().encode()
    matched = None
    for token in settings.token_values():  # compare with every token, so timing says nothing about which
        if hmac.compare_digest(candidate, token.encode()):
            matched = token
    if matched is None:
        raise UnauthenticatedError("the bearer token is not valid for this service")
    return matched


def caller_scope(token: str | None) -> str:
    """A stable, non-reversible id of the caller's token ('' without auth), to scope stored records."""
    if token is None:
        return ""
    return hashlib.sha256(b"icefloe-caller\0" + token.encode()).hexdigest()


async def _settings(request: Request) -> ServeSettings:
    return request.app.state.settings


async def _jobs(request: Request) -> JobManager:
    return request.app.state.jobs


async def _store(request: Request) -> Database:
    return request.app.state.db


async def require_token(
    request: Request,
    authorization: Annotated[str | None, Header()] = None,
    x_snowflake_authorization_token_type: Annotated[str | None, Header()] = None,
) -> None:
    """401 unless ``Authorization: Bearer <token>`` matches a configured token (PAT form accepted)."""
    authenticate(request.app.state.settings, authorization, x_snowflake_authorization_token_type)


async def _octet_body(request: Request) -> bytes:
    return await request.body()  # the size cap is enforced while reading (see middleware.BodyLimit)


SettingsDep = Annotated[ServeSettings, Depends(_settings)]
JobsDep = Annotated[JobManager, Depends(_jobs)]
StoreDep = Annotated[Database, Depends(_store)]
AuthDep = Annotated[None, Depends(require_token)]
OctetBody = Annotated[bytes, Depends(_octet_body)]
