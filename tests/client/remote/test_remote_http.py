"""Retry predicate and schedule, URL prefix and auth headers, the I/O loop's lifecycle."""

from __future__ import annotations

import math

import httpx
import pytest

from icefloe.client.remote.errors import Redactor, error_from_response
from icefloe.client.remote.http import Call, Endpoint, Http, Retry, RetryPolicy, reply_of, translate_errors
from icefloe.config import RemoteConfig
from icefloe.protocol import ChunkGroupRestartError, ConfigError, IcefloeTimeoutError, RequestFailedError

_POST = Call("POST", "/j/step", "step")


def _status(code: int, wire_code: str | None = None) -> RequestFailedError:
    return RequestFailedError("failed", status_code=code, code=wire_code)


def _coded(status: int, wire_code: str) -> Exception:
    body = {"code": wire_code, "message": "m"}
    return error_from_response(status, body, what="step", request_id=None, redactor=Redactor())


@pytest.mark.parametrize(
    ("exc", "managed", "retried"),
    [
        (httpx.ConnectError("refused"), False, True),
        (httpx.ReadTimeout("slow"), False, True),
        (httpx.RemoteProtocolError("dropped"), False, True),
        (_status(429), False, True),
        (_status(503), False, True),
        (_status(500), False, True),
        (_status(400), True, False),
        (_status(404), False, False),  # icefloe serve: a 404 is definitive
        (_status(404), True, True),  # managed endpoint: front-door restarts surface as 404
        (_status(409), True, True),
        (_coded(404, "not_found"), True, True),  # the class a wire code names keeps its status for the policy
        (_coded(409, "conflict"), False, False),
        (_coded(400, "invalid_argument"), True, False),
        (
            ChunkGroupRestartError("restart", status_code=409, code="chunk_group_restart_required"),
            True,
            False,
        ),
        (ValueError("a bug"), True, False),
    ],
)
def test_retry_policy_predicate(exc, managed, retried):
    policy = RetryPolicy(RemoteConfig(base_url="http://x"))
    policy.retry_restart_statuses = managed
    assert policy.should_retry(_POST, exc) is retried


def test_retry_policy_connect_only_calls_retry_only_unsent_requests():
    policy = RetryPolicy(RemoteConfig(base_url="http://x"))
    create = Call("POST", "", "create job", retry=Retry.CONNECT_ONLY)
    assert policy.should_retry(create, httpx.ConnectError("refused"))
    assert policy.should_retry(create, httpx.ConnectTimeout("slow connect"))
    assert not policy.should_retry(create, httpx.ReadTimeout("sent, then slow"))
    assert not policy.should_retry(create, _status(503))


def test_retry_policy_final_statuses_are_never_retried():
    policy = RetryPolicy(RemoteConfig(base_url="http://x"))
    policy.retry_restart_statuses = True
    delete = Call("DELETE", "/j/checkpoints/c", "delete", final=frozenset({404}))
    assert not policy.should_retry(delete, _status(404))


def test_retry_policy_wait_doubles_with_jitter_and_caps():
    policy = RetryPolicy(RemoteConfig(base_url="http://x", retry_initial_s=0.5, retry_max_s=10.0))
    for attempt, base in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0)):
        waits = [policy.wait_s(attempt) for _ in range(50)]
        assert all(base <= w < base + 1.0 for w in waits)
    assert all(policy.wait_s(9) == 10.0 for _ in range(20))


def test_endpoint_base_url_has_no_auth():
    endpoint = Endpoint.from_config(RemoteConfig(base_url="http://127.0.0.1:8321/"))
    assert endpoint.url == "http://127.0.0.1:8321/api/v2/databases/icefloe/schemas/public/cortex-training"
    assert "Authorization" not in endpoint.headers()


def test_endpoint_host_sends_pat_headers_but_public_pieces_omit_it():
    backend = RemoteConfig(host="acct.example.com", database="DB", schema="SC", pat="pat-xyz")
    endpoint = Endpoint.from_config(backend)
    assert endpoint.url == "https://acct.example.com/api/v2/databases/DB/schemas/SC/cortex-training"
    assert endpoint.headers()["Authorization"] == "Bearer pat-xyz"
    assert endpoint.headers()["X-Snowflake-Authorization-Token-Type"] == "PROGRAMMATIC_ACCESS_TOKEN"
    assert "pat-xyz" not in repr(endpoint.public()) and "pat-xyz" not in repr(backend)


@pytest.mark.parametrize(
    ("backend", "fragment"),
    [
        (RemoteConfig(), "backend.base_url or backend.host is required"),
        (RemoteConfig(host="h", database="d", schema="s"), "backend.pat is not set"),
        (RemoteConfig(base_url="127.0.0.1:8321"), "must start with http:// or https://"),
    ],
)
def test_endpoint_refuses_incomplete_config(backend, fragment):
    with pytest.raises(ConfigError, match=fragment):
        Endpoint.from_config(backend)


