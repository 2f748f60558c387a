"""generate-stream: per-prompt result events drained by polls (icefloe.service.routes.handlers)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from icefloe.engines.host import Lane
from icefloe.protocol import ConflictError
from icefloe.service import lifecycle
from icefloe.service.hosts.seam import LocalEngineHost
from icefloe.service.routes.handlers import submit_generate_stream

from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


async def test_generate_stream_drains_one_event_per_prompt_then_done(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING, SAMPLING)
        await api.wait_status(job_id, "running")
        body = json.dumps({"prompts": [[1, 2], "3+4="], "sampling_params": {"max_tokens": 3, "n": 2}}).encode()
        accepted = (await api.call("POST", f"/{job_id}/generate-stream", content=body,
                                   headers={"content-type": "application/octet-stream"})).json()  # fmt: skip
        assert accepted["count"] == 2 and accepted["job_id"] == job_id
        events = []
        while not events or events[-1]["type"] != "done":
            page = await api.poll(job_id, accepted["request_id"], wait=0, max_events=1)
            assert len(page["events"]) <= 1 and page["status"] in ("pending", "streaming", "done")
            events += page["events"]
            await asyncio.sleep(0.01)
        results = sorted((e["index"], len(e["result"]["results"])) for e in events if e["type"] == "result")
        assert results == [(0, 2), (1, 2)] and events[-1] == {"type": "done", "completed": 2, "failed": 0}
        final = await api.poll(job_id, accepted["request_id"])
        assert (final["status"], final["result"], final["events"]) == ("done", {"completed": 2, "failed": 0}, [])


async def _drain(api: Api, job_id: str, request_id: str) -> list[dict]:
    events: list[dict] = []
    for _ in range(100):
        events += (await api.poll(job_id, request_id, wait=0.2))["events"]
        if events and events[-1]["type"] == "done":
            return events
    raise AssertionError(f"stream {request_id} never finished; its events: {events}")


async def test_streams_generated_in_one_batch_each_get_only_their_own_events(data_dir, monkeypatch):
    """Prompts of two streams were generated together and every event went to the first stream."""
    gate, calls = threading.Event(), []
    original = LocalEngineHost.generate_many

    def gated_generate(self, batch):  # fault: the first batch is slow
        calls.append(sum(len(prompts) for _, prompts, *_ in batch))
        if len(calls) == 1:
            gate.wait(30)
        return original(self, batch)

    monkeypatch.setattr(LocalEngineHost, "generate_many", gated_generate)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        busy = await api.post_frame(job_id, "generate", {"prompts": [[1]], "sampling_params": {"max_tokens": 1}})
        while not calls:
            await asyncio.sleep(0.01)
        accepted = []
        for prompts in ([[1, 2], [3]], [[4, 5, 6]]):  # queued behind the held batch: generated as one
            body = json.dumps({"prompts": prompts, "sampling_params": {"max_tokens": 2}}).encode()
            octet = {"content-type": "application/octet-stream"}
            accepted.append((await api.call("POST", f"/{job_id}/generate-stream", content=body, headers=octet)).json())
        gate.set()
        await api.result(job_id, busy.json()["request_id"])
        first, second = [await _drain(api, job_id, a["request_id"]) for a in accepted]
        assert calls == [1, 3]
        assert sorted(e["index"] for e in first if e["type"] == "result") == [0, 1]
        assert [e["index"] for e in second if e["type"] == "result"] == [0]
        assert first[-1] == {"type": "done", "completed": 2, "failed": 0}
        assert second[-1] == {"type": "done", "completed": 1, "failed": 0}


def _stream_body(prompts: list) -> dict:
    body = json.dumps({"prompts": prompts, "sampling_params": {"max_tokens": 2}}).encode()
    return {"content": body, "headers": {"content-type": "application/octet-stream"}}


async def test_an_engine_crash_during_a_stream_fails_the_job_naming_the_crash(data_dir, monkeypatch):
    """A crash became error events only; the job stayed running and later ended as "client lease expired"."""

    def crash(self, batch):  # fault: the device went away mid-batch
        raise RuntimeError("device lost during sampling")

    monkeypatch.setattr(LocalEngineHost, "generate_many", crash)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        await api.call("POST", f"/{job_id}/generate-stream", **_stream_body([[1, 2], [3]]))
        job = await api.wait_status(job_id, "failed", timeout_s=30)
        assert job["reason"] == (
            f"{job_id}:sampling:0 crashed during generate-stream: RuntimeError: device lost during sampling; "
            "no checkpoint was saved"
        )
        assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 0


async def test_a_cancelled_stream_stays_cancelled_its_prompts_never_run_and_its_events_are_dropped(
    data_dir, monkeypatch
):
    """cancel-request answered cancelled, then the prompts ran anyway and the row flipped to done."""
    gate, calls = threading.Event(), []
    original = LocalEngineHost.generate_many

    def gated_generate(self, batch):  # fault: the first batch holds the sampler
        calls.append(sum(len(prompts) for _, prompts, *_ in batch))
        if len(calls) == 1:
            gate.wait(30)
        return original(self, batch)

    monkeypatch.setattr(LocalEngineHost, "generate_many", gated_generate)
    app = make_app(data_dir, engines="local")
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        busy = await api.post_frame(job_id, "generate", {"prompts": [[1]], "sampling_params": {"max_tokens": 1}})
        while not calls:
            await asyncio.sleep(0.01)
        stream_id = (await api.call("POST", f"/{job_id}/generate-stream", **_stream_body([[1, 2], [3]]))).json()[
            "request_id"
        ]
        cancel = {"operation_type": "cancel-request", "payload": {"request_id": stream_id}}
        answer = (await api.call("POST", f"/{job_id}/operation", json=cancel)).json()
        assert (answer["cancelled"], answer["status"]) == (True, "cancelled")
        gate.set()
        await api.result(job_id, busy.json()["request_id"])
        after = await api.post_frame(job_id, "generate", {"prompts": [[4]], "sampling_params": {"max_tokens": 1}})
        await api.result(job_id, after.json()["request_id"])  # queued behind the stream's prompts: they are past
        assert calls == [1, 1]  # the stream's two prompts never reached the engine
        polled = await api.poll(job_id, stream_id)
        assert (polled["status"], polled["events"]) == ("cancelled", [])
        stored = app.state.db.fetch_all("SELECT status FROM requests WHERE request_id = ?", (stream_id,))
        assert [row["status"] for row in stored] == ["cancelled"]
        assert stream_id not in app.state.jobs.streams


async def test_a_stream_sent_to_a_job_that_stopped_after_its_check_is_refused_and_leaves_nothing_open(data_dir):
    """The worker refused the prompts, but the stream's row stayed pending and its events stayed in memory."""
    app = make_app(data_dir, engines="local")
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        jobs = app.state.jobs
        job = jobs.live(job_id)  # what the route holds once its state check passed
        await api.call("POST", f"/{job_id}:cancel")
        await api.wait_status(job_id, "terminated")
        body = json.dumps({"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}}).encode()
        with pytest.raises(ConflictError, match=f"job {job_id} is stopping: cancelled on request"):
            submit_generate_stream(jobs, job, body, sub_job_id=None)
        rows = app.state.db.fetch_all("SELECT status FROM requests WHERE job_id = ? AND op != 'step'", (job_id,))
        assert [row["status"] for row in rows] == ["cancelled"]
        assert not jobs.requests.has_open(job_id) and len(jobs.streams) == 0


async def test_a_request_queued_behind_a_crash_is_cancelled_naming_the_crash(data_dir, monkeypatch):
    """A request queued behind the call that crashed the job said only "stopped (running)", not why."""
    gate, calls = threading.Event(), []

    def crash_when_let_go(self, batch):  # fault: the device goes away during the first batch
        calls.append(len(batch))
        gate.wait(30)
        raise RuntimeError("device lost during sampling")

    monkeypatch.setattr(LocalEngineHost, "generate_many", crash_when_let_go)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        body = {"prompts": [[1]], "sampling_params": {"max_tokens": 1}}
        await api.post_frame(job_id, "generate", body)
        while not calls:
            await asyncio.sleep(0.01)
        queued = (await api.post_frame(job_id, "generate", body)).json()["request_id"]
        gate.set()
        polled = await api.poll(job_id, queued)
        assert polled["status"] == "cancelled", polled
        assert polled["error"].endswith(
            f"stopped before this request ran: {job_id}:sampling:0 crashed during generate: "
            "RuntimeError: device lost during sampling; no checkpoint was saved"
        ), polled["error"]
        assert calls == [1]


async def test_a_call_to_a_job_that_just_failed_names_the_failure_before_its_row_does(data_dir, monkeypatch):
    """The job's status moves in memory before its row: a call in between read "is failed" with no reason."""
    app = make_app(data_dir, engines="local")
    async with asgi_client(app) as http:
        job_id = await Api(http).running(TRAINING)
        job = app.state.jobs.live(job_id)
        monkeypatch.setattr(lifecycle.store, "update_job", lambda *args, **kwargs: None)  # the row lags
        job.state.fail("the engines of host-1 died during step")
        job.state.finish()
        with pytest.raises(ConflictError, match=r"is failed \(the engines of host-1 died during step\)"):
            app.state.jobs.live(job_id)


async def test_an_engine_operation_is_a_request_with_a_row_and_metrics(data_dir):
    """The operation route queued its engine ops on the lane directly: no request row, no metrics, no deadline."""
    app = make_app(data_dir, engines="local")
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        answer = await api.call("POST", f"/{job_id}/operation", json={"operation_type": "reset-prefix-cache"})
        page = (await http.get("/metrics")).text
        rows = app.state.db.fetch_all("SELECT op, status, sub_job_id FROM requests WHERE job_id = ?", (job_id,))
    assert answer.json() == {"sub_job_id": f"{job_id}:sampling:0", "status": "ok"}
    assert rows == [{"op": "reset-prefix-cache", "status": "done", "sub_job_id": f"{job_id}:sampling:0"}]
    assert 'icefloe_requests_total{op="reset-prefix-cache",outcome="done"} 1.0' in page
    assert 'icefloe_engine_seconds_count{op="reset-prefix-cache"} 1.0' in page


async def test_a_stream_of_many_prompts_queues_few_items_and_a_refused_prompt_fails_alone(data_dir, monkeypatch):
    """Each prompt was an item with its own future and lock (about 2.5 KB a prompt); prompts queued as one
    item keep their own events, and a prompt the engine refuses fails only its own."""
    queued = []
    original = Lane.put

    def counted(self, work):
        if work.key is not None:
            queued.append(work.item)
        return original(self, work)

    monkeypatch.setattr(Lane, "put", counted)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        too_long = [1] * 60  # under the sampler's 64 positions, but not with 8 tokens to sample
        prompts = [[1, 2]] * 100 + [too_long] + [[3]] * 27
        body = json.dumps({"prompts": prompts, "sampling_params": {"max_tokens": 8}}).encode()
        accepted = (await api.call("POST", f"/{job_id}/generate-stream", content=body,
                                   headers={"content-type": "application/octet-stream"})).json()  # fmt: skip
        events = await _drain(api, job_id, accepted["request_id"])
    assert accepted["count"] == 128 and len(queued) == 2
    assert sorted(e["index"] for e in events if e["type"] == "result") == [i for i in range(128) if i != 100]
    (error,) = [e for e in events if e["type"] == "error"]
    assert error["index"] == 100 and "prompts[0] (60 tokens) + max_tokens (8) exceeds" in error["error"], error
    assert events[-1] == {"type": "done", "completed": 127, "failed": 1}
