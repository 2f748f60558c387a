"""Tensor result files are kept for ServeSettings.result_ttl_s after their request finished, then deleted."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from .service_batches import small_batch
from .service_client import Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


async def _forward(api: Api, job_id: str) -> str:
    """A forward whose result (log-probs) is a DSSST1 frame on disk; returns its request id."""
    accepted = await api.post_frame(job_id, "forward", {"kwargs": small_batch()["kwargs"]})
    return accepted.json()["request_id"]


def _result_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / "jobs").glob("*/results/*"))


async def _expired(api: Api, job_id: str, request_id: str, *, timeout_s: float = 30.0) -> dict:
    """The poll refusal once the request's result has expired (done polls before it are fine)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await api.call("GET", f"/{job_id}/requests/{request_id}", params={"wait": 30}, check=False)
        if response.status_code != 200:
            return {"status_code": response.status_code, **response.json()}
        assert response.json()["status"] in ("pending", "running", "done"), response.json()
        assert time.monotonic() < deadline, f"the result of {request_id} never expired"
        await asyncio.sleep(0.05)


async def test_results_outlive_draining_and_their_job_then_expire_after_their_ttl(data_dir):
    """Every forward's result file stayed on disk forever: drained, its job ended, nothing deleted it."""
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running()
        request_ids = [await _forward(api, job_id) for _ in range(3)]
        first = [await api.result(job_id, request_id) for request_id in request_ids]
        await api.call("POST", f"/{job_id}:cancel")
        await api.wait_status(job_id, "terminated")
        for request_id, result in zip(request_ids, first, strict=True):  # a re-poll after a lost answer
            torch.testing.assert_close(await api.result(job_id, request_id), result)
        assert len(_result_files(data_dir)) == 3

    async with asgi_client(make_app(data_dir, engines="local", result_ttl_s=0.5)) as http:
        api = Api(http)
        refusal = await _expired(api, job_id, request_ids[0])  # files of an earlier service's job
        assert refusal["status_code"] == 410 and refusal["code"] == "not_found"
        assert f"result of request {request_ids[0]} expired" in refusal["message"]
        assert "ServeSettings.result_ttl_s=0.5 s" in refusal["message"]
        live_job = await api.running()
        request_id = await _forward(api, live_job)
        assert (await _expired(api, live_job, request_id))["status_code"] == 410  # swept while the service runs
        assert _result_files(data_dir) == []
        assert (await api.job(live_job))["status"] == "running"  # expiry touches results only


def test_held_results_render_once_answer_a_resent_poll_alike_and_let_the_oldest_go():
    from icefloe.service.results import HeldResults

    held, rendered = HeldResults(max_results=2), []

    def render(result):
        rendered.append(result)
        return f"answer to {result}"

    held.put("a", 1)
    assert held.answer("a", render) == held.answer("a", render) == "answer to 1"
    assert rendered == [1]  # the second poll got the first answer, not a second rendering
    held.put("b", 2)
    held.put("c", 3)  # past max_results: the oldest goes
    assert not held.held("a") and held.held("b") and held.held("c")
    with pytest.raises(KeyError):
        held.answer("a", render)
