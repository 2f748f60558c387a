"""Bearer-token checks shared by the route dependency and the ``Idempotency-Key`` middleware.

Both must apply the same rules, or a replayed answer would reach a caller the route itself refuses.
"""

from __future__ import annotations

import hashlib
import hmac

from icefloe.protocol import UnauthenticatedError
from icefloe.service.settings import ServeSettings

__all__ = ["PAT_TOKEN_TYPE", "authenticate", "caller_scope"]

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
