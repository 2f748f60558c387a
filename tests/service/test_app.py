"""End-to-end walks of the training API against the ASGI app and a real uvicorn server."""

from __future__ import annotations

import base64
import math

import pytest

from icefloe import wire

from .service_batches import canonical_batch, small_batch
from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, client_for, make_app

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("transport", ["asgi", "uvicorn"])
async def test_job_lifecycle_walks_every_endpoint(data_dir, transport):
    app = make_app(data_dir)
    async with client_for(app, transport) as http:
        api = Api(http)
        caps = (await api.call("GET", "/capabilities")).json()
        assert caps["extensions"] == {
            "long_poll": True,
            "idempotency_keys": True,
            "forward": True,
            "inline_wait": True,
            "sequenced_submit": True,
            "batch_requests": True,
            "leases": True,
            "job_metrics": True,
        }
        assert caps["limits"]["lease_ttl_ms"] == 600_000
        assert set(caps["ops"]) == {
            "forward-backward", "forward", "step", "save", "load", "generate", "weight-sync", "reset-prefix-cache",
            "list-checkpoints", "export-checkpoint", "delete-checkpoint", "cancel",
        }  # fmt: skip
        job_id = await api.create(TRAINING, SAMPLING, experiment_name="walk")
        job = await api.wait_status(job_id, "running")
        assert [s["sub_job_id"] for s in job["sub_jobs"]] == [f"{job_id}:training:0", f"{job_id}:sampling:0"]
        capacity = (await api.call("GET", "/capacity")).json()
        assert (capacity["slot_kind"], capacity["in_use_slots"], capacity["available_slots"]) == ("cpu", 2, 2)

        accepted = (await api.post_frame(job_id, "forward-backward", small_batch())).json()
        assert set(accepted) == {"request_id", "job_id"}
        fwd_bwd = await api.result(job_id, accepted["request_id"])
        assert math.isfinite(fwd_bwd["avg_loss"]) and fwd_bwd["loss"] == fwd_bwd["avg_loss"]
        assert fwd_bwd["post_process_outputs"] == {} and fwd_bwd["num_tokens"] == 16

        step = await api.run(job_id, "POST", "step", json={"learning_rate": 5e-4})
        assert step["global_steps"] == step["global_step"] == 1 and step["last_lr"] == step["lr"] == 5e-4

        sync = await api.run(
            job_id,
            "POST",
            "operation",
            json={
                "operation_type": "weight-sync",
                "sub_job_id": f"{job_id}:training:0",
                "sub_job_type": "training",
                "payload": {
                    "source_sub_job_id": f"{job_id}:training:0",
                    "target_sub_job_ids": [f"{job_id}:sampling:0"],
                },
            },
        )
        assert sync["policy_version"] == 1 and sync["bytes"] > 0

        accepted = (
            await api.post_frame(
                job_id,
                "generate",
                {
                    "prompts": [[1, 2, 3], "12+3="],
                    "sampling_params": [{"max_tokens": 4, "temperature": 0.0}, {"max_tokens": 2}],
                },
            )
        ).json()
        generated = await api.result(job_id, accepted["request_id"])
        reset = await api.call("POST", f"/{job_id}/operation", json={"operation_type": "reset-prefix-cache"})
        assert reset.json() == {"sub_job_id": f"{job_id}:sampling:0", "status": "ok"}
        assert len(generated["results"]) == 2
        assert [r["policy_version"] for r in generated["results"]] == [1, 1]
        assert [len(r["token_ids"]) <= cap for r, cap in zip(generated["results"], (4, 2), strict=True)] == [True] * 2

        frame = wire.encode(small_batch())
        forward = await api.run(
            job_id,
            "POST",
            "operation",
            json={
                "operation_type": "forward",
                "sub_job_type": "training",
                "payload": {
                    "payload_b64": base64.b64encode(frame).decode(),
                    "content_type": "application/octet-stream",
                },
            },
        )
        assert tuple(forward["logprobs"].shape) == tuple(forward["entropy"].shape) == (4, 7)

        saved = await api.run(job_id, "POST", "save", json={"checkpoint_type": "resumable"})
        assert saved["checkpoint_id"] == saved["checkpoint_tag"] == "global_step1" and saved["kind"] == "resumable"
        listed = (await api.call("GET", f"/{job_id}/checkpoints")).json()["checkpoints"]
        assert [(c["checkpoint_id"], c["global_steps"], c["checkpoint_type"]) for c in listed] == [
            ("global_step1", 1, "resumable")
        ]
        assert listed[0]["avg_loss"] == pytest.approx(fwd_bwd["avg_loss"])
        export = (await api.call("POST", f"/{job_id}/checkpoints/global_step1:export")).json()
        names = {f["filename"]: f for f in export["files"]}
        assert {"model.safetensors", "config.json", "optimizer.safetensors"} <= set(names)
        download = await http.get(names["config.json"]["url"])
        assert download.status_code == 200 and len(download.content) == names["config.json"]["size_bytes"]

        loaded = await api.run(job_id, "POST", "load", json={"checkpoint_id": "global_step1"})
        assert loaded["checkpoint_id"] == "global_step1" and loaded["global_step"] == 1
        logs = (
            await api.call(
                "POST",
                f"/{job_id}/operation",
                json={"operation_type": "tail-logs", "sub_job_type": "training", "payload": {"max_lines": 500}},
            )
        ).json()
        assert any("job is running" in e["msg"] for e in logs["entries"]) and logs["eof"] is True
        run = (await api.call("GET", f"/{job_id}/experiment-run")).json()
        assert run == {"experiment_name": "DB.SC.WALK", "experiment_run_name": job_id}

        assert (await api.call("DELETE", f"/{job_id}/checkpoints/global_step1")).status_code == 204
        assert (await http.get(names["config.json"]["url"])).status_code == 404
        assert (await api.call("DELETE", f"/{job_id}/checkpoints/global_step1", check=False)).status_code == 404

        assert (await api.call("POST", f"/{job_id}:cancel")).json()["status"] == "cancelling"
        await api.wait_status(job_id, "terminated")
        assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 0
        again = await api.call("POST", f"/{job_id}:cancel", check=False)
        assert (again.status_code, again.json()["code"]) == (409, "conflict")
        late = await api.post_frame(job_id, "forward-backward", small_batch(), check=False)
        assert late.status_code == 409 and "terminated" in late.json()["message"]
        listed = (await api.call("GET", "/", params={"status": "terminated"})).json()["jobs"]
        assert [j["job_id"] for j in listed] == [job_id]


