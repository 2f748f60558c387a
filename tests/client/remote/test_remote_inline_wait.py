"""The ``inline_wait`` and ``sequenced_submit`` extensions from the client side, against a real service.

With numbered POSTs (``sequenced_submit``) every op is sent at once, each with ``?wait=`` and its
number, and none is polled. Without numbering (the managed endpoint) an op's POST waits for the
acceptance of the one before it, carries neither number nor ``wait``, and is polled. A service
that does not advertise ``inline_wait`` is never sent ``wait`` on a POST.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.parse

import httpx
import pytest

from icefloe.client import AsyncClient, Client, build_batch
from icefloe.client.transports.remote import RemoteTransport
from icefloe.protocol import InvalidRequestError
from icefloe.wire.batch import BATCH_PATH, unpack


class Recorder(httpx.AsyncBaseTransport):
    """Passes every request on and notes (method, last path segment, query params + sequence header);
    a batch of requests is noted as the requests it carries.

    ``hide`` names extensions struck from the service's capabilities, so the client sees a service
    without them (the managed endpoint advertises none).
    """

    def __init__(self, *hide: str) -> None:
        self.hide = set(hide)
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self._lock = threading.Lock()
        self.inner: httpx.AsyncBaseTransport | None = None

    def wrap(self, inner: httpx.AsyncBaseTransport) -> Recorder:
        self.inner = inner
        return self

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert self.inner is not None
        if request.url.path.endswith(BATCH_PATH):  # note each op the batch carries, as if it came alone
            for part, _ in unpack(await request.aread()):
                query = dict(urllib.parse.parse_qsl(part["query"]))
                self._note(part["method"], part["path"], query, dict(part["headers"]).get("Icefloe-Sequence"))
        else:
            self._note(
                request.method, request.url.path, dict(request.url.params), request.headers.get("icefloe-sequence")
            )
        name = request.url.path.rstrip("/").rsplit("/", 1)[-1]
        response = await self.inner.handle_async_request(request)
        if name != "capabilities" or not self.hide:
            return response
        body = json.loads(await response.aread())
        body["extensions"] = {k: v for k, v in body["extensions"].items() if k not in self.hide}
        return httpx.Response(response.status_code, json=body)

    def _note(self, method: str, path: str, params: dict[str, str], sequence: str | None) -> None:
        name = "poll" if "/requests/" in path else path.rstrip("/").rsplit("/", 1)[-1]
        if sequence is not None:
            params["sequence"] = sequence
        with self._lock:
            self.seen.append((method, name, params))

    async def aclose(self) -> None:
        assert self.inner is not None
        await self.inner.aclose()

    def posts(self, name: str) -> list[dict[str, str]]:
        return [params for method, seen, params in self.seen if method == "POST" and seen == name]

    def polls(self) -> int:
        return sum(1 for _, name, _ in self.seen if name == "poll")


def _batch() -> dict:
    return build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0)


def _pipelined(service, recorder: Recorder) -> tuple[dict, dict, dict]:
    """fwd_bwd, step and sync_weights called together on one AsyncClient."""
    config = service.config()

    async def run() -> tuple[dict, dict, dict]:
        async with AsyncClient(config, transport=RemoteTransport(config, wrap_http_transport=recorder.wrap)) as client:
            return await asyncio.gather(client.fwd_bwd(_batch()), client.step(), client.sync_weights())

    return asyncio.run(run())


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


def test_remote_numbered_posts_all_go_at_once_and_wait_inline(service):
    recorder = Recorder()
    trained, stepped, synced = _pipelined(service, recorder)
    assert trained["loss"] is not None and stepped["global_step"] == 1 and synced["policy_version"] == 1
    posted = recorder.posts("forward-backward") + recorder.posts("step") + recorder.posts("operation")
    assert all("wait" in params for params in posted)
    sessions = {params["sequence"].rsplit(":", 1)[0] for params in posted}
    assert len(sessions) == 1
    assert [int(params["sequence"].rsplit(":", 1)[1]) for params in posted] == [0, 1, 2]
    assert recorder.polls() == 0


def test_remote_without_numbering_each_post_waits_for_the_acceptance_before_it(service):
    recorder = Recorder("sequenced_submit")
    trained, stepped, synced = _pipelined(service, recorder)
    assert trained["loss"] is not None and stepped["global_step"] == 1 and stepped["grad_norm"] > 0
    assert synced["policy_version"] == 1
    posts = [(name, params) for method, name, params in recorder.seen if method == "POST"][1:-1]  # create ... cancel
    assert [name for name, _ in posts] == ["forward-backward", "step", "operation"]
    assert not any("wait" in params or "sequence" in params for _, params in posts)
    assert recorder.polls() >= 3  # every result came by poll


def test_remote_inline_wait_is_not_used_unless_advertised(service):
    recorder = Recorder("inline_wait")
    config = service.config()
    with Client(config, transport=RemoteTransport(config, wrap_http_transport=recorder.wrap)) as client:
        assert client.fwd_bwd(_batch())["loss"] is not None
        assert client.step()["global_step"] == 1
        assert client.sync_weights()["policy_version"] == 1
    for name in ("forward-backward", "step", "operation"):
        assert [("wait" in params) for params in recorder.posts(name)] == [False], name
    assert recorder.polls() >= 3


def test_remote_an_op_refused_when_called_takes_no_number(service):
    """forward(reference=True) without a reference role is refused in the client: the step after it is not held."""
    recorder = Recorder()
    config = service.config()

    async def run() -> dict:
        async with AsyncClient(config, transport=RemoteTransport(config, wrap_http_transport=recorder.wrap)) as client:
            with pytest.raises(InvalidRequestError, match="reference role"):
                client.forward(_batch(), reference=True)
            trained = client.fwd_bwd(_batch())
            return await client.step(), await trained

    assert asyncio.run(run())[0]["global_step"] == 1
    assert [params["sequence"].rsplit(":", 1)[1] for params in recorder.posts("step")] == ["1"]