def test_translate_errors_maps_httpx_types_and_scrubs_the_pat():
    endpoint = Endpoint.from_config(RemoteConfig(base_url="http://h"))
    redactor = Redactor("sekrit")
    with (
        pytest.raises(IcefloeTimeoutError, match="did not answer within 5 s"),
        translate_errors(_POST, endpoint, redactor, 5.0),
    ):
        raise httpx.ReadTimeout("slow")
    with (
        pytest.raises(RequestFailedError, match="cannot connect") as info,
        translate_errors(_POST, endpoint, redactor, 5.0),
    ):
        raise httpx.ConnectError("refused with sekrit")
    assert "sekrit" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_refused_connection_fails_the_first_attempt_without_retries():
    """A remote client with no service listening retried 11 times and failed after 68 s."""
    attempts = []

    class Counting(httpx.AsyncBaseTransport):
        def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
            self.inner = inner

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            attempts.append(request.url.path)
            return await self.inner.handle_async_request(request)

        async def aclose(self) -> None:
            await self.inner.aclose()

    backend = RemoteConfig(base_url=f"http://127.0.0.1:{_closed_port()}", max_retries=10, retry_initial_s=30.0)
    http = Http(Endpoint.from_config(backend), backend, Counting)
    try:
        with pytest.raises(RequestFailedError, match=r"cannot connect to http://127\.0\.0\.1:\d+: .+ is the service"):
            http.run(http.send(Call("GET", "/capabilities", "capabilities")))
    finally:
        http.close()
    assert len(attempts) == 1


@pytest.mark.timeout(20)
def test_a_client_with_no_service_listening_fails_its_open_at_once():
    from icefloe.client import Client
    from icefloe.config import ClientConfig

    config = ClientConfig.build(
        model="tiny:arith",
        backend={"type": "remote", "base_url": f"http://127.0.0.1:{_closed_port()}", "retry_initial_s": 30.0},
    )
    client = Client(config)
    with pytest.raises(RequestFailedError, match=r"capabilities: cannot connect .+ is the service running"):
        client.open()  # with retries, the 30 s before the first one alone would pass the test's timeout
    client.shutdown()


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("env", "url", "authorized"),
    [
        (
            {"ICEFLOE_BACKEND": "remote", "ICEFLOE_REMOTE_BASE_URL": "http://127.0.0.1:8321"},
            "http://127.0.0.1:8321/api/v2/databases/icefloe/schemas/public/cortex-training",
            False,
        ),
        (
            {
                "ARCTIC_BACKEND": "cortex",
                "ARCTIC_CORTEX_HOST": "a.example.com",
                "ARCTIC_CORTEX_DATABASE": "DB",
                "ARCTIC_CORTEX_SCHEMA": "S",
                "CORTEX_PAT": "p1",
            },
            "https://a.example.com/api/v2/databases/DB/schemas/S/cortex-training",
            True,
        ),
        (
            {
                "ICEFLOE_BACKEND": "remote",
                "ICEFLOE_REMOTE_HOST": "b.example.com",
                "ICEFLOE_REMOTE_DATABASE": "D2",
                "ICEFLOE_REMOTE_SCHEMA": "S2",
                "ICEFLOE_REMOTE_ENDPOINT": "cortex-post-training",
                "ICEFLOE_REMOTE_PAT_ENV_VAR": "MY_TOKEN",
                "MY_TOKEN": "p2",
            },
            "https://b.example.com/api/v2/databases/D2/schemas/S2/cortex-post-training",
            True,
        ),
    ],
)
def test_env_hydration_reaches_the_endpoint(env, url, authorized):
    from icefloe.config import ClientConfig

    endpoint = Endpoint.from_config(ClientConfig.from_env(environ=env).backend)
    assert endpoint.url == url
    assert ("Authorization" in endpoint.headers()) is authorized


def test_remote_helper_modules_export_resolvable_names():
    import importlib

    for name in ("admin", "errors", "http", "jobs", "polling"):
        module = importlib.import_module(f"icefloe.client.remote.{name}")  # ruff RUF022 keeps __all__ sorted
        assert all(hasattr(module, attr) for attr in module.__all__), name


def test_http_runs_on_its_own_thread_and_close_leaves_nothing_behind():
    import threading

    from icefloe.protocol import ClientClosedError

    seen_on = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen_on.append(threading.current_thread().name)
        return httpx.Response(200, json={"ok": True})

    backend = RemoteConfig(base_url="http://svc")
    http = Http(Endpoint.from_config(backend), backend, wrap=lambda inner: httpx.MockTransport(answer))
    assert http.run(http.send(Call("GET", "/capabilities", "caps"))).body == {"ok": True}
    assert seen_on == ["icefloe-remote-io"]
    http.close()
    http.close()
    assert "icefloe-remote-io" not in {thread.name for thread in threading.enumerate()}
    with pytest.raises(ClientClosedError):
        http.run(http.send(Call("GET", "/capabilities", "caps")))


@pytest.mark.parametrize(
    ("content", "body"),
    [
        (b'{"loss": 0.5, "metrics": {}}', {"loss": 0.5, "metrics": {}}),
        (b'{"loss": NaN}', "nan"),  # what json.dumps writes for a NaN: orjson refuses it, the fallback reads it
        (b"<html>bad gateway</html>", "<html>bad gateway</html>"),
    ],
)
def test_answers_parse_as_json_or_stay_text(content: bytes, body: object) -> None:
    reply = reply_of(_POST, httpx.Response(200, content=content), Redactor())
    if body == "nan":
        assert math.isnan(reply.body["loss"])
    else:
        assert reply.body == body
