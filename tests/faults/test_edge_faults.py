"""The edge of a real ``icefloe serve`` process under a hostile tenant and hostile web pages: a tenant's
slot limit dodged through LoRA hosts, pages of other sites driving a service without tokens (and
signing a browser in), guessed tokens behind a rotating ``X-Forwarded-For``, and connections that
never finish their request.

Each client that must run into a failure limit connects from an address of its own (127.0.0.x),
or to a service of its own, so the limit it meets blocks nobody else in the module.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from .serve_process import PREFIX, TRAINING, Serve, free_port
from .tinker_serve import TOKENS, token_file

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

_FORM = {"Content-Type": "application/x-www-form-urlencoded"}
_PUBLIC_URL = "https://icefloe.example"
_PEFT = {"peft_type": "Lora", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def _tenants_serve(tmp_path: Path, *args: str, limits: dict[str, str] | None = None) -> Serve:
    """``icefloe serve`` with the tenants of :data:`TOKENS`; its training-API helpers call as the admin."""
    tokens = token_file(tmp_path / "tokens", **(limits or {}))
    serve = Serve(tmp_path / "serve", "--token-file", str(tokens), *args)
    serve.http.headers["Authorization"] = f"Bearer {TOKENS['admin']}"
    return serve


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    """Alice may hold one slot; the login cookie's public URL is https."""
    tmp_path = tmp_path_factory.mktemp("edge-tenants")
    with _tenants_serve(tmp_path, "--public-url", _PUBLIC_URL, limits={"alice": "max_slots=1"}) as serve:
        yield serve


@pytest.fixture(scope="module")
def open_serve(tmp_path_factory):
    """No tokens: the loopback default."""
    tmp_path = tmp_path_factory.mktemp("edge-open")
    with Serve(tmp_path / "serve", "--public-url", "http://icefloe.example:8443") as serve:
        yield serve


