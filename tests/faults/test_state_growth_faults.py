"""What one tenant's requests leave in a real ``icefloe serve`` process, probed as a hostile tenant would:
memory the service keeps for a job (undrained stream events, open request-chunk groups) must stay
bounded for the tenant, however many requests or jobs it spreads that memory over, and a LoRA job that
joins another tenant's shared host must not be able to take that host's memory."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from icefloe import wire

from .serve_process import PREFIX, TRAINING, Serve, wait_for
from .tinker_serve import TOKENS, tinker_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

_SAMPLING = {"job_type": "sampling", "model_name": "tiny:arith", "inference_config": {"max_seq_len": 256}}
_OCTETS = {"Content-Type": "application/octet-stream"}
_MiB = 2**20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tinker_serve(tmp_path_factory.mktemp("state-growth-faults"), "--max-stream-events-mb", "64") as serve:
        yield serve


def _api(serve: Serve, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=serve.base_url + PREFIX, headers={"Authorization": f"Bearer {TOKENS[tenant]}"},
                        timeout=120)  # fmt: skip


def _resident_mib(serve: Serve) -> float:
    """The service process's resident memory (its engines run in processes of their own)."""
    status = Path(f"/proc/{serve.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def _idle(serve: Serve, job_id: str) -> bool:
    """No request of ``job_id`` is pending, running or streaming (the admin's ``/metrics`` queue depth);
    a poll would drain the events whose memory is measured."""
    page = httpx.get(serve.base_url + "/metrics", headers={"Authorization": f"Bearer {TOKENS['admin']}"}, timeout=60)
    page.raise_for_status()
    return not any(line.startswith("icefloe_queue_depth{") and job_id in line for line in page.text.splitlines())


def _running_job(serve: Serve, api: httpx.Client, sub_job: dict) -> str:
    job_id = api.post("/", json={"sub_job_configs": [sub_job]}).json()["job_id"]
    serve.wait_job(job_id, "running")
    return job_id


def test_undrained_generate_stream_events_stay_bounded_per_job(served):
    """Six generate-streams that no one polls grew the service by ~640 MiB (~106 MiB each: 256 prompts x
    n=4 x 32 tokens with top-20 log-probs), held until the job ends; more streams, more memory. Under a
    64 MiB cap of undrained events the later streams are refused (429) or fail their remaining prompts
    naming the cap, and a poll still gets an event for every prompt of each stream accepted."""
    with _api(served, "bob") as bob:
        job_id = _running_job(served, bob, _SAMPLING)
        params = {"max_tokens": 32, "n": 4, "logprobs": True, "topk_logprobs": 20, "ignore_eos": True}
        body = json.dumps({"prompts": [[1, 2, 3, 4]] * 256, "sampling_params": params}).encode()
        before = _resident_mib(served)
        answers = [bob.post(f"/{job_id}/generate-stream", content=body, headers=_OCTETS) for _ in range(6)]
        assert all(answer.status_code in (200, 429) for answer in answers), [a.text for a in answers]
        wait_for(lambda: _idle(served, job_id), 600, f"job {job_id} finishes its streams")
        grown = _resident_mib(served) - before
        streams = [
            _drained(bob, job_id, answer.json()["request_id"]) for answer in answers if answer.status_code == 200
        ]
        bob.post(f"/{job_id}:cancel")
    assert grown < 256, f"the service grew {grown:.0f} MiB holding six undrained streams of one job"
    refusals = [a.json()["message"] for a in answers if a.status_code == 429]
    errors = [e["error"] for events in streams for e in events if e["type"] == "error"]
    assert all("--max-stream-events-mb" in text for text in refusals + errors) and refusals + errors, answers
    for events in streams:  # every prompt has its event: no sample is lost without an error saying so
        assert sorted(e["index"] for e in events if e["type"] in ("result", "error")) == list(range(256))


def _drained(api: httpx.Client, job_id: str, request_id: str) -> list[dict]:
    events: list[dict] = []
    while not events or events[-1]["type"] != "done":
        page = api.get(f"/{job_id}/requests/{request_id}", params={"max_events": 512, "wait": 5})
        page.raise_for_status()
        events += page.json()["events"]
    return events


def _open_chunk(group_id: str, index: int, payload: bytes) -> bytes:
    """Chunk ``index`` of a group declaring 1,000 chunks of ``payload``'s size: it never completes."""
    descriptor = {"chunk_idx": index, "total_chunks": 1000, "frame_sha256": "0" * 64,
                  "frame_size_bytes": 1000 * len(payload), "chunk_group_id": group_id}  # fmt: skip
    return wire.encode({"payload": np.frombuffer(payload, dtype=np.uint8)}, op_metadata={"request_chunk": descriptor})


def test_open_chunk_groups_are_bounded_per_tenant_not_per_job(served):
    """The 1 GiB cap on open request chunks is per job: a tenant held 1 GiB per running job it had (2 GiB
    of the service's memory in 7 s with two jobs, 1.8 GiB here with three of 600 MiB each; a tenant
    without limits could hold it for each of 32 LoRA jobs on one slot)."""
    piece = os.urandom(50 * _MiB)
    with _api(served, "bob") as bob:
        jobs = [_running_job(served, bob, TRAINING) for _ in range(3)]
        before = _resident_mib(served)
        for job_id in jobs:
            group_id = str(uuid.uuid4())
            for index in range(12):  # 600 MiB per job, under the per-job cap; 1.8 GiB in all
                body = _open_chunk(group_id, index, piece[:-1] + bytes([index]))
                answer = bob.post(f"/{job_id}/forward-backward", content=body, headers=_OCTETS)
                assert answer.status_code in (200, 409, 413, 429), answer.text
        grown = _resident_mib(served) - before
        for job_id in jobs:
            bob.post(f"/{job_id}:cancel")
    assert grown < 1280, f"one tenant's open chunk groups grew the service by {grown:.0f} MiB"


_LORA = {
    "job_type": "training",
    "model_name": "tiny-chat",
    "training_config": {"max_seq_len": 64, "peft_config": {"peft_type": "Lora", "r": 4}},
}


def _wide_lora(rank: int) -> dict:
    return {**_LORA, "training_config": {"max_seq_len": 64, "peft_config": {"peft_type": "Lora", "r": rank}}}


def test_a_lora_rank_the_tinker_api_refuses_does_not_join_another_tenants_host(served):
    """The Tinker API caps a LoRA rank at 1024; the training API takes any, and the job joins the shared host
    of its base: r=20,000 grew Bob's host's engine process from 326 to 536 MiB at join and 746 MiB after one
    forward-backward, and the cost is linear in r, so one tenant's create can exhaust a host others train on."""
    with _api(served, "bob") as bob, _api(served, "alice") as alice:
        bobs = _running_job(served, bob, _LORA)
        host = bob.get(f"/{bobs}").json()["host"]["host_id"]
        answer = alice.post("/", json={"sub_job_configs": [_wide_lora(20_000)]})
        joined = (
            answer.status_code == 200 and served.wait_job(answer.json()["job_id"], "running")["host"]["host_id"] == host
        )
        for job_id in (bobs, answer.json().get("job_id")):
            if job_id:
                served.call("POST", f"/{job_id}:cancel")
    assert answer.status_code == 400 or (answer.status_code == 200 and not joined), answer.text


def test_the_metrics_a_client_reports_are_bounded_per_job(served):
    """``POST {job}/metrics`` took 256 names per report and any step, and every point stayed in SQLite for
    good: 4,000 reports (7 s) made 1M rows and a 571 MB database, and ``GET {job}/metrics`` then built a
    204 MiB answer on the event loop in 3.0 s, holding every tenant's ``/health`` for 2.7 s. Now a job
    keeps a bounded number of reported values (409 past it) and the series is answered a page at a time."""
    name = "x" * 200
    with _api(served, "bob") as bob:
        job_id = _running_job(served, bob, _SAMPLING)
        answers = []
        for step in range(1000):
            report = {"step": step, "metrics": {f"{name}{k}": 1.0 for k in range(256)}}
            answers.append(bob.post(f"/{job_id}/metrics", json=report).status_code)
            assert answers[-1] in (200, 400, 409, 429)
        pages = [bob.get(f"/{job_id}/metrics")]
        while pages[-1].status_code == 200 and pages[-1].json()["next_after_step"] is not None:
            pages.append(bob.get(f"/{job_id}/metrics", params={"after_step": pages[-1].json()["next_after_step"]}))
        bob.post(f"/{job_id}:cancel")
    for page in pages:
        assert page.status_code == 200, page.text[:500]
        assert len(page.content) < 16 * _MiB, (
            f"a page of a job's metric series holds {len(page.content) / _MiB:.0f} MiB"
        )
    kept = sum(len(point) - 2 for page in pages for point in page.json()["points"])  # less each point's step, time
    assert 409 in answers, "the job kept every report of 256,000 values"
    assert kept == 256 * answers.count(200), f"the job kept {kept} values of {answers.count(200)} reports it took"
