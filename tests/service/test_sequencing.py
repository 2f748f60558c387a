"""The ``sequenced_submit`` extension: numbered POSTs are queued in number order, whatever order they arrive in."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from icefloe import wire
from icefloe.service.sequencing import SubmitOrder, release_turn

from .service_batches import small_batch
from .service_client import Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


def _numbered(session: str, number: int) -> dict[str, str]:
    return {"Icefloe-Sequence": f"{session}:{number}"}


async def _held_step(api: Api, job_id: str, session: str, number: int):
    """A numbered step POST that asks for its answer inline (?wait=)."""
    return await api.call("POST", f"/{job_id}/step", json={}, params={"wait": 30}, headers=_numbered(session, number))


def _recorded_ops(app, job_id: str) -> list[str]:
    rows = app.state.db.fetch_all("SELECT op, created_at FROM requests WHERE job_id = ? ORDER BY created_at", (job_id,))
    return [row["op"] for row in rows]


async def test_a_step_that_arrives_first_waits_for_the_forward_backward_numbered_before_it(data_dir):
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running()
        session = uuid.uuid4().hex
        step = asyncio.ensure_future(_held_step(api, job_id, session, 1))
        await asyncio.sleep(0.3)  # the step has arrived and is held
        assert not step.done() and _recorded_ops(app, job_id) == []
        trained = await api.call(
            "POST",
            f"/{job_id}/forward-backward",
            content=wire.encode(small_batch()),
            params={"wait": 30},
            headers={"content-type": "application/octet-stream", **_numbered(session, 0)},
        )
        stepped = (await step).json()
        assert trained.json()["status"] == "done" and stepped["status"] == "done"
        assert _recorded_ops(app, job_id) == ["forward-backward", "step"]
        assert stepped["result"]["grad_norm"] > 0  # the gradients were there when the step ran


async def test_a_missing_number_is_refused_after_the_gap_timeout_and_nothing_runs(data_dir):
    app = make_app(data_dir, sequence_gap_timeout_s=0.3)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running()
        refused = await api.call("POST", f"/{job_id}/step", json={}, headers=_numbered("lonely", 1), check=False)
        assert refused.status_code == 409 and refused.json()["code"] == "sequence_gap"
        assert "POST 0" in refused.json()["message"] and "sequence-skip" in refused.json()["message"]
        assert _recorded_ops(app, job_id) == []


async def test_a_sequence_skip_takes_the_place_of_a_post_that_will_never_come(data_dir):
    app = make_app(data_dir, sequence_gap_timeout_s=30)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running()
        session = uuid.uuid4().hex
        step = asyncio.ensure_future(_held_step(api, job_id, session, 1))
        await asyncio.sleep(0.2)
        skip = {"operation_type": "sequence-skip", "payload": {}}
        skipped = await api.call("POST", f"/{job_id}/operation", json=skip, headers=_numbered(session, 0))
        assert skipped.json() == {"status": "skipped"}
        assert (await step).json()["result"]["global_step"] == 1


async def test_a_number_already_let_in_passes_at_once_and_unnumbered_posts_never_wait(data_dir):
    app = make_app(data_dir, sequence_gap_timeout_s=30)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running()
        session = uuid.uuid4().hex
        for _ in range(2):  # a retry of POST 0 (a new Idempotency-Key: a deliberate second step)
            await api.call("POST", f"/{job_id}/step", json={}, headers=_numbered(session, 0))
        await api.call("POST", f"/{job_id}/step", json={})  # unnumbered, while 1 is still missing
        assert _recorded_ops(app, job_id) == ["step"] * 3


@pytest.mark.parametrize("value", ["nocolon", ":3", "s:-1", "s:x", "a:b:1", f"{'s' * 65}:0"])
async def test_a_malformed_sequence_header_is_a_400_that_names_the_header(data_dir, value):
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        response = await api.call("POST", "/any-job/step", json={}, headers={"Icefloe-Sequence": value}, check=False)
        assert response.status_code == 400 and response.json()["code"] == "invalid_argument"
        assert "Icefloe-Sequence must be '<session>:<n>'" in response.json()["message"]


# --- the layer alone, over a minimal ASGI app ----------------------------------------------------
class _Queue:
    """An app that queues each POST (``release_turn``), or refuses it with the status in its path."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.order: list[tuple[str, int]] = []
        self.delay_s = delay_s

    async def __call__(self, scope, receive, send) -> None:
        number = int(scope["headers"][0][1].rsplit(b":", 1)[1])
        refused = scope["path"].strip("/")
        await asyncio.sleep(self.delay_s)  # decoding, validation: time spent inside the app
        if refused:
            self.order.append((refused, number))
            await send({"type": "http.response.start", "status": int(refused), "headers": []})
            await send({"type": "http.response.body", "body": b'{"code": "unavailable"}'})
            return
        self.order.append(("queued", number))
        release_turn()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def _post(layer, session: str, number: int, path: str = "/") -> int:
    answered = {}

    async def send(message):
        if message["type"] == "http.response.start":
            answered["status"] = message["status"]

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"icefloe-sequence", f"{session}:{number}".encode())],
    }
    await layer(scope, receive, send)
    return answered["status"]


