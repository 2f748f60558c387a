"""The ``sequenced_submit`` extension: numbered POSTs run in number order, whatever order they arrive in."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator

import httpx
import pytest

from icefloe.protocol import (
    ChunkGroupRestartError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    TooManyRequestsError,
)
from icefloe.service.errors import status_and_body
from icefloe.service.hosts.seam import LocalEngineHost
from icefloe.service.middleware import CALLER_SCOPE_KEY
from icefloe.service.sequencing import Sequencing

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
    advance = LocalEngineHost.advance

    def recorded_step(run, sub_job_id, learning_rate, adam):
        calls.append(("step", learning_rate))
        return run()

    def recorded_start(self, sub_job_id, op, *args):  # a forward-backward starts in the engines here
        if isinstance(op, tuple):
            calls.append(("forward-backward", 0.0))
        return advance(self, sub_job_id, op, *args)

    wrap_engine_method(monkeypatch, "step", recorded_step)
    monkeypatch.setattr(LocalEngineHost, "advance", recorded_start)
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


_TOO_DEEP = b'{"learning_rate": 0.001, "x": ' + b"[" * 100 + b"]" * 100 + b"}"
_PADDED = b'{"learning_rate": 0.001, "x": "%s"}'


@pytest.mark.parametrize(
    ("body", "settings", "status"),
    [
        (b'{"learning_rate": ', {}, 400),  # malformed JSON (JsonBodies)
        (_TOO_DEEP, {}, 400),  # nested too deeply (JsonBodies)
        (_PADDED % (b"x" * (4 * 1024 * 1024)), {}, 413),  # over the JSON cap (JsonBodies)
        (_PADDED % (b"x" * 20_000), {"max_post_bytes": 16_384}, 413),  # over the POST cap (BodyLimit)
    ],
    ids=["malformed", "too-deep", "json-too-large", "post-too-large"],
)
async def test_a_numbered_post_whose_body_is_refused_before_its_route_lets_the_next_number_in(
    data_dir, body, settings, status
):
    """Regression: a body refused in front of the routes left its number to the gap timeout, so the
    session's next POST waited for it and was refused as a ``sequence_gap``."""
    async with _watched_service(data_dir, sequence_gap_timeout_s=5, **settings) as (api, _):
        job_id = await api.running()
        await api.fwd_bwd(job_id)
        headers = {**_numbered("s:0"), "Content-Type": "application/json"}
        refused = await api.call("POST", f"/{job_id}/step", content=body, headers=headers, check=False)
        assert refused.status_code == status
        after = await _step(api, job_id, "s:1")  # would wait the 5 s gap timeout, then be a 409
        assert after.status_code == 200 and after.json()["result"]["global_step"] == 1


async def test_a_numbered_post_refused_for_its_idempotency_key_lets_the_next_number_in(data_dir, executed):
    async with _watched_service(data_dir, sequence_gap_timeout_s=5) as (api, _):
        job_id = await api.running()
        await api.fwd_bwd(job_id)
        assert (await _step(api, job_id, "s:0", 1e-3, **{"Idempotency-Key": "k"})).status_code == 200
        conflict = await _step(api, job_id, "s:1", 2e-3, **{"Idempotency-Key": "k"})  # same key, another body
        assert (conflict.status_code, conflict.json()["code"]) == (409, "conflict")
        await api.fwd_bwd(job_id)
        after = await _step(api, job_id, "s:2", 3e-3)
        assert after.status_code == 200 and after.json()["result"]["global_step"] == 2


# --- the turns alone, over a minimal route ------------------------------------------------------
class _Route:
    """A route that takes its turn and queues its POST (``Turn.release``), or raises the error in its
    path; it tells a test the moment each numbered POST arrived."""

    def __init__(self, sequencing: Sequencing, delay_s: float = 0.0) -> None:
        self.sequencing = sequencing
        self.order: list[tuple[str, int]] = []
        self.delay_s = delay_s
        self.arrived: defaultdict[str, asyncio.Event] = defaultdict(asyncio.Event)

    async def post(self, sequence: str, refusal: type[Exception] | None = None) -> int:
        """The status the POST is answered with."""
        self.arrived[sequence].set()
        scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"icefloe-sequence", sequence.encode())]}
        try:
            async with self.sequencing.turn(scope) as turn:
                await asyncio.sleep(self.delay_s)  # decoding, validation: time spent inside the route
                self.order.append((refusal.__name__ if refusal else "queued", int(sequence.rsplit(":", 1)[1])))
                if refusal is not None:
                    raise refusal("refused")
                turn.release()
                return 200
        except Exception as exc:
            return status_and_body(exc)[0]


