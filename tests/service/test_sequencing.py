"""The ``sequenced_submit`` extension: numbered POSTs run in number order, whatever order they arrive in."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

import httpx
import pytest

from icefloe.service.hosts.seam import LocalEngineHost
from icefloe.service.sequencing import SubmitOrder, release_turn

from .service_batches import small_batch
from .service_client import Api
from .service_harness import asgi_client, make_app, wrap_engine_method

pytestmark = pytest.mark.anyio


class _Arrivals:
    """Wraps an ASGI app to tell a test the moment each numbered POST reaches it."""

    def __init__(self, app) -> None:
        self.app = app
        self.arrived: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            numbered = dict(scope["headers"]).get(b"icefloe-sequence")
            if numbered is not None:
                self.arrived[numbered.decode()].set()
        await self.app(scope, receive, send)


@contextlib.asynccontextmanager
async def _watched_service(data_dir, **settings) -> AsyncIterator[tuple[Api, _Arrivals]]:
    """The service with its engines in this process, behind an API client that sees each POST arrive."""
    app = make_app(data_dir, engines="local", **settings)
    arrivals = _Arrivals(app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=arrivals), base_url="http://t", timeout=60) as http,
    ):
        yield Api(http), arrivals


@pytest.fixture
def executed(monkeypatch) -> list[tuple[str, float]]:
    """The engine calls ``(op, learning rate or 0)`` in the order they ran."""
    calls: list[tuple[str, float]] = []
    begin = LocalEngineHost.begin

    def recorded_step(run, sub_job_id, learning_rate, adam):
        calls.append(("step", learning_rate))
        return run()

    def recorded_begin(self, sub_job_id, what, *args):  # a forward-backward starts in the engines here
        calls.append(("forward-backward", 0.0))
        return begin(self, sub_job_id, what, *args)

    wrap_engine_method(monkeypatch, "step", recorded_step)
    monkeypatch.setattr(LocalEngineHost, "begin", recorded_begin)
    return calls


def _numbered(sequence: str) -> dict[str, str]:
    return {"Icefloe-Sequence": sequence}


async def _fwd_bwd(api: Api, job_id: str, sequence: str):
    """A numbered forward-backward POST answered inline."""
    return await api.post_frame(
        job_id, "forward-backward", small_batch(), params={"wait": 30}, headers=_numbered(sequence)
    )


async def _step(api: Api, job_id: str, sequence: str | None, learning_rate: float = 1e-3, **headers: str):
    """A step POST answered inline (``?wait=``), numbered when ``sequence`` is given."""
    numbered = _numbered(sequence) if sequence else {}
    return await api.call(
        "POST",
        f"/{job_id}/step",
        json={"learning_rate": learning_rate},
        params={"wait": 30},
        headers={**numbered, **headers},
        check=False,
    )


async def test_ops_arriving_in_reverse_run_in_number_order(data_dir, executed):
    async with _watched_service(data_dir) as (api, arrivals):
        job_id = await api.running()
        rates = [1e-4 * (n + 1) for n in range(4)]
        posts = {}
        for n in reversed(range(4)):  # 3 reaches the service first, 0 last; even numbers train, odd ones step
            post = _step(api, job_id, f"s:{n}", rates[n]) if n % 2 else _fwd_bwd(api, job_id, f"s:{n}")
            posts[n] = asyncio.ensure_future(post)
            await arrivals.arrived[f"s:{n}"].wait()
        answers = {n: (await post).json() for n, post in posts.items()}
        assert [answers[n]["result"]["global_step"] for n in (1, 3)] == [1, 2]
        assert executed == [
            ("forward-backward", 0.0),
            ("step", rates[1]),
            ("forward-backward", 0.0),
            ("step", rates[3]),
        ]


async def test_a_step_arriving_first_waits_for_the_forward_backward_numbered_before_it(data_dir, executed):
    async with _watched_service(data_dir) as (api, arrivals):
        job_id = await api.running()
        step = asyncio.ensure_future(_step(api, job_id, "s:1"))
        await arrivals.arrived["s:1"].wait()
        trained = await api.post_frame(
            job_id, "forward-backward", small_batch(), params={"wait": 30}, headers=_numbered("s:0")
        )
        stepped = (await step).json()
        assert trained.json()["status"] == stepped["status"] == "done"
        assert [op for op, _ in executed] == ["forward-backward", "step"]
        assert stepped["result"]["grad_norm"] > 0  # the gradients were there when the step ran


async def test_a_missing_number_fails_the_waiting_post_with_409_naming_it_and_nothing_runs(data_dir, executed):
    async with _watched_service(data_dir, sequence_gap_timeout_s=0.2) as (api, _):
        job_id = await api.running()
        await _step(api, job_id, "s:0")
        refused = await _step(api, job_id, "s:2")
        assert (refused.status_code, refused.json()["code"]) == (409, "sequence_gap")
        assert "POST 1 of its session" in refused.json()["message"]
        assert executed == [("step", 1e-3)]


async def test_a_retry_of_a_number_already_let_in_passes_and_unnumbered_posts_never_wait(data_dir, executed):
    async with _watched_service(data_dir, sequence_gap_timeout_s=0.2) as (api, _):
        job_id = await api.running()
        await api.fwd_bwd(job_id)
        first = await _step(api, job_id, "s:0")
        await api.fwd_bwd(job_id)
        again = await _step(api, job_id, "s:0")  # no Idempotency-Key: the caller asked for a second step
        await api.fwd_bwd(job_id)  # unnumbered, as is the step after it
        unnumbered = await _step(api, job_id, None)  # while number 1 of the session is still missing
        assert [r.json()["result"]["global_step"] for r in (first, again, unnumbered)] == [1, 2, 3]
        assert [op for op, _ in executed].count("step") == 3


async def test_a_retried_numbered_post_with_its_idempotency_key_executes_once(data_dir, executed):
    async with _watched_service(data_dir, sequence_gap_timeout_s=0.2) as (api, _):
        job_id = await api.running()
        await api.fwd_bwd(job_id)
        answers = [await _step(api, job_id, "s:0", **{"Idempotency-Key": "step-0"}) for _ in range(2)]
        assert answers[1].headers["idempotent-replayed"] == "true"
        assert answers[0].json() == answers[1].json() and [op for op, _ in executed].count("step") == 1
        await api.fwd_bwd(job_id)
        assert (await _step(api, job_id, "s:1")).json()["result"]["global_step"] == 2


@pytest.mark.parametrize("value", ["nocolon", ":3", "s:-1", "s:x", "a:b:1", f"{'s' * 65}:0"])
async def test_a_malformed_sequence_header_is_a_400_that_names_the_header(data_dir, value):
    async with asgi_client(make_app(data_dir)) as http:
        response = await Api(http).call("POST", "/any-job/step", json={}, headers=_numbered(value), check=False)
        assert response.status_code == 400 and response.json()["code"] == "invalid_argument"
        assert "Icefloe-Sequence must be '<session>:<n>'" in response.json()["message"]


# --- the layer alone, over a minimal ASGI app ----------------------------------------------------
class _Queue:
    """An app that queues each POST (``release_turn``), or refuses it with the status in its path."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.order: list[tuple[str, int]] = []
        self.delay_s = delay_s

    async def __call__(self, scope, receive, send) -> None:
        number = int(dict(scope["headers"])[b"icefloe-sequence"].rsplit(b":", 1)[1])
        refused = scope["path"].strip("/")
        await asyncio.sleep(self.delay_s)  # decoding, validation: time spent inside the app
        self.order.append((refused or "queued", number))
        if not refused:
            release_turn()
        await send({"type": "http.response.start", "status": int(refused or 200), "headers": []})
        await send({"type": "http.response.body", "body": b'{"code": "unavailable"}' if refused else b"{}"})