async def test_a_post_refused_with_a_retried_status_keeps_its_place_for_the_retry():
    app = _Queue()
    layer = SubmitOrder(app, gap_timeout_s=30)
    assert await _post(layer, "s", 0, "/503") == 503  # the client retries this one
    later = asyncio.ensure_future(_post(layer, "s", 1))
    await asyncio.sleep(0.05)
    assert not later.done()  # 1 must not jump ahead of the retry of 0
    assert await _post(layer, "s", 0) == 200
    assert await later == 200
    assert app.order == [("503", 0), ("queued", 0), ("queued", 1)]


async def test_a_post_refused_for_good_lets_the_next_one_in():
    app = _Queue()
    layer = SubmitOrder(app, gap_timeout_s=30)
    assert await _post(layer, "s", 0, "/400") == 400  # the caller's mistake: never sent again
    assert await _post(layer, "s", 1) == 200
    assert app.order == [("400", 0), ("queued", 1)]


async def test_the_gap_timeout_counts_from_the_sessions_last_progress_not_from_arrival():
    app = _Queue(delay_s=0.2)
    layer = SubmitOrder(app, gap_timeout_s=0.5)  # the whole chain takes 1 s, each link 0.2 s
    statuses = await asyncio.gather(*(_post(layer, "s", n) for n in range(5)))
    assert statuses == [200] * 5 and app.order == [("queued", n) for n in range(5)]


async def test_the_least_recently_used_session_is_forgotten_beyond_the_cap_never_a_quiet_one():
    layer = SubmitOrder(_Queue(), gap_timeout_s=30, max_sessions=2)
    for session in ("a", "b"):
        assert await _post(layer, session, 0) == 200
    assert await _post(layer, "a", 1) == 200  # "a" is now the most recent
    assert await _post(layer, "c", 0) == 200  # evicts "b", the least recent
    assert list(layer._next) == ["a", "c"]


async def test_a_skip_for_a_number_still_queuing_waits_for_it_so_the_next_number_cannot_overtake():
    """A client whose op caller gave up after the POST was written sends a skip with the same number;
    the op's POST is still decoding, and the step numbered after it must still queue after it."""
    queued: list[str] = []

    async def app(scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        if scope["path"] == "/forward-backward":
            await asyncio.sleep(0.2)  # a large frame decoding on the thread pool
        queued.append(scope["path"])
        release_turn()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    order = SubmitOrder(app, gap_timeout_s=5)

    async def post(path: str, number: int) -> None:
        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"icefloe-sequence", b"s:%d" % number)]}

        async def receive() -> dict:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            pass

        await order(scope, receive, send)

    trained = asyncio.ensure_future(post("/forward-backward", 0))
    stepped = asyncio.ensure_future(post("/step", 1))
    await asyncio.sleep(0.05)
    await post("/sequence-skip", 0)
    await asyncio.gather(trained, stepped)
    assert queued == ["/forward-backward", "/step", "/sequence-skip"]


async def _post_numbered(layer, path: str, session: str, number: int) -> None:
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"icefloe-sequence", f"{session}:{number}".encode())],
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        pass

    await layer(scope, receive, send)


async def test_a_post_leaving_after_its_session_emptied_and_refilled_keeps_the_later_numbers_held():
    """0 and 1 queue and stay in the app (long-polls); 0 leaves, 2 comes in and decodes, 1 leaves:
    number 2 must still count as queuing, so a skip for it cannot let 3 overtake it."""
    queued: list[str] = []
    held = {"/wait0": asyncio.Event(), "/wait1": asyncio.Event()}

    async def app(scope, receive, send) -> None:
        path = scope["path"]
        if path == "/fwd-bwd2":
            await asyncio.sleep(0.3)
        queued.append(path)
        release_turn()
        if path in held:
            await held[path].wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    layer = SubmitOrder(app, gap_timeout_s=5)
    first = asyncio.ensure_future(_post_numbered(layer, "/wait0", "s", 0))
    second = asyncio.ensure_future(_post_numbered(layer, "/wait1", "s", 1))
    await asyncio.sleep(0.02)
    held["/wait0"].set()
    await first
    trained = asyncio.ensure_future(_post_numbered(layer, "/fwd-bwd2", "s", 2))
    await asyncio.sleep(0.02)
    held["/wait1"].set()
    await second
    stepped = asyncio.ensure_future(_post_numbered(layer, "/step3", "s", 3))
    await asyncio.sleep(0.01)
    await _post_numbered(layer, "/skip2", "s", 2)
    await asyncio.gather(trained, stepped)
    assert queued.index("/fwd-bwd2") < queued.index("/step3")


async def test_a_session_refused_for_a_gap_can_still_be_evicted():
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    layer = SubmitOrder(app, gap_timeout_s=0.05, max_sessions=10)
    await _post_numbered(layer, "/x", "gone", 1)  # number 0 never comes: 409 sequence_gap
    for i in range(100):
        await _post_numbered(layer, "/x", f"s{i}", 0)
    assert len(layer._next) <= 10 and layer._progress == {}