def _from(address: str) -> httpx.Client:
    """A client whose connections come from ``address`` (any 127.0.0.x reaches the service)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def _as(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


def _lora(seed: int) -> dict:
    return {**TRAINING, "seed": seed, "training_config": {**TRAINING["training_config"], "peft_config": _PEFT}}


def _create(serve: Serve, tenant: str, *sub_jobs: dict) -> httpx.Response:
    return httpx.post(f"{serve.base_url}{PREFIX}/", json={"sub_job_configs": list(sub_jobs)}, headers=_as(tenant))


def _cancelled(serve: Serve, job_id: str) -> None:
    serve.call("POST", f"/{job_id}:cancel")
    serve.wait_job(job_id, "cancelled", "terminated")


# --- M2: slots ----------------------------------------------------------------------------------
def test_a_lora_job_that_starts_a_host_is_charged_its_slot(tenants):
    """Alice (max_slots=1) made three LoRA jobs of one model with seeds 11, 12, 13 and got three hosts
    and three slots: a job on a shared base was charged no slot, also when it started the host."""
    first = _create(tenants, "alice", _lora(11))
    assert first.status_code == 200, first.text
    joins = _create(tenants, "alice", _lora(11))  # a host of its base has room: no new slot
    assert joins.status_code == 200, joins.text
    first_id, joins_id = first.json()["job_id"], joins.json()["job_id"]
    tenants.wait_job(first_id, "running")
    tenants.wait_job(joins_id, "running")
    refused = _create(tenants, "alice", _lora(12))  # another seed: another host
    assert refused.status_code == 409, refused.text
    assert refused.json()["message"] == (
        "tenant 'alice' may hold 1 slots at once (max_slots=1 in the token file); this job would make 2 (no host "
        "of its base model, seed and dtype has room, so it would start one): finish or cancel one of its jobs first"
    )
    assert _create(tenants, "bob", _lora(12)).status_code == 200  # bob's own limits
    # The host outlives the job that started it: its slot is now charged to the job that stays on it.
    _cancelled(tenants, first_id)
    assert _create(tenants, "alice", _lora(13)).status_code == 409
    _cancelled(tenants, joins_id)  # the host is gone, and its slot with it
    last = _create(tenants, "alice", _lora(13))
    assert last.status_code == 200, last.text
    _cancelled(tenants, last.json()["job_id"])


# --- M3: no tokens ------------------------------------------------------------------------------
def test_without_tokens_only_the_services_own_host_is_answered(open_serve):
    """Any Host header was served, so a page that re-pointed its own name at 127.0.0.1 (DNS rebinding)
    could read and drive the service with the browser of anyone who ran it."""
    port = open_serve.port
    for host in (
        f"127.0.0.1:{port}",
        f"localhost:{port}",
        f"LocalHost:{port}",
        f"[::1]:{port}",
        "icefloe.example:8443",
    ):
        assert httpx.get(f"{open_serve.base_url}{PREFIX}/", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.1:{port + 1}", "icefloe.example", "", "a b:1"):
        refused = httpx.get(f"{open_serve.base_url}{PREFIX}/", headers={"Host": host})
        assert refused.status_code == 421, (host, refused.text)
        assert refused.json()["code"] == "misdirected_request"
        assert "--public-url" in refused.json()["message"]


def test_without_tokens_a_page_of_another_origin_changes_nothing(open_serve):
    """A text/plain POST from any page (a simple request: no preflight) cancelled a job and created a
    Tinker session: with auth off nothing checked where a change came from."""
    job_id = open_serve.create()
    cancel = f"{open_serve.base_url}{PREFIX}/{job_id}:cancel"
    plain = {"Content-Type": "text/plain"}
    for sent in (
        {"Origin": "http://evil.example"},
        {"Origin": "null"},  # a sandboxed frame, a file:// page
        {"Origin": f"http://127.0.0.1:{free_port()}"},  # another port of the same host
        {"Referer": "http://evil.example/page.html"},  # a browser that left out Origin
    ):
        refused = httpx.post(cancel, headers={**plain, **sent}, content="{}")
        assert refused.status_code == 403, (sent, refused.text)
        assert refused.json()["code"] == "forbidden" and "another origin" in refused.json()["message"]
    session = httpx.post(
        f"{open_serve.base_url}/api/v1/create_session", headers={**plain, "Origin": "http://evil.example"}, content="{}"
    )
    assert session.status_code == 403
    assert open_serve.call("GET", f"/{job_id}")["status"] in ("pending", "placing", "initializing", "running")
    # The service's own pages (its origin as the request addressed it) and clients that are no page may.
    own = httpx.post(cancel, headers={"Origin": open_serve.base_url})
    assert own.status_code == 200 and own.json()["status"] in ("cancelling", "cancelled")
    assert httpx.post(f"{open_serve.base_url}/api/v1/create_session", json={}).status_code == 200


# --- L1: failure limits and the cookie ----------------------------------------------------------
def test_the_login_limit_keys_on_the_connection_not_x_forwarded_for(tmp_path):
    """uvicorn believed X-Forwarded-For from a loopback peer, so a client beside the service (or a
    proxy's every client) rotating it had each guessed login counted against a new address, and the
    limit never came. (A service of its own: the guesses block logins from 127.0.0.1.)"""
    with _tenants_serve(tmp_path) as serve:
        login = f"{serve.base_url}/ui/login"
        statuses = [
            httpx.post(login, content=f"token=tml-guess-{i}", headers={**_FORM, "X-Forwarded-For": f"203.0.113.{i}"})
            for i in range(12)
        ]
        assert [answer.status_code for answer in statuses] == [303] * 10 + [429] * 2
        with _from("127.0.0.3") as neighbour:  # another address is not blocked
            assert neighbour.post(login, content=f"token={TOKENS['bob']}", headers=_FORM).status_code == 303


def test_forwarded_allow_ips_names_the_proxies_whose_client_address_counts(tmp_path):
    """Behind a proxy the operator names, each forwarded client has a limit of its own; the same header
    from any other peer is ignored."""
    with _tenants_serve(tmp_path, "--forwarded-allow-ips", "127.0.0.5") as serve:
        login = f"{serve.base_url}/ui/login"

        def guesses(client: httpx.Client) -> list[int]:
            return [
                client.post(
                    login, content=f"token=g{i}", headers={**_FORM, "X-Forwarded-For": f"198.51.100.{i}"}
                ).status_code
                for i in range(12)
            ]

        with _from("127.0.0.5") as proxy:
            assert guesses(proxy) == [303] * 12
        with _from("127.0.0.6") as direct:
            assert guesses(direct) == [303] * 10 + [429] * 2


def test_wrong_bearer_tokens_from_one_address_are_refused_for_a_while(tenants):
    """Bearer tokens and Tinker API keys had no failure limit: a client could try guesses at full speed."""
    jobs, session = f"{tenants.base_url}{PREFIX}/", f"{tenants.base_url}/api/v1/create_session"
    with _from("127.0.0.4") as guesser:
        statuses = [guesser.get(jobs, headers={"Authorization": f"Bearer tml-guess-{i}"}).status_code for i in range(6)]
        statuses += [
            guesser.post(session, json={}, headers={"X-API-Key": f"tml-guess-{i}"}).status_code for i in range(4)
        ]
        assert statuses == [401] * 10
        blocked = guesser.get(jobs, headers=_as("bob"))  # refused unread: even the right token
        assert blocked.status_code == 429 and "try again in" in blocked.json()["message"]
        assert guesser.post(session, json={}, headers={"X-API-Key": TOKENS["bob"]}).status_code == 429
        assert guesser.get(jobs).status_code == 401  # no token at all is no guess
    assert httpx.get(jobs, headers=_as("bob")).status_code == 200  # other addresses go on


def test_the_login_cookie_is_secure_whenever_the_public_url_is_https(tenants):
    """With --public-url https://..., a login that reached the service over plain http (a proxy that
    sets no X-Forwarded-Proto) got a cookie without Secure, which the browser then sends over http."""
    answer = httpx.post(f"{tenants.base_url}/ui/login", content=f"token={TOKENS['bob']}", headers=_FORM)
    assert answer.status_code == 303
    attributes = [part.strip().lower() for part in answer.headers["set-cookie"].split(";")]
    assert "secure" in attributes and "httponly" in attributes


# --- L5: slow connections -----------------------------------------------------------------------
def _until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """What the service sent before it closed ``sock``; AssertionError if it is still open after ``timeout_s``."""
    deadline, received = time.monotonic() + timeout_s, b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"the service still holds the connection after {timeout_s:g} s") from None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def test_slow_connections_are_closed_without_blocking_other_clients(tmp_path):
    """Slowloris: 200 connections that trickled their headers, or stopped in the middle of a body, were
    held open for ever (uvicorn times out only idle keep-alive connections)."""
    with Serve(tmp_path / "serve", "--header-timeout-s", "1", "--body-timeout-s", "1") as serve:
        host = f"127.0.0.1:{serve.port}"
        head = f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Slow: "  # never ends
        post = f"POST {PREFIX}/ HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        post += "Content-Length: 900\r\n\r\n{"  # 899 bytes short
        slow = []
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", serve.port))
            sock.sendall((head if i % 2 else post).encode())
            slow.append(sock)
        try:
            assert httpx.get(serve.base_url + "/health", timeout=30).status_code == 200  # others are answered
            answers = [_until_closed(sock, 60) for sock in slow]
        finally:
            for sock in slow:
                sock.close()
        for i, answer in enumerate(answers):
            status, _, body = answer.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 408"), answer
            message = json.loads(body)["message"]
            assert message.startswith("the request body" if i % 2 == 0 else "the request headers"), message
        assert httpx.get(serve.base_url + "/health").status_code == 200


# --- L6: login CSRF -----------------------------------------------------------------------------
def test_a_page_of_another_origin_cannot_sign_the_browser_in(tenants):
    """Login CSRF: a page elsewhere posted the attacker's token to /ui/login from the victim's browser,
    which was then signed in as the attacker, and what the victim did there the attacker could see."""
    login = f"{tenants.base_url}/ui/login"
    attacker = f"token={TOKENS['bob']}"
    for sent in (
        {"Origin": "http://evil.example"},
        {"Origin": f"http://127.0.0.1:{free_port()}"},
        {"Referer": "http://evil.example/login.html"},
    ):
        refused = httpx.post(login, content=attacker, headers={**_FORM, **sent})
        assert refused.status_code == 403, (sent, refused.text)
        assert "set-cookie" not in refused.headers and "another origin" in refused.json()["message"]
    for origin in (tenants.base_url, _PUBLIC_URL):  # the login page itself, as addressed or behind its proxy
        assert httpx.post(login, content=attacker, headers={**_FORM, "Origin": origin}).status_code == 303
