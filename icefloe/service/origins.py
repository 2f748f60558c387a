"""Which ``Host`` and ``Origin`` a request may carry, so that a web page cannot drive the service.

A browser sends a page's requests to any address the page names, simple ones (a ``text/plain``
POST) without asking first, and a page can re-point its own name at 127.0.0.1 (DNS rebinding) to
read the answers too. With auth off nothing else stands in the way, so :class:`LocalOnly` answers
only ``Host`` values that name the address the connection came in on (any loopback name when that
is loopback) or ``--public-url``'s host (421 otherwise), and refuses a change (any method but GET,
HEAD, OPTIONS) whose ``Origin``, or lacking one ``Referer``, is another origin (403). A request
with neither header is not a page's (curl, the SDKs) and passes. :func:`foreign_origin` is the same
origin test for the login form, which runs with auth on.
"""

from __future__ import annotations

import ipaddress
import urllib.parse

from starlette.types import ASGIApp, Receive, Scope, Send

from icefloe.protocol import ForbiddenError, MisdirectedRequestError
from icefloe.service.errors import send_error

__all__ = ["LocalOnly", "foreign_origin"]

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_DEFAULT_PORTS = {"http": 80, "https": 443}

Address = tuple[str, int]  # (host name or IP, lower case and without brackets; port)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1").strip()
    return None


def _address(netloc: str, scheme: str) -> Address | None:
    """``host[:port]`` as an :data:`Address` (the scheme's port when none is written); None when malformed."""
    if not netloc or any(c in netloc for c in "/?#@\\ "):
        return None
    try:
        parts = urllib.parse.urlsplit(f"//{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname, port if port is not None else _DEFAULT_PORTS.get(scheme, 80)


def _origin(url: str) -> tuple[str, Address] | None:
    """(scheme, address) of an origin or URL; None for ``null`` or anything without a host."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    address = _address(parts.netloc, scheme) if scheme in _DEFAULT_PORTS else None
    return (scheme, address) if address is not None else None


def _is_loopback(name: str) -> bool:
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def foreign_origin(scope: Scope, public_url: str | None) -> str | None:
    """The origin a browser says ``scope`` comes from (its ``Origin``, else its ``Referer``'s), when that
    is neither the service's origin as the request addressed it (scheme and ``Host``) nor ``public_url``'s;
    None when it is one of those, or when the request names no origin (not a page's)."""
    sent = _header(scope, b"origin")
    if sent is None:
        referer = _header(scope, b"referer")
        if referer is None:
            return None
        sent = referer
    claimed = _origin(sent)
    scheme = scope.get("scheme", "http")
    host = _header(scope, b"host")
    own = {(scheme, _address(host, scheme))} if host is not None else set()
    if public_url is not None:
        own.add(_origin(public_url))
    return None if claimed is not None and claimed in own else sent


class LocalOnly:
    """With auth off: 421 for a ``Host`` that names no address of the service, 403 for a change a page
    of another origin sent (see the module docstring). Both close the connection: the body is unread."""

    def __init__(self, app: ASGIApp, *, public_url: str | None) -> None:
        self.app = app
        self.public_url = public_url
        self._public = _origin(public_url) if public_url else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refused = self._refusal(scope)
            if refused is not None:
                await send_error(scope, receive, send, refused, close=True)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> ForbiddenError | None:
        host = _header(scope, b"host")
        if host is None or not self._serves(scope, host):
            return MisdirectedRequestError(
                f"this service does not answer for Host {host!r}: it runs without tokens, so it answers only "
                "requests addressed to it by its own address (a loopback name when it listens on loopback); "
                "reach it by that address, or start it with --public-url naming the host you use"
            )
        if scope["method"] not in _SAFE_METHODS:
            origin = foreign_origin(scope, self.public_url)
            if origin is not None:
                return ForbiddenError(
                    f"a change sent by a page of another origin ({origin!r}) is refused: this service runs "
                    "without tokens, so any site could act through the browser; send it without an Origin "
                    "header (curl, the SDKs), from the service's own pages, or set tokens"
                )
        return None

    def _serves(self, scope: Scope, host: str) -> bool:
        if self._public is not None and _address(host, self._public[0]) == self._public[1]:
            return True  # through a proxy, the scheme it was asked in is the public URL's
        scheme = scope.get("scheme", "http")
        asked = _address(host, scheme)
        if asked is None:
            return False
        server = scope.get("server")
        if not server:
            return False
        name, port = str(server[0]).lower(), server[1] if server[1] is not None else _DEFAULT_PORTS.get(scheme, 80)
        names = (_LOOPBACK_NAMES | {name}) if _is_loopback(name) else {name}
        return asked[1] == port and asked[0] in names
