"""Retry predicate and schedule, URL prefix and auth headers: no network needed."""

from __future__ import annotations

import math

import httpx
import pytest

from icefloe.client.remote.errors import Redactor
from icefloe.client.remote.exchange import Call, Retry
from icefloe.client.remote.http import Endpoint, RetryPolicy, _reply, translate_errors
from icefloe.config import RemoteConfig
from icefloe.protocol import ChunkGroupRestartError, ConfigError, IcefloeTimeoutError, RequestFailedError

_POST = Call("POST", "/j/step", "step")


def _status(code: int, wire_code: str | None = None) -> RequestFailedError:
    return RequestFailedError("failed", status_code=code, code=wire_code)


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
    redactor = Redactor(["sekrit"])
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
def test_env_hydration_reaches_the_transport_endpoint(env, url, authorized):
    from icefloe.client.transports import make_transport
    from icefloe.config import ClientConfig

    transport = make_transport(ClientConfig.from_env(environ=env))
    assert transport._endpoint.url == url
    assert ("Authorization" in transport._endpoint.headers()) is authorized
    transport.close()


def test_remote_helper_modules_export_resolvable_names():
    import importlib

    for name in ("coalesce", "errors", "exchange", "http", "jobs", "ordering", "polling"):
        module = importlib.import_module(f"icefloe.client.remote.{name}")  # ruff RUF022 keeps __all__ sorted
        assert all(hasattr(module, attr) for attr in module.__all__), name


def test_async_session_builds_one_client_for_concurrent_first_calls(service, monkeypatch):
    """Concurrent first sends each built their own httpx.AsyncClient (the TLS lookup yields the loop)."""
    import asyncio

    from icefloe.client.remote import http as http_module

    built = []

    class CountingClient(httpx.AsyncClient):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(http_module.httpx, "AsyncClient", CountingClient)
    backend = service.config().backend
    endpoint = Endpoint.from_config(backend)
    session = http_module.AsyncHttp(endpoint, backend, RetryPolicy(backend), Redactor())

    async def run():
        try:
            replies = await asyncio.gather(*(session.send(Call("GET", "/capabilities", "caps")) for _ in range(4)))
        finally:
            await session.aclose()
        return replies

    assert all(reply.status_code == 200 for reply in asyncio.run(run()))
    assert len(built) == 1


@pytest.mark.parametrize(
    ("content", "body"),
    [
        (b'{"loss": 0.5, "metrics": {}}', {"loss": 0.5, "metrics": {}}),
        (b'{"loss": NaN}', "nan"),  # what json.dumps writes for a NaN: orjson refuses it, the fallback reads it
        (b"<html>bad gateway</html>", "<html>bad gateway</html>"),
    ],
)
def test_answers_parse_as_json_or_stay_text(content: bytes, body: object) -> None:
    reply = _reply(_POST, httpx.Response(200, content=content), Redactor([]))
    if body == "nan":
        assert math.isnan(reply.body["loss"])
    else:
        assert reply.body == body
