"""The ``inline_wait`` and ``sequenced_submit`` extensions from the client side, against a real service.

An op nobody queued behind posts with ``?wait=`` and is answered by its POST. With numbered POSTs
(``sequenced_submit``) every op is sent at once, each with ``?wait=`` and its number, and none is
polled. Without them, an op with a successor posts without ``?wait=`` (the successor is sent at
acceptance) and is polled. A service that does not advertise ``inline_wait`` is never sent
``wait`` on a POST.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import httpx

from icefloe.client import AsyncClient, Client, build_batch
from icefloe.client.transports.remote import RemoteTransport
from icefloe.protocol import InvalidRequestError


class Recorder(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """Passes every request on and notes (method, last path segment, query params)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self.inner = None

    def wrap(self, inner):
        self.inner = inner
        return self

    def _note(self, request: httpx.Request) -> None:
        segment = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        name = "poll" if "/requests/" in request.url.path else segment
        params = dict(request.url.params)
        if "icefloe-sequence" in request.headers:
            params["sequence"] = request.headers["icefloe-sequence"]
        with self._lock:
            self.seen.append((request.method, name, params))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self._note(request)
        return self.inner.handle_request(request)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._note(request)
        return await self.inner.handle_async_request(request)

    def close(self) -> None:
        self.inner.close()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def posts(self, name: str) -> list[dict[str, str]]:
        return [params for method, seen, params in self.seen if method == "POST" and seen == name]

    def polls(self) -> int:
        return sum(1 for _, name, _ in self.seen if name == "poll")


def _batch() -> dict:
    return build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0)


def test_remote_inline_wait_answers_awaited_ops_in_their_post(service):
    recorder = Recorder()
    config = service.config()
    with Client(config, transport=RemoteTransport(config, wrap_http_transport=recorder.wrap)) as client:
        assert client.fwd_bwd(_batch())["loss"] is not None
        assert client.step()["global_step"] == 1
        assert len(client.generate([[1, 2, 3]], {"max_tokens": 2, "seed": 0})) == 1
        assert client.sync_weights()["policy_version"] == 1
    for name in ("forward-backward", "step", "generate", "operation"):
        assert [("wait" in params) for params in recorder.posts(name)] == [True], name
    assert recorder.polls() == 0


def _pipelined(transport: RemoteTransport, config, *, numbered: bool) -> tuple[dict, dict]:
    """fwd_bwd and step gathered; ``numbered=False`` is what a service without sequenced_submit offers."""

    async def run() -> tuple[dict, dict]:
        async with AsyncClient(config, transport=transport) as client:
            await client.open()
            if not numbered:
                transport._service = dataclasses.replace(transport._service, sequenced_submit=False)
            return await asyncio.gather(client.fwd_bwd(_batch()), client.step())

    return asyncio.run(run())


def test_remote_ops_of_one_loop_turn_share_one_numbered_post_and_wait_inline(service):
    recorder = Recorder()
    config = service.config()
    transport = RemoteTransport(config, wrap_http_transport=recorder.wrap)
    trained, stepped = _pipelined(transport, config, numbered=True)
    assert trained["loss"] is not None and stepped["global_step"] == 1 and stepped["grad_norm"] > 0
    assert recorder.posts("forward-backward") == recorder.posts("step") == []
    [posted] = recorder.posts("batch")
    assert "wait" in posted and posted["sequence"].endswith(":0")
    assert recorder.polls() == 0
    assert service.request_counts(transport.job_id) == {"forward-backward": 1, "step": 1}


def test_remote_numbered_posts_all_go_at_once_and_wait_inline(service):
    recorder = Recorder()
    config = service.config(batch_training_ops=False)
    transport = RemoteTransport(config, wrap_http_transport=recorder.wrap)
    trained, stepped = _pipelined(transport, config, numbered=True)
    assert trained["loss"] is not None and stepped["global_step"] == 1
    posted = recorder.posts("forward-backward") + recorder.posts("step")
    assert all("wait" in params for params in posted)
    session_0, number_0 = posted[0]["sequence"].split(":")
    session_1, number_1 = posted[1]["sequence"].split(":")
    assert session_0 == session_1 and (int(number_0), int(number_1)) == (0, 1)
    assert recorder.polls() == 0


def test_remote_inline_wait_skips_an_op_that_has_a_successor(service):
    recorder = Recorder()
    config = service.config()
    transport = RemoteTransport(config, wrap_http_transport=recorder.wrap)
    trained, stepped = _pipelined(transport, config, numbered=False)
    assert trained["loss"] is not None and stepped["global_step"] == 1
    assert ["wait" in params for params in recorder.posts("forward-backward")] == [False]
    assert ["wait" in params for params in recorder.posts("step")] == [True]
    assert not any("sequence" in params for params in recorder.posts("step"))
    assert recorder.polls() >= 1  # the forward-backward result came by poll


def test_remote_inline_wait_is_not_used_unless_advertised(service):
    recorder = Recorder()
    config = service.config()
    transport = RemoteTransport(config, wrap_http_transport=recorder.wrap)
    with Client(config, transport=transport) as client:
        client.open()
        # what a service without the extension (the managed endpoint) advertises
        transport._service = dataclasses.replace(transport._service, inline_wait=False)
        assert client.fwd_bwd(_batch())["loss"] is not None
        assert client.step()["global_step"] == 1
        assert client.sync_weights()["policy_version"] == 1
    for name in ("forward-backward", "step", "operation"):
        assert [("wait" in params) for params in recorder.posts(name)] == [False], name
    assert recorder.polls() >= 3


def test_remote_numbered_op_that_fails_before_its_post_is_skipped_so_later_ops_are_not_held(service):
    """forward(reference=True) without a reference role fails in the client, after taking number 0."""
    recorder = Recorder()
    config = service.config()
    transport = RemoteTransport(config, wrap_http_transport=recorder.wrap)

    async def run() -> list:
        async with AsyncClient(config, transport=transport) as client:
            await client.open()
            return await asyncio.gather(client.forward(_batch(), reference=True), client.step(), return_exceptions=True)

    failed, stepped = asyncio.run(run())
    assert isinstance(failed, InvalidRequestError) and "reference role" in str(failed)
    assert stepped["global_step"] == 1  # not held 30 s and refused with sequence_gap
    skips = recorder.posts("operation")
    step_number = int(recorder.posts("step")[0]["sequence"].rsplit(":", 1)[1])
    assert [int(params["sequence"].rsplit(":", 1)[1]) for params in skips] == [step_number - 1]