async def _post(layer, sequence: str, path: str = "/") -> int:
    answered = {}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            answered["status"] = message["status"]

    scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"icefloe-sequence", sequence.encode())]}
    await layer(scope, receive, send)
    return answered["status"]


async def test_a_post_answered_with_a_status_its_client_retries_keeps_its_place_for_the_retry():
    app = _Queue()
    layer = _Arrivals(SubmitOrder(app, gap_timeout_s=30))
    assert await _post(layer, "s:0", "/503") == 503
    later = asyncio.ensure_future(_post(layer, "s:1"))
    await layer.arrived["s:1"].wait()
    assert await _post(layer, "s:0") == 200  # the retry
    assert await later == 200
    assert app.order == [("503", 0), ("queued", 0), ("queued", 1)]


async def test_a_post_refused_for_good_lets_the_next_one_in():
    app = _Queue()
    layer = SubmitOrder(app, gap_timeout_s=30)
    assert await _post(layer, "s:0", "/400") == 400  # the caller's mistake: never sent again
    assert await _post(layer, "s:1") == 200
    assert app.order == [("400", 0), ("queued", 1)]


async def test_past_the_gap_timeout_the_lowest_waiting_post_is_refused_and_the_session_moves_on():
    """Regression: a number that never came held every later POST of its session, each refused after the timeout."""
    app = _Queue()
    layer = _Arrivals(SubmitOrder(app, gap_timeout_s=0.2))
    assert await _post(layer, "s:0") == 200
    third = asyncio.ensure_future(_post(layer, "s:3"))  # arrives first, so its wait ends first: it waits on
    await layer.arrived["s:3"].wait()
    assert await _post(layer, "s:2") == 409  # 1 never came: the POST waiting on it is refused
    assert await third == 200
    assert await _post(layer, "s:4") == 200
    assert await _post(layer, "s:1") == 409  # late: the ops after it ran, so it must not (it was skipped)
    assert await _post(layer, "s:4") == 200  # a retry of a number that went in still passes at once
    assert app.order == [("queued", 0), ("queued", 3), ("queued", 4), ("queued", 4)]


async def test_the_gap_timeout_counts_from_the_sessions_last_progress_not_from_arrival():
    app = _Queue(delay_s=0.4)
    layer = SubmitOrder(app, gap_timeout_s=1.0)  # the whole chain takes 1.6 s or more, each link 0.4 s
    statuses = await asyncio.gather(*(_post(layer, f"s:{n}") for n in range(4)))
    assert statuses == [200] * 4 and app.order == [("queued", n) for n in range(4)]


async def test_the_least_recently_used_session_is_forgotten_beyond_the_cap():
    layer = SubmitOrder(_Queue(), gap_timeout_s=0.2, max_sessions=2)
    for sequence in ("a:0", "b:0", "a:1", "c:0"):  # "c" makes three: "b" is the least recent
        assert await _post(layer, sequence) == 200
    assert await _post(layer, "a:2") == 200
    assert await _post(layer, "b:1") == 409  # "b" starts over at 0
