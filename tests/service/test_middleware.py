"""Idempotency-Key replay and the per-POST size cap (icefloe.service.middleware)."""

from __future__ import annotations

import time
import uuid

import pytest

from icefloe.service import store

from .service_client import PREFIX, SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app, uvicorn_client

pytestmark = pytest.mark.anyio


async def test_same_idempotency_key_returns_the_same_request_and_executes_once(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        key = {"Idempotency-Key": "step-1"}
        await api.fwd_bwd(job_id)
        first = await api.call("POST", f"/{job_id}/step", json={}, headers=key)
        second = await api.call("POST", f"/{job_id}/step", json={}, headers=key)
        assert first.json() == second.json() and second.headers["idempotent-replayed"] == "true"
        assert (await api.result(job_id, first.json()["request_id"]))["global_step"] == 1
        await api.fwd_bwd(job_id)
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


async def test_replay_needs_the_token_and_is_scoped_to_it(data_dir):
    """A saved Idempotency-Key reply was replayed to a caller with no token (or another token): auth was skipped."""
    token, other = "serve-token-" + uuid.uuid4().hex, "serve-token-" + uuid.uuid4().hex
    body = {"sub_job_configs": [TRAINING], "job_id": "keyed-job"}
    async with asgi_client(make_app(data_dir, tokens=(token, other))) as http:
        api = Api(http)
        key = {"Idempotency-Key": "k1"}
        created = await api.call("POST", "/", json=body, headers={**key, "Authorization": f"Bearer {token}"})
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
            refused = await api.call("POST", "/", json=body, headers={**key, **headers}, check=False)
            assert (refused.status_code, refused.json()["code"]) == (401, "unauthenticated"), headers
            assert "idempotent-replayed" not in refused.headers and token not in refused.text
        pat = {"Authorization": f"Bearer {token}", "X-Snowflake-Authorization-Token-Type": "PROGRAMMATIC_ACCESS_TOKEN"}
        again = await api.call("POST", "/", json=body, headers={**key, **pat})
        assert again.json() == created.json() and again.headers["idempotent-replayed"] == "true"
        # another token with the same key is another record: the create really runs, and the id is taken
        fresh = await api.call("POST", "/", json=body, headers={**key, "Authorization": f"Bearer {other}"}, check=False)
        assert fresh.status_code == 409 and "idempotent-replayed" not in fresh.headers
    for path in data_dir.glob("icefloe.sqlite3*"):
        assert token.encode() not in path.read_bytes()  # records are scoped by a hash, never the token


async def test_expired_idempotency_records_are_not_replayed_and_are_deleted(data_dir):
    """Idempotency records and download links were kept (and replayed) forever: the tables only grew."""
    body = {"sub_job_configs": [TRAINING], "job_id": "keyed-job"}
    key = {"Idempotency-Key": "create-1"}
    async with asgi_client(make_app(data_dir, idempotency_ttl_s=3600)) as http:
        await Api(http).call("POST", "/", json=body, headers=key)
    app = make_app(data_dir, idempotency_ttl_s=3600)
    db = app.state.db
    db.execute("UPDATE idempotency SET created_at = ?", (store.iso_ago(7200),))
    store.insert_file_link(db, token="old-link", path="/nowhere", expires_at=time.time() - 1)
    store.insert_file_link(db, token="live-link", path="/nowhere", expires_at=time.time() + 600)
    async with asgi_client(app) as http:
        again = await Api(http).call("POST", "/", json=body, headers=key, check=False)
        assert again.status_code == 409 and "idempotent-replayed" not in again.headers  # executed, not replayed
    restarted = make_app(data_dir, idempotency_ttl_s=3600)  # startup sweeps expired records out
    assert restarted.state.db.fetch_all("SELECT * FROM idempotency") == []
    assert [r["token"] for r in restarted.state.db.fetch_all("SELECT token FROM file_links")] == ["live-link"]
    restarted.state.db.close()


async def test_an_oversized_wait_answer_is_replayed_as_its_bare_acceptance(data_dir):
    """Whole ?wait= answers (results included) were stored for every key, however large."""
    app = make_app(data_dir, idempotency_max_response_bytes=1024)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        body = {"prompts": [[1, 2, 3]] * 4, "sampling_params": {"max_tokens": 8, "n": 4}}
        posts = [
            await api.post_frame(job_id, "generate", body, params={"wait": 30}, headers={"Idempotency-Key": "g-1"})
            for _ in range(2)
        ]
        assert posts[0].json()["status"] == "done" and len(posts[0].content) > 1024
        assert posts[1].headers["idempotent-replayed"] == "true"
        assert posts[1].json() == {"request_id": posts[0].json()["request_id"], "job_id": job_id}
        rows = app.state.db.fetch_all("SELECT op FROM requests WHERE job_id = ? AND op = 'generate'", (job_id,))
        assert len(rows) == 1
