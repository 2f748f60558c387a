"""POST {job}/batch (the batch_submit extension): several fwd_bwd / step ops in one request, in order."""

from __future__ import annotations

import pytest

from icefloe import wire

from .service_batches import small_batch
from .service_client import Api
from .service_harness import client_for, make_app

pytestmark = pytest.mark.anyio


def _ops(app, job_id: str) -> list[str]:
    rows = app.state.db.fetch_all("SELECT op FROM requests WHERE job_id = ? ORDER BY created_at, rowid", (job_id,))
    return [row["op"] for row in rows]


async def test_batch_queues_its_ops_in_order_and_answers_each_like_its_own_post(data_dir):
    app = make_app(data_dir)
    async with client_for(app, "uvicorn") as http:
        api = Api(http)
        job_id = await api.running()
        ops = {"ops": [{"op": "forward-backward", "batch": small_batch()}, {"op": "step", "learning_rate": 0.01}]}
        answer = (await api.post_frame(job_id, "batch", ops, params={"wait": 30})).json()
        trained, stepped = answer["answers"]
        assert answer["job_id"] == job_id
        assert trained["status"] == stepped["status"] == "done"
        assert isinstance(trained["result"]["loss"], float)
        assert stepped["result"]["global_step"] == 1 and stepped["result"]["grad_norm"] > 0
        assert stepped["result"]["lr"] == 0.01
        polled = await api.poll(job_id, stepped["request_id"])  # each op is an ordinary request
        assert polled["result"] == stepped["result"]
        assert _ops(app, job_id) == ["forward-backward", "step"]

        accepted = (await api.post_frame(job_id, "batch", {"ops": [{"op": "step"}, {"op": "step"}]})).json()
        assert [set(a) for a in accepted["answers"]] == [{"request_id", "job_id"}] * 2  # no wait: ids only


async def test_a_refused_op_is_answered_in_its_own_entry_and_the_others_run(data_dir):
    app = make_app(data_dir)
    async with client_for(app, "uvicorn") as http:
        api = Api(http)
        job_id = await api.running()
        broken = small_batch()
        broken["kwargs"]["input_ids"] = broken["kwargs"]["input_ids"] + 10_000  # outside the vocabulary
        ops = {
            "ops": [
                {"op": "forward-backward", "batch": broken},
                {"op": "forward-backward", "batch": small_batch()},
                {"op": "step", "learning_rate": -1},
                {"op": "save"},
                {"op": "step"},
            ]
        }
        answers = (await api.post_frame(job_id, "batch", ops, params={"wait": 30})).json()["answers"]
        bad_batch, trained, bad_rate, unknown, stepped = answers
        for refused in (bad_batch, bad_rate, unknown):
            assert refused["request_id"] is None and refused["status"] == "failed"
            assert (refused["status_code"], refused["code"]) == (400, "invalid_argument")
        assert bad_batch["error"].startswith("ops.0 (forward-backward): ") and "input_ids" in bad_batch["error"]
        assert bad_rate["error"].startswith("ops.2.learning_rate")
        assert unknown["error"].startswith("ops.3.op must be one of")
        assert trained["status"] == stepped["status"] == "done" and stepped["result"]["global_step"] == 1
        assert _ops(app, job_id) == ["forward-backward", "step"]

        empty = await api.post_frame(job_id, "batch", {"ops": []}, check=False)
        assert empty.status_code == 400 and "at least one op" in empty.text
        too_many = await api.post_frame(job_id, "batch", {"ops": [{"op": "step"}] * 65}, check=False)
        assert too_many.status_code == 400 and "at most 64" in too_many.text
        assert _ops(app, job_id) == ["forward-backward", "step"]


async def test_a_batch_retried_with_its_idempotency_key_runs_once(data_dir):
    app = make_app(data_dir)
    async with client_for(app, "uvicorn") as http:
        api = Api(http)
        job_id = await api.running()
        ops = {"ops": [{"op": "forward-backward", "batch": small_batch()}, {"op": "step"}]}
        headers = {"Idempotency-Key": "batch-once", "content-type": "application/octet-stream"}
        post = {"content": wire.encode(ops), "params": {"wait": 30}, "headers": headers}
        first = (await api.call("POST", f"/{job_id}/batch", **post)).json()
        again = await api.call("POST", f"/{job_id}/batch", **post)
        assert again.headers.get("idempotent-replayed") == "true" and again.json() == first
        assert _ops(app, job_id) == ["forward-backward", "step"]
