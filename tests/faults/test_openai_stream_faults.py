"""The OpenAI endpoint of a real ``icefloe serve`` streamed to a hostile tenant: a request whose stop
string is built to cost the service's event loop, while every other tenant's call waits on that loop."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from .loop_watch import health_latencies_during, post_in_another_process
from .tinker_serve import TOKENS, tinker_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`


def test_a_streamed_completion_with_a_long_stop_string_does_not_stall_the_service(tmp_path):
    """One streamed completion (n=32, 60 tokens, one stop string of 200,000 characters, a 200 KB body)
    held the event loop about 95% of the time it ran: /health, and every tenant's call of every API,
    waited through it (24.7 s of 24.8 s for n=64 and 300,000 characters; n and the stop strings allowed
    go to 1,024 and 4 x about 500,000)."""
    with tinker_serve(tmp_path) as serve:
        url = f"{serve.base_url}/oai/v1/completions"
        hostile = {"model": "tiny-chat", "prompt": "hello", "n": 32, "max_tokens": 60, "ignore_eos": True,
                   "stream": True, "stop": ["x" * 200_000]}  # fmt: skip
        warm = httpx.post(url, json={**hostile, "stream": False, "max_tokens": 1},
                          headers={"Authorization": f"Bearer {TOKENS['bob']}"}, timeout=600)  # fmt: skip
        assert warm.status_code == 200, warm.text  # the model is loaded: what follows is the stream alone

        body = tmp_path / "hostile.json"
        body.write_text(json.dumps(hostile))
        started = time.perf_counter()
        headers = {"Authorization": f"Bearer {TOKENS['bob']}", "Content-Type": "application/json"}
        process = post_in_another_process(url, str(body), headers)
        latencies = health_latencies_during(process, serve.base_url)
        answer = json.loads(process.communicate()[0])
        took = time.perf_counter() - started
        print(f"stream: {took:.2f} s, {answer['events']} events, /health at most {max(latencies):.3f} s")
        assert answer["status"] == 200 and answer["events"] >= 2, answer  # it streamed
        assert max(latencies) < 0.5 * took, (max(latencies), took)
