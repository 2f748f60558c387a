"""generate-stream: per-prompt result events drained by polls (icefloe.service.operations)."""

from __future__ import annotations

import asyncio
import json

import pytest

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
