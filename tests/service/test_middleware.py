"""Idempotency-Key replay and the per-POST size cap (icefloe.service.middleware)."""

from __future__ import annotations

import pytest

from .service_client import PREFIX, TRAINING, Api
from .service_harness import asgi_client, make_app, uvicorn_client

pytestmark = pytest.mark.anyio


async def test_same_idempotency_key_returns_the_same_request_and_executes_once(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        key = {"Idempotency-Key": "step-1"}
        first = await api.call("POST", f"/{job_id}/step", json={}, headers=key)
        second = await api.call("POST", f"/{job_id}/step", json={}, headers=key)
        assert first.json() == second.json() and second.headers["idempotent-replayed"] == "true"
        assert (await api.result(job_id, first.json()["request_id"]))["global_step"] == 1
        other = await api.call("POST", f"/{job_id}/step", json={}, headers={"Idempotency-Key": "step-2"})
        assert (await api.result(job_id, other.json()["request_id"]))["global_step"] == 2  # the replay never ran

        reused = await api.call("POST", f"/{job_id}/step", json={"learning_rate": 0.1}, headers=key, check=False)
        assert (reused.status_code, reused.json()["code"]) == (409, "conflict")


async def test_idempotency_key_survives_a_restart(data_dir):
    body = {"sub_job_configs": [TRAINING], "job_id": "keyed-job"}
    async with asgi_client(make_app(data_dir)) as http:
        created = await Api(http).call("POST", "/", json=body, headers={"Idempotency-Key": "create-1"})
    async with asgi_client(make_app(data_dir)) as http:
        again = await Api(http).call("POST", "/", json=body, headers={"Idempotency-Key": "create-1"})
        assert again.json() == created.json() == {"job_id": "keyed-job"}
        fresh = await Api(http).call("POST", "/", json=body, headers={"Idempotency-Key": "create-2"}, check=False)
        assert fresh.status_code == 409  # a new key really executes: the job id now exists


async def test_body_over_the_cap_is_refused_before_it_is_read(data_dir):
    async with uvicorn_client(make_app(data_dir, max_post_bytes=10_000)) as http:
        declared = await http.post(f"{PREFIX}/some-job/forward-backward", content=b"\0" * 10_001)
        assert (declared.status_code, declared.json()["code"]) == (413, "payload_too_large")

        async def stream():  # no Content-Length: the cap applies while reading
            for _ in range(3):
                yield b"\0" * 5000

        streamed = await http.post(f"{PREFIX}/", content=stream(), headers={"content-type": "application/json"})
        assert (streamed.status_code, streamed.json()["code"]) == (413, "payload_too_large")
