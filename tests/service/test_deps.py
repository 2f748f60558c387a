"""Bearer-token auth (icefloe.service.deps.require_token) and token redaction in every log."""

from __future__ import annotations

import uuid

import httpx
import pytest

from icefloe.service.app import ServerThread

from .service_client import PREFIX, TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


async def test_every_route_but_health_needs_a_valid_token(data_dir):
    token = "serve-token-" + uuid.uuid4().hex
    async with asgi_client(make_app(data_dir, tokens=(token,))) as http:
        assert (await http.get("/health")).status_code == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {token}"},
            {"Authorization": f"Bearer {token}", "X-Snowflake-Authorization-Token-Type": "OAUTH"},
        ):
            response = await http.get(f"{PREFIX}/capacity", headers=headers)
            assert (response.status_code, response.json()["code"]) == (401, "unauthenticated"), headers
            assert token not in response.text
        refused = await http.post(f"{PREFIX}/", json={"sub_job_configs": [TRAINING]})
        assert refused.status_code == 401
        pat = {"Authorization": f"Bearer {token}", "X-Snowflake-Authorization-Token-Type": "PROGRAMMATIC_ACCESS_TOKEN"}
        assert (await http.get(f"{PREFIX}/", headers=pat)).json() == {"jobs": []}  # the refused create made nothing
        assert (await http.get(f"{PREFIX}/capacity", headers={"Authorization": f"Bearer {token}"})).status_code == 200


async def test_tokens_never_appear_in_logs(data_dir, capfd, caplog):
    token = "serve-token-" + uuid.uuid4().hex
    app = make_app(data_dir, tokens=(token,))
    with ServerThread(app, log_level="info") as base_url:
        auth = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=base_url, headers=auth, timeout=60) as http:
            api = Api(http)
            job_id = await api.create(TRAINING)
            await api.wait_status(job_id, "running")
            # a careless client that also puts the token in the URL: the access log must not show it
            await http.get(f"{PREFIX}/capacity", params={"access_token": token})
            await http.get(f"{PREFIX}/capacity", headers={"Authorization": f"Bearer {token}-wrong"})
            logs = (await api.call("POST", f"/{job_id}/operation", json={"operation_type": "tail-logs"})).text
    captured = capfd.readouterr()
    output = captured.out + captured.err + caplog.text + logs
    assert "GET " in output and "/capacity" in output  # the access log did run
    assert "Logging error" not in output, "redaction must keep records formattable (uvicorn unpacks args)"
    assert token not in output
    assert "***" in output
    for path in data_dir.rglob("*.jsonl"):
        assert token not in path.read_text()
