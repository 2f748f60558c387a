"""An ``Http`` session whose answers are canned, for the protocol edges a real service does not produce on demand."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from icefloe.client.remote.http import Endpoint, Http
from icefloe.config import RemoteConfig


@contextmanager
def canned(*bodies: Any, status: int = 200) -> Iterator[tuple[Http, list[httpx.Request]]]:
    """Answers each request with the next body in turn; yields the session and the requests it saw."""
    queue, seen = list(bodies), []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json=queue.pop(0))

    backend = RemoteConfig(base_url="http://svc")
    http = Http(Endpoint.from_config(backend), backend, wrap=lambda inner: httpx.MockTransport(answer))
    try:
        yield http, seen
    finally:
        http.close()
