"""Request chunk groups (at-most-once execution) and result-chunk delivery (icefloe.service.chunks)."""

from __future__ import annotations

import asyncio
import base64
import uuid

import numpy as np
import pytest
import torch

from icefloe import wire
from icefloe.service.hosts.seam import LocalEngineHost

from .service_batches import small_batch
from .service_client import Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio

OCTET = {"content-type": "application/octet-stream"}


def chunks_of(batch, *, group_id: str | None = None, max_bytes: int = 9000) -> list[bytes]:
    frame = wire.encode(batch)
    chunks = wire.split_frame(
        frame,
        max_bytes=max_bytes,
        kind="request",
        chunk_group_id=group_id or str(uuid.uuid4()),
        operation="fwd-bwd",
        force=True,
    )
    return chunks


async def _post(api: Api, job_id: str, chunk: bytes):
    return await api.call("POST", f"/{job_id}/forward-backward", content=chunk, headers=OCTET, check=False)


def _bigger_batch():
    batch = small_batch()
    batch["context"]["old_logprobs"] = torch.zeros(4, 7) - 1.0
    batch["context"]["ref_logprobs"] = torch.zeros(4, 7) - 1.0
    return batch


async def test_replayed_chunk_group_executes_once_and_returns_the_original_request(data_dir, monkeypatch):
    calls = []
    original = LocalEngineHost.advance

    def counting_starts(self, sub_job_id, op, *args):  # where every forward-backward starts in the engines
        if isinstance(op, tuple):
            calls.append(sub_job_id)
        return original(self, sub_job_id, op, *args)

    monkeypatch.setattr(LocalEngineHost, "advance", counting_starts)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running()
        chunks = chunks_of(_bigger_batch(), max_bytes=9000)
        assert len(chunks) >= 2
        answers = [(await _post(api, job_id, c)).json() for c in chunks]
        assert answers[:-1] == [{"chunk_cached": True}] * (len(chunks) - 1)
        request_id = answers[-1]["request_id"]
        first = await api.result(job_id, request_id)
        replay = [(await _post(api, job_id, c)).json() for c in chunks]  # a client retrying the whole group
        assert replay[:-1] == [{"chunk_cached": True}] * (len(chunks) - 1)
        assert replay[-1] == {"request_id": request_id, "job_id": job_id}
        assert (await _post(api, job_id, chunks[-1])).json()["request_id"] == request_id
        assert (await api.result(job_id, request_id)) == first
        assert len(calls) == 1


