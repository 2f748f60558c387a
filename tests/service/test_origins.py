"""Host and Origin checks (icefloe.service.origins): with auth off, only the service's own Host is
answered and a page of another origin changes nothing; with tokens the login form checks the origin."""

from __future__ import annotations

import pytest

from .service_client import PREFIX
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio

_OWN = "http://icefloe.test"  # the address asgi_client's requests come in on


async def test_without_tokens_a_foreign_host_is_421_and_a_foreign_origin_403(data_dir):
    """Any Host was answered (DNS rebinding) and a change from any page went through."""
    async with asgi_client(make_app(data_dir, public_url="https://lab.example/icefloe")) as http:
        for host in ("icefloe.test", "icefloe.test:80", "lab.example", "LAB.example:443"):
            assert (await http.get(PREFIX + "/", headers={"Host": host})).status_code == 200, host
        for host in ("evil.example", "icefloe.test:81", "lab.example:8443", "icefloe.test@evil.example"):
            refused = await http.get(PREFIX + "/", headers={"Host": host})
            assert refused.status_code == 421 and refused.json()["code"] == "misdirected_request", host
        create = {"sub_job_configs": []}
        for sent in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Referer": "https://evil.example/x"}):
            refused = await http.post(PREFIX + "/", json=create, headers=sent)
            assert refused.status_code == 403 and refused.json()["code"] == "forbidden", sent
        for sent in ({}, {"Origin": _OWN}, {"Origin": "https://lab.example"}, {"Referer": f"{_OWN}/ui/jobs"}):
            answer = await http.post(PREFIX + "/", json=create, headers=sent)
            assert answer.status_code == 400, (sent, answer.text)  # past the edge: the empty body's own error


async def test_with_tokens_any_host_is_answered_but_the_login_form_checks_the_origin(data_dir):
    async with asgi_client(make_app(data_dir, tokens=("tok-login",))) as http:
        assert (await http.get("/health", headers={"Host": "anything.example"})).status_code == 200
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        foreign = await http.post("/ui/login", content="token=tok-login", headers={**form, "Origin": "http://evil"})
        assert foreign.status_code == 403 and "set-cookie" not in foreign.headers
        own = await http.post("/ui/login", content="token=tok-login", headers={**form, "Origin": _OWN})
        assert own.status_code == 303 and "icefloe_session=" in own.headers["set-cookie"]
