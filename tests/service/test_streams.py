"""The budget of undrained generate-stream events (icefloe.service.streams): counted per tenant as events
are pushed, given back when polls drain them or the stream closes, and never exceeded silently."""

from __future__ import annotations

import asyncio
import json

import pytest

from icefloe.protocol import SamplingParams, TooManyRequestsError
from icefloe.service.streams import EVENT_OVERHEAD_BYTES, GenerateStream, StreamBudget
from icefloe.service.work.items import Sample

from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

_N2 = SamplingParams(max_tokens=2, n=2)


def _item(index: int, prompts: int) -> Sample:
    return Sample("s", [[1]] * prompts, [_N2] * prompts, as_json=True, index=index)


def _samples(prompts: int, size: int) -> list[str]:
    return ["x" * size] * (2 * prompts)  # n=2 samples per prompt


def _stream(budget: StreamBudget, owner: str, prompts: int) -> GenerateStream:
    items = [_item(i, 1) for i in range(prompts)]
    return GenerateStream("job-1", owner, budget, items=items, count=prompts)


def test_a_streams_events_count_against_its_tenant_until_drained_or_closed():
    budget = StreamBudget(cap_bytes=1 << 20)
    stream = _stream(budget, "bob", 3)
    stream.push(_item(0, 2), result=_samples(2, 100))
    assert budget.held("bob") == 2 * (200 + EVENT_OVERHEAD_BYTES) and budget.held("alice") == 0
    (first,) = stream.drain(1)
    assert first == {"type": "result", "index": 0, "result": ["x" * 100] * 2}
    assert budget.held("bob") == 200 + EVENT_OVERHEAD_BYTES
    stream.close()
    assert budget.held("bob") == 0
    stream.push(_item(2, 1), result=_samples(1, 100))  # a push after close (the job ended) holds nothing
    assert budget.held("bob") == 0 and stream.pending_events == 0


def test_samples_past_the_cap_fail_the_rest_of_the_stream_with_an_error_naming_the_flag():
    budget = StreamBudget(cap_bytes=4096)
    stream = _stream(budget, "bob", 3)
    stream.push(_item(0, 1), result=_samples(1, 3000))  # holding nothing, a tenant may take one event of any size
    counts = stream.push(_item(1, 1), result=_samples(1, 10))  # over the cap: it and prompt 2 (not run) fail now
    assert stream.push(_item(2, 1), result=_samples(1, 10)) is None  # a late result of a failed prompt: ignored
    events = stream.drain(10)
    assert [e["type"] for e in events] == ["result", "error", "error", "done"]
    assert [e["index"] for e in events[:3]] == [0, 1, 2]
    assert "--max-stream-events-mb" in events[1]["error"] and events[1]["error"] == events[2]["error"]
    assert events[-1] == {"type": "done", "completed": 1, "failed": 2}
    assert json.loads(counts) == {"completed": 1, "failed": 2}
    assert budget.held("bob") == 0


def test_a_tenant_holding_its_cap_is_refused_a_new_stream_naming_the_flag():
    budget = StreamBudget(cap_bytes=1024)
    _stream(budget, "bob", 1).push(_item(0, 1), result=_samples(1, 600))
    budget.check_room("alice")
    with pytest.raises(TooManyRequestsError, match=r"--max-stream-events-mb\); poll \(drain\) your open streams"):
        budget.check_room("bob")


_BIG = {"max_tokens": 32, "n": 4, "logprobs": True, "topk_logprobs": 20, "ignore_eos": True}
_OCTETS = {"content-type": "application/octet-stream"}


@pytest.mark.anyio
async def test_a_stream_over_the_cap_fails_its_rest_and_the_next_waits_until_polls_drain(data_dir):
    """One generate-stream of 128 prompts whose samples (with top-20 log-probs) pass a 1 MiB cap: its first
    item's events are kept, the rest fail naming the cap, a new stream is 429 until they are drained."""
    app = make_app(data_dir, engines="local", max_stream_events_mb=1)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        body = json.dumps({"prompts": [[1, 2, 3, 4]] * 128, "sampling_params": _BIG}).encode()
        first = (await api.call("POST", f"/{job_id}/generate-stream", content=body, headers=_OCTETS)).json()
        stream = app.state.jobs.streams.get(first["request_id"])
        while stream.completed + stream.failed < stream.count:  # every prompt has its event; none is drained
            await asyncio.sleep(0.05)
        refused = await api.call("POST", f"/{job_id}/generate-stream", content=body, headers=_OCTETS, check=False)
        assert refused.status_code == 429, refused.text
        assert "--max-stream-events-mb" in refused.json()["message"]
        events = []
        while not events or events[-1]["type"] != "done":
            events += (await api.poll(job_id, first["request_id"], wait=1, max_events=512))["events"]
        accepted = await api.call("POST", f"/{job_id}/generate-stream", content=body, headers=_OCTETS, check=False)
    results = [e["index"] for e in events if e["type"] == "result"]
    errors = [e for e in events if e["type"] == "error"]
    assert results == list(range(64)) and [e["index"] for e in errors] == list(range(64, 128))
    assert "--max-stream-events-mb" in errors[0]["error"] and events[-1]["failed"] == 64
    assert len(events[0]["result"]["results"]) == 4 and accepted.status_code == 200, accepted.text
