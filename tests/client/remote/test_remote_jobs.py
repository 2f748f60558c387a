"""ClientConfig → create-job body, job-state waiting and sub-job discovery."""

from __future__ import annotations

import pytest

from icefloe.client.remote.jobs import MANAGED_OPS, job_create_body, probe_service, sub_jobs_of, wait_running
from icefloe.client.remote.polling import Backoff
from icefloe.config import ClientConfig
from icefloe.protocol import IcefloeTimeoutError, JobFailedError

from .canned import canned


def test_job_create_body_orders_sub_jobs_and_maps_fields():
    config = ClientConfig.build(
        model="Qwen/Qwen3-0.6B",
        seed=7,
        dtype="bfloat16",
        max_seq_len=1024,
        num_training_workers=4,
        num_sampling_workers=2,
        num_log_prob_workers=1,
        training={"optimizer": {"lr": 2e-6, "betas": [0.9, 0.95], "weight_decay": 0.1}, "grad_clip": 0.5},
        sampling={"engine_kwargs": {"gpu_memory_utilization": 0.8, "max_model_len": 99, "enforce_eager": True}},
        backend={"type": "remote", "base_url": "http://x"},
    )
    body = job_create_body(config, "exp1")
    assert [s["job_type"] for s in body["sub_job_configs"]] == ["sampling", "log_probability", "training"]
    sampling, reference, training = body["sub_job_configs"]
    assert sampling["inference_config"] == {
        "max_seq_len": 1024,
        "n_gpus": 2,
        "vllm_config": {"gpu_memory_utilization": 0.8, "enforce_eager": True},
    }
    assert reference["inference_config"] == {"max_seq_len": 1024, "n_gpus": 1}
    assert training["training_config"]["optimizer"] == {
        "name": "AdamW",
        "lr": 2e-6,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert training["training_config"]["n_gpus"] == 4 and training["training_config"]["gradient_clipping"] == 0.5
    assert {s["model_name"] for s in body["sub_job_configs"]} == {"Qwen/Qwen3-0.6B"}
    assert {(s["seed"], s["dtype"]) for s in body["sub_job_configs"]} == {(7, "bfloat16")}
    assert body["experiment_name"] == "exp1"


def test_job_create_body_without_sampling_has_only_training():
    config = ClientConfig.build(num_sampling_workers=0, backend={"type": "remote", "base_url": "http://x"})
    assert [s["job_type"] for s in job_create_body(config)["sub_job_configs"]] == ["training"]


def test_job_create_body_warns_about_knobs_the_api_lacks(caplog):
    config = ClientConfig.build(
        training={"checkpoint_dir": "/tmp/x"}, backend={"type": "remote", "base_url": "http://x"}
    )
    job_create_body(config)
    assert "training.checkpoint_dir" in caplog.text


def test_job_create_body_sends_lora_and_memory_knobs_as_the_api_spells_them(caplog):
    config = ClientConfig.build(
        num_log_prob_workers=1,
        lora={"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        training={"micro_batch_tokens": 64, "gradient_checkpointing": True},
        backend={"type": "remote", "base_url": "http://x"},
    )
    # With LoRA the trainer scores the reference (adapters disabled): no log_probability sub-job.
    sampling, training = job_create_body(config)["sub_job_configs"]
    peft = {
        "peft_type": "Lora",
        "r": 4,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
    }
    assert training["training_config"]["peft_config"] == peft and sampling["inference_config"]["peft_config"] == peft
    assert training["training_config"]["mb_spec"] == {"max_tokens_per_mb": 64}
    assert training["training_config"]["activation_checkpointing"] is True
    assert "ignores" not in caplog.text


def test_job_create_body_sends_a_zero_budget_and_leaves_an_unset_one_to_the_service():
    def training_config(**training):
        config = ClientConfig.build(training=training, backend={"type": "remote", "base_url": "http://x"})
        return job_create_body(config)["sub_job_configs"][-1]["training_config"]

    assert training_config(micro_batch_tokens=0)["mb_spec"] == {"max_tokens_per_mb": 0}  # one padded pass
    assert "mb_spec" not in training_config()  # the engine picks a budget from the model and device


def test_sub_jobs_of_reads_enum_names_and_fills_missing_ids():
    job = {
        "sub_jobs": [
            {"sub_job_id": "j:training:0", "job_type": "JOB_TYPE_TRAINING"},
            {"sub_job_id": "j:log_prob:0", "job_type": "log_prob"},
        ]
    }
    found = sub_jobs_of("j", job, ClientConfig.build(num_log_prob_workers=1))
    assert found == {
        "training": ["j:training:0"],
        "log_probability": ["j:log_prob:0"],
        "sampling": ["j:sampling:0"],
    }


def _wait(bodies, timeout_s=10.0):
    with canned(*bodies) as (http, _):
        return http.run(wait_running(http, "j", backoff=Backoff(0.001, 1.0, 0.001), timeout_s=timeout_s))


@pytest.mark.parametrize("terminal", ["failed", "terminated", "cancelled", "JOB_STATE_DONE"])
def test_wait_running_raises_on_every_terminal_state_with_reason_and_sub_jobs(terminal):
    bodies = [
        {"status": "placing"},
        {
            "status": terminal,
            "reason": "capacity exhausted",
            "sub_jobs": [{"sub_job_id": "j:training:0", "status": "failed"}],
        },
    ]
    with pytest.raises(JobFailedError) as info:
        _wait(bodies)
    assert "capacity exhausted" in str(info.value) and "j:training:0=failed" in str(info.value)


def test_wait_running_treats_unknown_states_as_progress_and_tolerates_a_wrapper():
    bodies = [
        {"status": 7},
        {"job": {"status": "JOB_STATE_INITIALIZING"}},
        {"job": {"status": "running", "x": 1}},
    ]
    assert _wait(bodies)["x"] == 1


def test_wait_running_times_out():
    with pytest.raises(IcefloeTimeoutError, match="job_ready_timeout_s"):
        _wait([{"status": "pending"}] * 10_000, timeout_s=0.01)


def test_probe_service_reads_capabilities_or_assumes_the_managed_endpoint():
    def probe(status: int, body: dict):
        with canned(body, status=status) as (http, seen):
            info = http.run(probe_service(http))
        assert [request.url.path.rsplit("/", 1)[-1] for request in seen] == ["capabilities"]
        return info

    managed = probe(404, {"code": "not_found", "message": "job capabilities not found"})
    assert managed.managed and managed.ops == MANAGED_OPS and "long_poll" not in managed.extensions
    assert "forward" not in managed.ops and "sleep-training" not in managed.ops
    served = probe(
        200,
        {
            "ops": ["forward-backward", "forward", "export-checkpoint"],
            "extensions": {"long_poll": True, "idempotency_keys": True, "sequenced_submit": True},
            "limits": {"max_post_bytes": 1000000, "max_long_poll_s": 60},
        },
    )
    assert not served.managed and {"long_poll", "idempotency_keys", "sequenced_submit"} <= served.extensions
    assert served.ops == {"forward-backward", "forward", "get-checkpoint"} and served.max_post_bytes == 1000000