async def test_grpo_like_loop_trains_and_syncs_the_sampler(data_dir):
    async with client_for(make_app(data_dir), "uvicorn") as http:
        api = Api(http)
        job_id = await api.create(TRAINING, SAMPLING)
        await api.wait_status(job_id, "running")
        prompts_P = [[1, 11, 2, 13], [3, 12, 4, 13]]
        for iteration in range(3):
            accepted = (
                await api.post_frame(
                    job_id,
                    "generate",
                    {
                        "prompts": prompts_P,
                        "sampling_params": {"max_tokens": 4, "n": 4, "temperature": 1.0, "seed": iteration},
                    },
                )
            ).json()
            samples = (await api.result(job_id, accepted["request_id"]))["results"]
            assert len(samples) == 8 and {s["policy_version"] for s in samples} == {iteration}
            rows, advantages = [], []
            for p, prompt in enumerate(prompts_P):
                group_G = samples[4 * p : 4 * p + 4]
                rewards_G = [float(sum(t == 1 for t in s["token_ids"])) for s in group_G]
                mean = sum(rewards_G) / len(rewards_G)
                rows += [(prompt, s["token_ids"]) for s in group_G]
                advantages += [r - mean for r in rewards_G]
            # submitted back to back; the sub-job's FIFO keeps them in order
            fwd_bwd = (await api.post_frame(job_id, "forward-backward", canonical_batch(rows, advantages))).json()
            step = (await api.call("POST", f"/{job_id}/step", json={})).json()
            sync = (await api.call("POST", f"/{job_id}/operation", json={"operation_type": "weight-sync"})).json()
            assert math.isfinite((await api.result(job_id, fwd_bwd["request_id"]))["loss"])
            assert (await api.result(job_id, step["request_id"]))["global_step"] == iteration + 1
            assert (await api.result(job_id, sync["request_id"]))["policy_version"] == iteration + 1
        await api.call("POST", f"/{job_id}:cancel")
        await api.wait_status(job_id, "terminated")


