"""``POST {prefix}/requests:batch``: several requests in one POST, each answered as if it came alone."""

from __future__ import annotations

import json
import uuid

import pytest

from icefloe import wire
from icefloe.wire.batch import BATCH_MEDIA_TYPE, BATCH_PATH, pack, unpack

from .service_batches import small_batch
from .service_client import PREFIX, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


def _part(method: str, path: str, *, query: str = "", **headers: str) -> dict:
    return {"method": method, "path": PREFIX + path, "query": query, "headers": list(headers.items())}


def _numbered(job_id: str, op: str, key: str, sequence: str, media_type: str) -> dict:
    headers = {"Idempotency-Key": key, "Icefloe-Sequence": sequence, "Content-Type": media_type}
    return _part("POST", f"/{job_id}/{op}", query="wait=30", **headers)


async def _batch(api: Api, parts: list[tuple[dict, bytes]]) -> list[tuple[dict, bytes]]:
    envelope = pack([part for part, _ in parts], [body for _, body in parts])
    answer = await api.call("POST", BATCH_PATH, content=envelope, headers={"content-type": BATCH_MEDIA_TYPE})
    assert answer.headers["content-type"] == BATCH_MEDIA_TYPE
    return unpack(answer.content)


async def test_a_batch_runs_numbered_ops_in_order_once_and_answers_each_part(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running()
        session = uuid.uuid4().hex
        # The step (number 1) comes first in the envelope: its number still puts it after the fwd_bwd.
        parts = [
            (_numbered(job_id, "step", "k-step", f"{session}:1", "application/json"), b"{}"),
            (
                _numbered(job_id, "forward-backward", "k-fb", f"{session}:0", "application/octet-stream"),
                wire.encode(small_batch()),
            ),
            (_part("GET", "/no-such-job"), b""),
        ]
        answers = await _batch(api, parts)
        assert [part["status"] for part, _ in answers] == [200, 200, 404]
        stepped, trained, missing = (json.loads(body) for _, body in answers)
        assert stepped["status"] == "done" and stepped["result"]["global_step"] == 1
        assert stepped["result"]["grad_norm"] > 0  # the fwd_bwd ran first, whatever the envelope's order
        assert trained["status"] == "done"
        assert "no-such-job" in missing["message"]

        # The same envelope again: each op answers from its Idempotency-Key record and runs no second time.
        replayed = await _batch(api, parts[:2])
        assert [dict(part["headers"]).get("idempotent-replayed") for part, _ in replayed] == ["true", "true"]
        trained_again = (await api.post_frame(job_id, "forward-backward", small_batch())).json()
        await api.poll(job_id, trained_again["request_id"])
        stepped_again = (await api.call("POST", f"/{job_id}/step", json={})).json()
        assert (await api.poll(job_id, stepped_again["request_id"]))["result"]["global_step"] == 2


async def test_a_malformed_batch_is_refused_whole_naming_the_envelope(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        headers = {"content-type": BATCH_MEDIA_TYPE}
        short = await api.call("POST", BATCH_PATH, content=b"\x00\x00\x00\x09[]", headers=headers, check=False)
        assert short.status_code == 400 and "requests:batch" in short.json()["message"]
        empty = await api.call("POST", BATCH_PATH, content=pack([], []), headers=headers, check=False)
        assert empty.status_code == 400 and "1 to 256 parts" in empty.json()["message"]
        nested = pack([_part("POST", BATCH_PATH)], [b""])
        refused = await api.call("POST", BATCH_PATH, content=nested, headers=headers, check=False)
        assert refused.status_code == 400 and "other than the batch route" in refused.json()["message"]


async def test_a_batch_needs_the_token_and_its_parts_inherit_the_caller(data_dir):
    async with asgi_client(make_app(data_dir, tokens=("s3cret",))) as http:
        api = Api(http)
        envelope = pack([_part("GET", "/capabilities")], [b""])
        headers = {"content-type": BATCH_MEDIA_TYPE}
        refused = await api.call("POST", BATCH_PATH, content=envelope, headers=headers, check=False)
        assert refused.status_code == 401
        answer = await api.call(
            "POST", BATCH_PATH, content=envelope, headers={**headers, "authorization": "Bearer s3cret"}
        )
        [(part, body)] = unpack(answer.content)
        assert part["status"] == 200 and json.loads(body)["extensions"]["batch_requests"] is True
