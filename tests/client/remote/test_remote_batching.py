"""Numbered calls that reach the client's I/O loop in one turn leave as one ``requests:batch`` POST."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from icefloe.client.remote.http import Call, Endpoint, Http
from icefloe.protocol import NotFoundError
from icefloe.wire.batch import BATCH_PATH


class Counter(httpx.AsyncBaseTransport):
    """Passes requests on and notes each one's path (a batch is one request)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.inner: httpx.AsyncBaseTransport | None = None

    def wrap(self, inner: httpx.AsyncBaseTransport) -> Counter:
        self.inner = inner
        return self

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert self.inner is not None
        self.paths.append(request.url.path)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        assert self.inner is not None
        await self.inner.aclose()


def _http(service, counter: Counter, batch_bytes: int) -> Http:
    backend = service.config().backend
    http = Http(Endpoint.from_config(backend), backend, wrap=counter.wrap)
    http.batch_bytes = batch_bytes
    return http


def _calls(count: int, path: str = "/capabilities") -> list[Call]:
    return [Call("GET", path, f"call {i}", sequence=f"probe:{i}") for i in range(count)]


async def _together(http: Http, calls: list[Call]) -> list:
    return await asyncio.gather(*(http.send(call) for call in calls), return_exceptions=True)


def test_calls_sent_in_one_loop_turn_travel_as_one_post_and_each_gets_its_answer(service):
    counter = Counter()
    http = _http(service, counter, batch_bytes=1 << 20)
    try:
        replies = http.run(_together(http, _calls(4)))
    finally:
        http.close()
    assert [path.endswith(BATCH_PATH) for path in counter.paths] == [True]
    assert all(reply.status_code == 200 and "ops" in reply.body for reply in replies)


def test_a_part_refused_fails_only_its_own_call(service):
    counter = Counter()
    http = _http(service, counter, batch_bytes=1 << 20)
    try:
        found, missing = http.run(_together(http, [*_calls(1), *_calls(1, "/no-such-job")]))
    finally:
        http.close()
    assert len(counter.paths) == 1
    assert found.status_code == 200
    assert isinstance(missing, NotFoundError) and "no-such-job" in str(missing)


@pytest.mark.parametrize(("batch_bytes", "posts"), [(0, 3), (1, 3), (1 << 20, 1)])
def test_batches_stay_within_their_byte_budget_and_batching_can_be_off(service, batch_bytes, posts):
    counter = Counter()
    http = _http(service, counter, batch_bytes=batch_bytes)
    try:
        replies = http.run(_together(http, _calls(3)))
    finally:
        http.close()
    assert len(counter.paths) == posts
    assert all(reply.status_code == 200 for reply in replies)