async def test_unknown_group_starting_past_chunk_zero_needs_a_restart(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running()
        group = str(uuid.uuid4())
        chunks = chunks_of(_bigger_batch(), group_id=group, max_bytes=9000)
        response = await _post(api, job_id, chunks[1])
        assert response.status_code == 409
        assert response.json() == {
            "code": "chunk_group_restart_required",
            "chunk_group_id": group,
            "received_chunk": 1,
            "expected_start_chunk": 0,
            "message": f"chunk group {group} is unknown to this job; restart it from chunk 0",
        }


async def test_group_id_reused_with_another_frame_is_a_conflict(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running()
        group = str(uuid.uuid4())
        first = chunks_of(_bigger_batch(), group_id=group, max_bytes=9000)
        other_batch = _bigger_batch()
        other_batch["context"]["advantages"] *= 2
        other = chunks_of(other_batch, group_id=group, max_bytes=9000)
        assert (await _post(api, job_id, first[0])).status_code == 200
        response = await _post(api, job_id, other[0])
        assert (response.status_code, response.json()["code"]) == (409, "chunk_group_conflict")
        assert response.json()["chunk_group_id"] == group
        for chunk in first[1:]:
            await _post(api, job_id, chunk)
        after_run = await _post(api, job_id, other[-1])
        assert (after_run.status_code, after_run.json()["code"]) == (409, "chunk_group_conflict")


async def test_final_chunk_with_earlier_ones_missing_is_refused(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running()
        chunks = chunks_of(_bigger_batch(), max_bytes=8700)
        assert len(chunks) >= 3
        await _post(api, job_id, chunks[0])
        response = await _post(api, job_id, chunks[-1])
        body = response.json()
        assert (response.status_code, body["code"], body["message"]) == (
            409,
            "chunk_group_missing_chunks",
            "request chunk group is missing chunks",
        )
        assert body["missing_chunks"] == list(range(1, len(chunks) - 1))
        for chunk in chunks[1:]:  # sending the missing ones completes the group
            last = await _post(api, job_id, chunk)
        assert "request_id" in last.json()


def _hostile_chunk(
    *, chunk_idx: int, total_chunks: int, frame_size_bytes: int, group_id: str, payload_bytes: int = 1
) -> bytes:
    descriptor = {
        "chunk_idx": chunk_idx,
        "total_chunks": total_chunks,
        "frame_sha256": "0" * 64,
        "frame_size_bytes": frame_size_bytes,
        "chunk_group_id": group_id,
    }
    payload = np.full(payload_bytes, chunk_idx % 256, dtype=np.uint8)
    return wire.encode({"payload": payload}, op_metadata={"request_chunk": descriptor})


async def test_a_group_holds_no_more_than_the_frame_size_it_declared(data_dir):
    """32 chunks of 1 MiB for a group declaring 1000 bytes were all cached: nothing totalled a group's bytes."""
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running()
        group_id = str(uuid.uuid4())
        big = _hostile_chunk(
            chunk_idx=0, total_chunks=32, frame_size_bytes=1000, group_id=group_id, payload_bytes=2**20
        )
        response = await _post(api, job_id, big)
        assert (response.status_code, response.json()["code"]) == (400, "invalid_argument")
        assert "request_chunk.frame_size_bytes=1000" in response.json()["message"]
        group_id = str(uuid.uuid4())
        for idx, expected in ((0, 200), (1, 200), (0, 200), (2, 400)):  # 400 + 400 fit in 1000, a third does not
            chunk = _hostile_chunk(
                chunk_idx=idx, total_chunks=3, frame_size_bytes=1000, group_id=group_id, payload_bytes=400
            )
            assert (await _post(api, job_id, chunk)).status_code == expected, idx


async def test_many_groups_sent_chunk_by_chunk_side_by_side_all_complete(data_dir):
    """Only 16 groups could be open per job, whatever their size: the 17th dropped the first, so 20
    concurrent chunked fwd_bwd calls left 17 failed and 40 left none done."""
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running()
        groups = [chunks_of(_bigger_batch(), max_bytes=8700) for _ in range(40)]
        assert len(groups[0]) >= 3
        answers = []
        for idx in range(len(groups[0])):  # every group's chunk idx, then every group's next one
            answers = [(await _post(api, job_id, chunks[idx])).json() for chunks in groups]
        request_ids = {answer["request_id"] for answer in answers}
        assert len(request_ids) == 40
        for request_id in request_ids:
            assert (await api.result(job_id, request_id))["loss"] is not None


async def test_a_job_holds_a_bounded_total_of_chunks(data_dir):
    """Groups of one job were held without any total: 16 open groups of 64 GiB each could be cached."""
    async with asgi_client(make_app(data_dir, max_tenant_chunk_bytes=350_000)) as http:
        api = Api(http)
        job_id = await api.running()
        first, second = str(uuid.uuid4()), str(uuid.uuid4())

        def chunk(group_id: str, idx: int) -> bytes:
            return _hostile_chunk(
                chunk_idx=idx, total_chunks=10, frame_size_bytes=10**6, group_id=group_id, payload_bytes=100_000
            )

        for group_id in (first, second):
            for idx in (0, 1):
                assert (await _post(api, job_id, chunk(group_id, idx))).json() == {"chunk_cached": True}
        # the second group's chunks pushed the first (least recently sent) out: it must start over
        dropped = await _post(api, job_id, chunk(first, 2))
        assert (dropped.status_code, dropped.json()["code"]) == (409, "chunk_group_restart_required")
        assert (await _post(api, job_id, chunk(second, 2))).json() == {"chunk_cached": True}
        too_big = await _post(api, job_id, chunk(second, 3))  # 4 chunks of 100 kB: over the cap on their own
        assert (too_big.status_code, too_big.json()["code"]) == (413, "payload_too_large")
        assert "max_tenant_chunk_bytes" in too_big.json()["message"]


async def test_a_tenants_jobs_hold_one_total_of_chunks_together(data_dir):
    """The cap was per job: a tenant held it once for each job it had running (2 GiB with two jobs)."""
    async with asgi_client(make_app(data_dir, max_tenant_chunk_bytes=350_000)) as http:
        api = Api(http)
        mine, other = await api.running(), await api.running()

        def chunk(group_id: str, idx: int) -> bytes:
            return _hostile_chunk(
                chunk_idx=idx, total_chunks=10, frame_size_bytes=10**6, group_id=group_id, payload_bytes=100_000
            )

        held = str(uuid.uuid4())
        for idx in (0, 1, 2):  # 300 kB of the 350 kB, in one job
            assert (await _post(api, mine, chunk(held, idx))).json() == {"chunk_cached": True}
        refused = await _post(api, other, chunk(str(uuid.uuid4()), 0))  # the other job may not add 100 kB more
        assert (refused.status_code, refused.json()["code"]) == (429, "too_many_requests"), refused.text
        assert "max_tenant_chunk_bytes" in refused.json()["message"]
        await api.call("POST", f"/{mine}:cancel")  # a job that ends gives its chunks back
        await api.wait_status(mine, "cancelled", "terminated")
        assert (await _post(api, other, chunk(str(uuid.uuid4()), 0))).json() == {"chunk_cached": True}


async def test_hostile_chunk_counts_and_sizes_are_refused_without_building_huge_sets(data_dir):
    """total_chunks and frame_size_bytes were unbounded: total_chunks=10**10 built set(range(10**10)) under the lock."""
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running()
        for idx, total, size, field in (
            (0, 1, 2**40, "frame_size_bytes"),  # above the 64 GiB cap
            (0, 10**10, 10**9, "total_chunks"),  # above the 1_000_000 chunk cap
            (0, 12, 10, "total_chunks"),  # more chunks than the frame has bytes
            (10**10 - 1, 10**10, 10**9, "total_chunks"),  # a final chunk of a never-started group
        ):
            chunk = _hostile_chunk(chunk_idx=idx, total_chunks=total, frame_size_bytes=size, group_id=str(uuid.uuid4()))
            response = await _post(api, job_id, chunk)
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument"), field
            assert f"request_chunk.{field}" in response.json()["message"]
        # the largest allowed group: its final chunk lists a bounded prefix of what is missing
        group_id, total = str(uuid.uuid4()), 1_000_000
        for idx in (0, total - 1):
            response = await _post(
                api,
                job_id,
                _hostile_chunk(chunk_idx=idx, total_chunks=total, frame_size_bytes=10**9, group_id=group_id),
            )
        assert (response.status_code, response.json()["code"]) == (409, "chunk_group_missing_chunks")
        assert response.json()["missing_chunks"][:3] == [1, 2, 3] and len(response.json()["missing_chunks"]) <= 1000


async def test_chunked_result_delivery_pages_events_by_cursor(data_dir):
    app = make_app(data_dir, result_chunk_bytes=20_000)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running()
        batch = small_batch()
        batch["kwargs"]["input_ids"] = batch["kwargs"]["input_ids"].repeat(16, 8)
        batch["kwargs"] = {"input_ids": batch["kwargs"]["input_ids"]}
        accepted = (
            await api.post_frame(
                job_id,
                "forward",
                {"kwargs": batch["kwargs"]},
                op_metadata={"response_options": {"format": "dssst1", "delivery": "chunked"}},
            )
        ).json()
        page = await api.poll(job_id, accepted["request_id"], max_events=1)
        assert page["status"] == "done" and len(page["events"]) == 1 and page["next_cursor"] == "1"
        assert page["events"][0]["type"] == "result_chunk" and page["result"] == {}
        result = await api.result(job_id, accepted["request_id"])
        assert tuple(result["logprobs"].shape) == (64, 56)
        inline = await api.run(
            job_id,
            "POST",
            "operation",
            json={
                "operation_type": "forward",
                "payload": {"payload_b64": base64.b64encode(wire.encode({"kwargs": batch["kwargs"]})).decode()},
            },
        )
        torch.testing.assert_close(inline["logprobs"], result["logprobs"])


def _chunk_store_bytes(page: str) -> dict[str, float]:
    """The ``icefloe_chunk_store_bytes`` series of a /metrics page: job id -> bytes."""
    prefix = 'icefloe_chunk_store_bytes{job_id="'
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith(prefix)
    }


async def test_a_finished_job_lets_go_of_the_chunks_it_held(data_dir):
    """An ended job stayed in memory with its chunk payloads (up to 1 GiB each), still reported by /metrics."""
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running()
        first = chunks_of(_bigger_batch(), max_bytes=9000)[0]
        assert (await _post(api, job_id, first)).json() == {"chunk_cached": True}
        assert _chunk_store_bytes((await http.get("/metrics")).text)[job_id] > 0
        await api.call("POST", f"/{job_id}:cancel")
        await api.wait_status(job_id, "terminated")
        for _ in range(200):  # the job thread lets go just after recording the final state
            if job_id not in _chunk_store_bytes((await http.get("/metrics")).text):
                break
            await asyncio.sleep(0.05)
        assert job_id not in _chunk_store_bytes((await http.get("/metrics")).text)
        logs = (await api.call("POST", f"/{job_id}/operation", json={"operation_type": "tail-logs"})).json()
        assert any("job is terminated" in e["msg"] for e in logs["entries"])  # still read back from its files
        late = await api.call("POST", f"/{job_id}/step", json={}, check=False)
        assert late.status_code == 409 and "terminated" in late.json()["message"]
