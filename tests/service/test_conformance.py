"""The training API as the reference writes it: the SFT forward-backward object, tail-logs paging."""

from __future__ import annotations

import pytest
import torch

from .service_batches import canonical_batch
from .service_client import TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio

ROWS = [([1, 11, 2, 13], [3, 1]), ([3, 12], [4, 13, 5])]


def sft_object(frame: dict) -> dict:
    """``{args, kwargs: {input_ids, attention_mask, position_ids, labels}}``: labels pre-shifted, -100 ignored."""
    ids_BS = frame["kwargs"]["input_ids"]
    labels_BS = torch.where(frame["context"]["loss_mask"] > 0, ids_BS.roll(-1, dims=1), -100)
    return {"args": (), "kwargs": {**frame["kwargs"], "labels": labels_BS}}


async def test_the_sft_object_trains_with_cross_entropy(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running(TRAINING)
        frame = canonical_batch(ROWS, [0.0, 0.0])
        sft = (await api.post_frame(job_id, "forward-backward", sft_object(frame))).json()
        frame["processing"] = {"loss_fn": "cross_entropy", "config": {}}
        same = (await api.post_frame(job_id, "forward-backward", frame)).json()
        sft_result = await api.result(job_id, sft["request_id"])
        same_result = await api.result(job_id, same["request_id"])
        assert sft_result["loss"] == pytest.approx(same_result["loss"]) and sft_result["num_tokens"] == 5
        assert (await api.run(job_id, "POST", "step", json={}))["global_step"] == 1


async def test_tail_logs_says_eof_at_the_end_of_a_running_jobs_log(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running(TRAINING)

        async def page(**payload) -> dict:
            body = {"operation_type": "tail-logs", "sub_job_type": "training", "payload": payload}
            return (await api.call("POST", f"/{job_id}/operation", json=body)).json()

        whole = await page(max_lines=500)
        assert whole["entries"] and whole["eof"] is True
        first = await page(max_lines=1)
        assert len(first["entries"]) == 1 and first["eof"] is False
        rest = await page(cursor=first["next_cursor"], max_lines=500)
        assert first["entries"] + rest["entries"] == whole["entries"] and rest["eof"] is True
        empty = await page(cursor=rest["next_cursor"])
        assert empty == {"entries": [], "next_cursor": rest["next_cursor"], "eof": True}