async def test_restart_fails_active_jobs_and_their_checkpoints_resume_training(data_dir):
    async with client_for(make_app(data_dir), "uvicorn") as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        idle_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        await api.result(
            job_id, (await api.post_frame(job_id, "forward-backward", small_batch(0))).json()["request_id"]
        )
        await api.run(job_id, "POST", "step", json={})
        saved = await api.run(job_id, "POST", "save", json={})
        accepted = (await api.post_frame(job_id, "forward-backward", small_batch(1))).json()
        expected_loss = (await api.result(job_id, accepted["request_id"]))["loss"]  # what the original sees next
    async with client_for(make_app(data_dir), "uvicorn") as http:
        api = Api(http)
        job = await api.job(job_id)
        assert job["status"] == "failed"
        assert job["reason"].startswith(f"service restarted; resume from checkpoint {saved['checkpoint_id']}")
        idle = await api.job(idle_id)
        assert (idle["status"], idle["reason"]) == ("failed", "service restarted; no checkpoint was saved")
        polled = await api.poll(job_id, accepted["request_id"])
        assert polled["status"] == "done" and polled["result"]["loss"] == expected_loss
        listed = (await api.call("GET", f"/{job_id}/checkpoints")).json()["checkpoints"]
        assert [c["checkpoint_id"] for c in listed] == ["global_step1"]
        export = (await api.call("POST", f"/{job_id}/checkpoints/global_step1:export")).json()
        assert (await http.get(export["files"][0]["url"])).status_code == 200
        refused = await api.post_frame(job_id, "forward-backward", small_batch(1), check=False)
        assert refused.status_code == 409 and "failed" in refused.json()["message"]

        source = {"checkpoint_id": "global_step1", "source_job_id": job_id}
        resumed = await api.create(
            {**TRAINING, "source_checkpoint_info": source}, {**SAMPLING, "source_checkpoint_info": source}
        )
        await api.wait_status(resumed, "running")
        again = (await api.post_frame(resumed, "forward-backward", small_batch(1))).json()
        assert (await api.result(resumed, again["request_id"]))["loss"] == expected_loss
        greedy = {"prompts": [[1, 11, 2, 13], [3, 12]], "sampling_params": {"max_tokens": 6, "temperature": 0.0}}
        from_checkpoint = (await api.post_frame(resumed, "generate", greedy)).json()
        await api.run(resumed, "POST", "operation", json={"operation_type": "weight-sync"})
        from_trainer = (await api.post_frame(resumed, "generate", greedy)).json()
        tokens = [
            [r["token_ids"] for r in (await api.result(resumed, accepted["request_id"]))["results"]]
            for accepted in (from_checkpoint, from_trainer)
        ]
        assert tokens[0] == tokens[1]  # the sampler started from the checkpoint's weights
        step = await api.run(resumed, "POST", "step", json={})
        assert step["global_step"] == 2  # the optimizer state and step counter came back too


async def test_step_peak_memory_log_adds_peak_memory_to_step_results(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        logged = {**TRAINING, "training_config": {**TRAINING["training_config"], "step_peak_memory_log": True}}
        job_id = await api.create(logged)
        await api.wait_status(job_id, "running")
        accepted = (await api.post_frame(job_id, "forward-backward", small_batch())).json()
        await api.result(job_id, accepted["request_id"])
        step = await api.run(job_id, "POST", "step", json={})
        assert step["peak_memory"]["gpu_peak"] == 0 and step["peak_memory"]["cpu_peak"] > 0
        body = {"operation_type": "tail-logs", "sub_job_type": "training"}
        entries = (await api.call("POST", f"/{job_id}/operation", json=body)).json()["entries"]
        assert not [e for e in entries if "step_peak_memory_log" in e["msg"]]  # used, so not listed as unused


async def test_an_invalid_fwd_bwd_queued_with_valid_ones_of_its_job_fails_alone(data_dir):
    """fwd_bwds of one job queued behind a long one run as one call; the one the engine refuses as
    invalid (before any work) fails its own request only, and the others train."""
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running()
        long = canonical_batch([([1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11] * 6)] * 512, [1.0] * 512)
        bad = small_batch(1)
        bad["processing"]["config"] = {"loss_agg_mode": "x"}
        batches = [long, small_batch(0), bad, small_batch(2)]
        posted = [(await api.post_frame(job_id, "forward-backward", b)).json()["request_id"] for b in batches]
        answers = [await _settled(api, job_id, request_id) for request_id in posted]
        assert [a["status"] for a in answers] == ["done", "done", "failed", "done"]
        assert "loss_agg_mode" in answers[2]["error"]


async def _settled(api: Api, job_id: str, request_id: str) -> dict:
    """The request's answer once it is final: a loaded machine may take longer than one long-poll."""
    for _ in range(10):
        answer = await api.poll(job_id, request_id)
        if answer["status"] not in ("pending", "running"):
            break
    return answer
