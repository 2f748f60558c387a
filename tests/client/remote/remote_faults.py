"""An httpx transport wrapper that injects faults between the client and a real service.

It is the only fake in these tests and it fakes nothing but failures: every request it does not
sabotage reaches the real ``icefloe serve``.
"""

from __future__ import annotations

import asyncio
import re
import threading
from dataclasses import dataclass

import httpx


@dataclass
class Rule:
    """Sabotage ``times`` requests matching ``method`` + ``path`` (a regex), after letting ``skip`` pass."""

    method: str
    path: str
    # drop_response | cut_upload | unreachable | swallow_chunk | status:<code> | status_after:<code> | timeout | delay
    # | rehash_chunk (the chunk claims another frame hash: a group id reused for a different frame)
    action: str
    times: int = 1
    skip: int = 0
    hits: int = 0


class Faults:
    def __init__(self, *rules: Rule) -> None:
        self.rules = list(rules)
        self._lock = threading.Lock()

    def take(self, request: httpx.Request) -> str | None:
        with self._lock:
            for rule in self.rules:
                if rule.method == request.method and re.search(rule.path, request.url.path):
                    if rule.skip > 0:
                        rule.skip -= 1
                        return None
                    if rule.hits < rule.times:
                        rule.hits += 1
                        return rule.action
        return None

    def wrap(self, inner):
        return FaultyTransport(inner, self)


def _rehashed(request: httpx.Request) -> httpx.Request:
    """The same chunk bytes under a descriptor announcing a different whole-frame SHA-256."""
    import numpy as np

    from icefloe import wire

    frame = request.read()
    descriptor = {k: v for k, v in wire.chunk_descriptor(frame).items() if k != "kind"}
    descriptor["frame_sha256"] = "f" * 64
    payload = np.frombuffer(wire.chunk_payload(frame), dtype=np.uint8)
    content = wire.encode({"payload": payload}, op_metadata={"request_chunk": descriptor})
    headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
    return httpx.Request(request.method, request.url, headers=headers, content=content)


def _synthetic(status: int, request: httpx.Request) -> httpx.Response:
    return httpx.Response(status, json={"code": "unavailable", "message": f"injected {status}"}, request=request)


class FaultyTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner, faults: Faults) -> None:
        self.inner = inner
        self.faults = faults

    def _before(self, action: str, request: httpx.Request) -> httpx.Response | None:
        if action == "cut_upload":
            raise httpx.WriteError("injected: connection cut while uploading", request=request)
        if action == "unreachable":  # a network outage: no connection to the service
            raise httpx.ConnectError("injected: the network is down", request=request)
        if action == "timeout":
            raise httpx.ReadTimeout("injected: no answer", request=request)
        if action == "swallow_chunk":  # the proxy claims the chunk arrived; the service never sees it
            return httpx.Response(200, json={"chunk_cached": True}, request=request)
        if action.startswith("status:"):
            return _synthetic(int(action.split(":")[1]), request)
        return None

    def _after(self, action: str, request: httpx.Request) -> httpx.Response:
        if action == "drop_response":
            raise httpx.RemoteProtocolError("injected: response lost after the service acted", request=request)
        return _synthetic(int(action.split(":")[1]), request)  # status_after:<code>

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        action = self.faults.take(request)
        if action == "rehash_chunk":
            request, action = _rehashed(request), None
        if action == "delay":  # a slow upload: the request arrives late, but intact
            await asyncio.sleep(0.3)
            action = None
        if action is None:
            return await self.inner.handle_async_request(request)
        early = self._before(action, request)
        if early is not None:
            return early
        response = await self.inner.handle_async_request(request)
        await response.aread()
        await response.aclose()
        return self._after(action, request)

    async def aclose(self) -> None:
        await self.inner.aclose()
