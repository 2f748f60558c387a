"""Request answers: a POST with ``?wait=`` (icefloe extension) carries the poll answer; without it, only the id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from icefloe import wire
from icefloe.service import store
from icefloe.service.results import json_text

from .service_batches import small_batch
from .service_client import SAMPLING, TRAINING, Api
from .service_harness import client_for, make_app

pytestmark = pytest.mark.anyio

_POLL_KEYS = {"request_id", "job_id", "status", "created_at", "updated_at", "result", "error", "events", "next_cursor"}


async def test_post_wait_answers_with_the_finished_request(data_dir):
    async with client_for(make_app(data_dir), "uvicorn") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        trained = (await api.post_frame(job_id, "forward-backward", small_batch(), params={"wait": 30})).json()
        assert set(trained) == _POLL_KEYS and trained["status"] == "done"
        assert isinstance(trained["result"]["loss"], float)
        stepped = (await api.call("POST", f"/{job_id}/step", json={}, params={"wait": 30})).json()
        assert set(stepped) == _POLL_KEYS and stepped["status"] == "done"
        assert stepped["result"]["global_step"] == 1
        # the answer equals what a poll of the same request returns
        polled = await api.poll(job_id, stepped["request_id"])
        assert polled == {k: v for k, v in stepped.items() if k != "job_id"}


async def test_post_without_wait_answers_only_the_request_id(data_dir):
    async with client_for(make_app(data_dir), "asgi") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        accepted = (await api.post_frame(job_id, "forward-backward", small_batch())).json()
        assert set(accepted) == {"request_id", "job_id"}
        stepped = (await api.call("POST", f"/{job_id}/step", json={})).json()
        assert set(stepped) == {"request_id", "job_id"}
        assert (await api.result(job_id, stepped["request_id"]))["global_step"] == 1


async def test_post_wait_carries_a_tensor_result_as_an_inline_envelope(data_dir):
    async with client_for(make_app(data_dir), "asgi") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        answer = (
            await api.post_frame(
                job_id,
                "forward",
                small_batch(),
                op_metadata={"response_options": {"format": "dssst1"}},
                params={"wait": 30},
            )
        ).json()
        assert answer["status"] == "done" and answer["result"]["wire_format"] == "DSSST1"
        logprobs_BS = wire.decode_inline_result(answer["result"])["logprobs"]
        assert tuple(logprobs_BS.shape) == tuple(small_batch()["kwargs"]["input_ids"].shape)


async def test_post_wait_replayed_by_idempotency_key_runs_once_and_repeats_the_answer(data_dir):
    app = make_app(data_dir)
    async with client_for(app, "asgi") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        headers = {"Idempotency-Key": "step-once"}
        await api.fwd_bwd(job_id)
        first = await api.call("POST", f"/{job_id}/step", json={}, params={"wait": 30}, headers=headers)
        again = await api.call("POST", f"/{job_id}/step", json={}, params={"wait": 30}, headers=headers)
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.json() == first.json() and first.json()["result"]["global_step"] == 1
        rows = app.state.db.fetch_all("SELECT op FROM requests WHERE job_id = ? AND op = 'step'", (job_id,))
        assert len(rows) == 1


async def test_post_wait_of_a_failing_request_answers_failed_with_the_error(data_dir):
    async with client_for(make_app(data_dir), "asgi") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        batch = small_batch()
        batch["processing"] = {"loss_fn": "grpo", "config": {"loss_agg_mode": "no-such-mode"}}  # fails as it runs
        answer = (await api.post_frame(job_id, "forward-backward", batch, params={"wait": 30})).json()
        assert answer["status"] == "failed" and "loss_agg_mode" in answer["error"]
        assert answer["result"] == {}


async def test_a_generate_result_asked_as_dssst1_holds_the_samples_not_their_json_text(data_dir):
    async with client_for(make_app(data_dir), "asgi") as http:
        api = Api(http)
        job_id = await api.create(TRAINING, SAMPLING)
        await api.wait_status(job_id, "running")
        body = {"prompts": [[1, 2, 3], [4, 5]], "sampling_params": {"max_tokens": 2, "seed": 1}}
        answer = (
            await api.post_frame(
                job_id, "generate", body, op_metadata={"response_options": {"format": "dssst1"}}, params={"wait": 30}
            )
        ).json()
        assert answer["status"] == "done" and answer["result"]["wire_format"] == "DSSST1"
        decoded = wire.decode_inline_result(answer["result"])
        assert decoded["job_id"] == job_id and len(decoded["results"]) == 2
        assert all(len(sample["token_ids"]) >= 1 for sample in decoded["results"])


def test_json_text_writes_non_finite_floats_as_null_and_leaves_tensors_to_frames():
    assert json.loads(json_text({"loss": float("nan"), "lr": float("inf"), "n": 2**70})) == {
        "loss": None,
        "lr": None,
        "n": 2**70,
    }
    assert json.loads(json_text({3: "key"})) == {"3": "key"}
    assert json_text({"logprobs": torch.zeros(2)}) is None


async def test_a_request_row_holds_the_engine_result_and_only_the_answer_has_the_envelope(data_dir):
    """No API renders on the worker: a request's row (SQLite) keeps what the engine made, and the training
    API's envelope (job_id, global_steps, a path the caller may read) is put on when it is answered,
    by the same service or by the next one after a restart."""
    app = make_app(data_dir)
    async with client_for(app, "asgi") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        trained = (await api.post_frame(job_id, "forward-backward", small_batch(), params={"wait": 30})).json()
        stepped = (await api.call("POST", f"/{job_id}/step", json={}, params={"wait": 30})).json()
        saved = (await api.call("POST", f"/{job_id}/save", json={}, params={"wait": 30})).json()
        stored = {
            name: json.loads(store.get_request(app.state.db, request_id=answer["request_id"])["result"])
            for name, answer in (("fwd_bwd", trained), ("step", stepped), ("save", saved))
        }
        assert not any("job_id" in result for result in stored.values())
        assert "global_steps" not in stored["step"] and "post_process_outputs" not in stored["fwd_bwd"]
        assert stored["save"]["path"].startswith(str(data_dir))  # the engine's folder, never shown
        folder = str(Path(stored["save"]["path"]).relative_to(data_dir))
        step = stored["step"]
        expected = {
            trained["request_id"]: {"job_id": job_id, **stored["fwd_bwd"], "post_process_outputs": {}},
            stepped["request_id"]: {"job_id": job_id, "global_steps": 1, "last_lr": step["lr"], **step},
            saved["request_id"]: {
                "job_id": job_id, "checkpoint_path": folder, "checkpoint_tag": stored["save"]["checkpoint_id"],
                **stored["save"], "path": folder,
            },
        }  # fmt: skip
        for answer in (trained, stepped, saved):
            assert answer["result"] == expected[answer["request_id"]]
    async with client_for(make_app(data_dir), "asgi") as http:
        api = Api(http)
        for request_id, result in expected.items():
            assert (await api.poll(job_id, request_id))["result"] == result


async def test_a_forward_backward_with_tensors_gets_its_envelope_in_the_answers_frame(data_dir):
    """A result with tensors is stored as the engine's DSSST1 frame; the answer's frame has the envelope."""
    async with client_for(make_app(data_dir), "asgi") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        batch = small_batch()
        batch["processing"] = {"loss_fn": "grpo", "config": {"return_logprobs": True}}
        accepted = (await api.post_frame(job_id, "forward-backward", batch, params={"wait": 30})).json()
        result = wire.decode_inline_result(accepted["result"])
        assert result["job_id"] == job_id and result["post_process_outputs"] == {}
        assert tuple(result["logprobs"].shape) == tuple(batch["kwargs"]["input_ids"].shape)
