"""The ASGI stacks in front of each API (icefloe.service.edge): built in one order that keeps its rules,
and each mounted API with its own auth adapter and error rules."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from icefloe.protocol import ConflictError
from icefloe.service.edge import RULES, api_layers, check_order, service_layers
from icefloe.service.errors import install_error_handlers
from icefloe.service.logins import Logins
from icefloe.service.middleware import training_access
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database

from .service_client import PREFIX
from .service_harness import asgi_client, make_app

_SERVICE = Path(__file__).parents[2] / "icefloe" / "service"


def _stack(tmp_path: Path, *, auth: bool) -> list:
    """The training API's stack as create_app builds it, outermost first."""
    settings = ServeSettings(data_dir=tmp_path, tokens=("t",) if auth else ())
    edge = {"db": Database(tmp_path / "db.sqlite3"), "logins": Logins(ttl_s=60, max_failures_per_minute=10)}
    access = training_access(settings)
    layers = api_layers(
        settings, **edge, access=access, batches=True, routes_parse_json=False, sequencing=None, waited_answers=True,
        json_too_large="send tensors as binary frames",
    )  # fmt: skip
    return [*service_layers(settings, []), *layers]


@pytest.mark.parametrize("auth", [True, False])
def test_swapping_two_neighbouring_layers_that_a_rule_orders_is_refused_naming_the_rule(tmp_path, auth):
    stack = _stack(tmp_path, auth=auth)
    check_order(stack)  # as built: every rule kept
    ruled = {(before, after) for before, after, _ in RULES}
    caught = 0
    for index in range(len(stack) - 1):
        outer, inner = stack[index][0], stack[index + 1][0]
        swapped = [*stack[:index], stack[index + 1], stack[index], *stack[index + 2 :]]
        kinds = [kind for kind, _ in stack]
        if (outer, inner) in ruled and kinds.count(outer) == kinds.count(inner) == 1:  # a rule orders first ones
            with pytest.raises(ValueError, match=f"{outer.__name__} must come before {inner.__name__}: "):
                check_order(swapped)
            caught += 1
    assert caught >= 3  # the hand-off to mounted APIs, the token, the body cap


def test_every_rule_names_two_distinct_layers_and_no_two_rules_contradict():
    pairs = {(before, after) for before, after, _ in RULES}
    assert all(before is not after for before, after in pairs)
    assert not [pair for pair in itertools.permutations({k for p in pairs for k in p}, 2) if pair in pairs
                and pair[::-1] in pairs]  # fmt: skip


@pytest.mark.anyio
async def test_x_api_key_is_the_tinker_apis_token_and_no_other_apis(data_dir):
    token = "serve-token-" + uuid.uuid4().hex
    async with asgi_client(make_app(data_dir, tokens=(token,))) as http:
        as_key = {"X-API-Key": token}
        training = await http.get(f"{PREFIX}/capacity", headers=as_key)
        assert (training.status_code, training.json()["code"]) == (401, "unauthenticated")
        assert (await http.post("/api/v1/create_session", json={}, headers=as_key)).status_code == 200
        refused = await http.post("/api/v1/create_session", json={})
        assert (refused.status_code, refused.json()["code"]) == (401, "unauthenticated")
        bearer = {"Authorization": f"Bearer {token}"}
        assert (await http.get(f"{PREFIX}/capacity", headers=bearer)).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize(("conflict_status", "expected"), [(409, 409), (400, 400)])
async def test_an_apps_error_rules_decide_the_status_of_its_conflicts(conflict_status, expected):
    app = FastAPI()
    install_error_handlers(app, conflict_status=conflict_status)

    @app.post("/finish")
    async def finish() -> None:
        raise ConflictError("the session has finished")

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
        answer = await http.post("/finish")
    assert (answer.status_code, answer.json()) == (
        expected,
        {"code": "conflict", "message": "the session has finished"},
    )


def test_no_layer_or_route_of_the_service_talks_through_a_contextvar():
    """Routes called up into the layers through contextvars (the turn's release, what a POST accepted)."""
    users = sorted(
        str(path.relative_to(_SERVICE)) for path in _SERVICE.rglob("*.py") if "contextvar" in path.read_text()
    )
    assert users == []


def test_no_shared_layer_tests_the_tinker_apis_path():
    """errors.py and middleware.py behaved differently under /api/v1; the Tinker app now says what it needs."""
    for name in ("errors.py", "middleware.py", "refusals.py", "batches.py", "sequencing.py", "edge.py"):
        assert "/api/v1" not in (_SERVICE / name).read_text(), name


@pytest.mark.anyio
@pytest.mark.parametrize("api", ["tinker", "training"])
async def test_a_bug_inside_a_mounted_api_is_answered_500_and_logged_once(data_dir, monkeypatch, caplog, api):
    """Regression: a 500 in the Tinker app was logged by its handler, then again by the service app's,
    to which Starlette re-raises it."""
    from icefloe.service.jobs import JobManager
    from icefloe.service.tinker.state import TinkerState

    def bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(TinkerState, "create_session", bug)
    monkeypatch.setattr(JobManager, "capacity", bug)
    app = make_app(data_dir)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # as a server would, answer and go on
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        if api == "tinker":
            answer = await http.post("/api/v1/create_session", json={})
        else:
            answer = await http.get(f"{PREFIX}/capacity")
    assert (answer.status_code, answer.json()) == (500, {"code": "internal", "message": "RuntimeError: a bug"})
    logged = [r for r in caplog.records if r.getMessage() == "internal error (a bug in the service)"]
    assert len(logged) == 1