@pytest.mark.parametrize(
    ("refusal", "status"), [(TooManyRequestsError, 429), (ChunkGroupRestartError, 409), (RuntimeError, 500)]
)
async def test_a_post_refused_with_an_error_its_client_retries_keeps_its_place_for_the_retry(refusal, status):
    route = _Route(Sequencing(gap_timeout_s=30))
    assert await route.post("s:0", refusal) == status
    later = asyncio.ensure_future(route.post("s:1"))
    await route.arrived["s:1"].wait()
    await asyncio.sleep(0.05)
    assert not later.done()  # 0 kept its place: 1 waits for the retry
    assert await route.post("s:0") == 200  # the retry
    assert await later == 200
    assert route.order == [(refusal.__name__, 0), ("queued", 0), ("queued", 1)]


@pytest.mark.parametrize("refusal", [InvalidRequestError, NotFoundError, ConflictError])
async def test_a_post_refused_for_good_lets_the_next_one_in(refusal):
    route = _Route(Sequencing(gap_timeout_s=30))
    assert await route.post("s:0", refusal) in (400, 404, 409)  # the caller's mistake: never sent again
    assert await route.post("s:1") == 200
    assert route.order == [(refusal.__name__, 0), ("queued", 1)]


async def test_past_the_gap_timeout_the_lowest_waiting_post_is_refused_and_the_session_moves_on():
    """Regression: a number that never came held every later POST of its session, each refused after the timeout."""
    route = _Route(Sequencing(gap_timeout_s=0.2))
    assert await route.post("s:0") == 200
    third = asyncio.ensure_future(route.post("s:3"))  # arrives first, so its wait ends first: it waits on
    await route.arrived["s:3"].wait()
    assert await route.post("s:2") == 409  # 1 never came: the POST waiting on it is refused
    assert await third == 200
    assert await route.post("s:4") == 200
    assert await route.post("s:1") == 409  # late: the ops after it ran, so it must not (it was skipped)
    assert await route.post("s:4") == 200  # a retry of a number that went in still passes at once
    assert route.order == [("queued", 0), ("queued", 3), ("queued", 4), ("queued", 4)]


async def test_the_gap_timeout_counts_from_the_sessions_last_progress_not_from_arrival():
    route = _Route(Sequencing(gap_timeout_s=1.0), delay_s=0.4)  # the whole chain takes 1.6 s or more, each link 0.4 s
    statuses = await asyncio.gather(*(route.post(f"s:{n}") for n in range(4)))
    assert statuses == [200] * 4 and route.order == [("queued", n) for n in range(4)]


async def test_the_least_recently_used_session_is_forgotten_beyond_the_cap():
    route = _Route(Sequencing(gap_timeout_s=0.2, max_sessions=2))
    for sequence in ("a:0", "b:0", "a:1", "c:0"):  # "c" makes three: "b" is the least recent
        assert await route.post(sequence) == 200
    assert await route.post("a:2") == 200
    assert await route.post("b:1") == 409  # "b" starts over at 0


def _refused_scope(sequence: str, **scope: object) -> dict:
    return {"method": "POST", "headers": [(b"icefloe-sequence", sequence.encode())], **scope}


async def test_a_refusal_in_front_of_the_routes_uses_its_number_for_the_caller_the_token_check_let_in():
    route = _Route(Sequencing(gap_timeout_s=30))
    route.sequencing.refused(_refused_scope("s:1", **{CALLER_SCOPE_KEY: ""}), InvalidRequestError("bad body"))
    assert await route.post("s:0") == 200
    assert await route.post("s:2") == 200  # 1 was used by its refusal
    assert route.order == [("queued", 0), ("queued", 2)]


@pytest.mark.parametrize(
    ("scope", "refusal"),
    [({}, InvalidRequestError("bad body")), ({CALLER_SCOPE_KEY: ""}, TooManyRequestsError("busy"))],
    ids=["not-let-in", "retried"],
)
async def test_a_refusal_in_front_of_the_routes_of_a_caller_not_let_in_or_one_retried_leaves_the_number(scope, refusal):
    route = _Route(Sequencing(gap_timeout_s=0.2))
    route.sequencing.refused(_refused_scope("s:0", **scope), refusal)
    assert await route.post("s:1") == 409  # still waited for 0: a sequence gap
