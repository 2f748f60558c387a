"""generate-stream: per-prompt result events drained by polls (icefloe.service.operations)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from icefloe.service.runtime import LocalEngineHost

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
    original = LocalEngineHost.generate

    def gated_generate(self, sub_job_id, prompts, params):  # fault: the first batch is slow
        calls.append(len(prompts))
        if len(calls) == 1:
            gate.wait(30)
        return original(self, sub_job_id, prompts, params)

    monkeypatch.setattr(LocalEngineHost, "generate", gated_generate)
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
