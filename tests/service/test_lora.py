"""LoRA through the training API: peft_config on the sub-jobs, weight_format "lora", PEFT checkpoints,
and every passthrough key of create-job honoured, refused or reported."""

from __future__ import annotations

import math

import peft  # noqa: F401 (the dev extra installs it: fail, never skip)
import pytest
import torch

from .service_batches import small_batch
from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio

PEFT = {"peft_type": "Lora", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
APPLIED = {**PEFT, "lora_dropout": 0.0, "bias": "none"}


def _training(**extra):
    return {**TRAINING, "training_config": {**TRAINING["training_config"], **extra}}


def _sampling(**extra):
    return {**SAMPLING, "inference_config": {**SAMPLING["inference_config"], **extra}}


def _sync(job_id: str, **payload) -> dict:
    return {"operation_type": "weight-sync", "sub_job_type": "training", "payload": payload}


async def _fwd_bwd(api: Api, job_id: str, seed: int) -> float:
    accepted = (await api.post_frame(job_id, "forward-backward", small_batch(seed))).json()
    return (await api.result(job_id, accepted["request_id"]))["loss"]


async def test_lora_job_trains_syncs_saves_and_loads_adapters(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        fast = {"name": "AdamW", "lr": 2e-2}
        job_id = await api.create(_training(peft_config=PEFT, optimizer=fast), _sampling(peft_config=PEFT))
        job = await api.wait_status(job_id, "running")
        training, sampling = job["sub_jobs"]
        assert training["training_config"]["peft_config"] == sampling["inference_config"]["peft_config"] == APPLIED

        params = {"max_tokens": 4, "temperature": 0.0, "logprobs": True}
        greedy = {"prompts": [[1, 11, 2, 13], [3, 12]], "sampling_params": params}
        before = (await api.post_frame(job_id, "generate", greedy)).json()
        before = (await api.result(job_id, before["request_id"]))["results"]
        assert {s["policy_version"] for s in before} == {0}
        assert math.isfinite(await _fwd_bwd(api, job_id, 0))
        assert (await api.run(job_id, "POST", "step", json={}))["global_step"] == 1

        full = await api.call("POST", f"/{job_id}/operation", json=_sync(job_id, weight_format="vllm"), check=False)
        assert full.status_code == 400 and "weight_format 'vllm' moves full weights" in full.json()["message"]
        synced = await api.run(job_id, "POST", "operation", json=_sync(job_id, weight_format="lora"))
        assert synced["weight_format"] == "lora" and synced["policy_version"] == 1
        # q_proj and v_proj of 2 layers, rank 4: A (4 x 64) + B (out x 4) each, float32; far below the model
        assert 0 < synced["bytes"] < 100_000
        default = await api.run(job_id, "POST", "operation", json=_sync(job_id))  # LoRA job: lora by default
        assert default["weight_format"] == "lora" and default["bytes"] == synced["bytes"]
        after = (await api.post_frame(job_id, "generate", greedy)).json()
        assert {s["policy_version"] for s in (await api.result(job_id, after["request_id"]))["results"]} == {1}

        resumable = await api.run(job_id, "POST", "save", json={"checkpoint_type": "resumable"})
        loss_at_step_1 = await _fwd_bwd(api, job_id, 1)
        await api.run(job_id, "POST", "step", json={})
        weights_only = await api.run(job_id, "POST", "save", json={"checkpoint_type": "weights-only"})
        assert weights_only["kind"] == "weights-only" and weights_only["checkpoint_id"] == "global_step2"
        export = (await api.call("POST", f"/{job_id}/checkpoints/global_step2:export")).json()
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {f["filename"] for f in export["files"]}
        await api.run(job_id, "POST", "operation", json=_sync(job_id))
        synced = (await api.post_frame(job_id, "generate", greedy)).json()
        synced = (await api.result(job_id, synced["request_id"]))["results"]
        assert abs(synced[0]["logprobs"][0] - before[0]["logprobs"][0]) > 1e-3  # the adapters moved the policy

        loaded = await api.run(job_id, "POST", "load", json={"checkpoint_id": resumable["checkpoint_id"]})
        assert loaded["global_step"] == 1
        assert await _fwd_bwd(api, job_id, 1) == pytest.approx(loss_at_step_1, abs=1e-6)  # step 1's adapters

        # A sampling job started from the PEFT folder samples what the synced sampler did at step 2.
        source = {"checkpoint_id": "global_step2", "source_job_id": job_id}
        served = await api.create({**_sampling(peft_config=PEFT), "source_checkpoint_info": source})
        await api.wait_status(served, "running")
        from_folder = (await api.post_frame(served, "generate", greedy)).json()
        results = (await api.result(served, from_folder["request_id"]))["results"]
        assert [s["token_ids"] for s in results] == [s["token_ids"] for s in synced]
        for served_sample, synced_sample in zip(results, synced, strict=True):
            assert served_sample["logprobs"] == pytest.approx(synced_sample["logprobs"], abs=1e-5)


async def test_lora_reference_is_the_trainer_with_its_adapters_disabled(data_dir):
    """A LoRA job needs no log_probability sub-job: a forward addressed to that type scores the base model."""
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        lora = await api.running(_training(peft_config=PEFT, optimizer={"name": "AdamW", "lr": 2e-2}))
        full = await api.running(TRAINING)  # untrained full weights: the base model

        async def forward(job_id: str, **params) -> torch.Tensor:
            accepted = (await api.post_frame(job_id, "forward", small_batch(), params=params)).json()
            return (await api.result(job_id, accepted["request_id"]))["logprobs"]

        await api.fwd_bwd(lora)
        await api.run(lora, "POST", "step", json={})
        reference = await forward(lora, sub_job_type="log_probability")
        torch.testing.assert_close(reference, await forward(full), rtol=0, atol=1e-5)
        assert not torch.allclose(await forward(lora), reference, atol=1e-3)  # the policy has moved
        assert [s["job_type"] for s in (await api.job(lora))["sub_jobs"]] == ["training"]

        refused = await api.post_frame(full, "forward", small_batch(), params={"sub_job_type": "log_prob"}, check=False)
        assert refused.status_code == 400 and "has no log_probability sub-job" in refused.json()["message"]


async def test_peft_configs_that_differ_between_sub_jobs_are_a_400_naming_both(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        body = {"sub_job_configs": [_training(peft_config=PEFT), _sampling(peft_config={**PEFT, "r": 8})]}
        refused = await api.call("POST", "/", json=body, check=False)
        assert refused.status_code == 400
        message = refused.json()["message"]
        assert "r: 4 vs 8" in message and ":training:0" in message and ":sampling:0" in message

        body = {"sub_job_configs": [_training(peft_config=PEFT), SAMPLING]}
        refused = await api.call("POST", "/", json=body, check=False)
        assert refused.status_code == 400 and "LoRA vs none" in refused.json()["message"]

        body = {"sub_job_configs": [_training(peft_config={**PEFT, "peft_type": "IA3"})]}
        refused = await api.call("POST", "/", json=body, check=False)
        assert refused.status_code == 400 and "peft_type must be 'Lora'" in refused.json()["message"]

        full = await api.running(TRAINING, SAMPLING)
        lora = await api.call("POST", f"/{full}/operation", json=_sync(full, weight_format="lora"), check=False)
        assert lora.status_code == 400 and "needs LoRA adapters on the trainer" in lora.json()["message"]


@pytest.mark.parametrize(
    ("sub_job", "named"),
    [
        (_training(router_replay=True), "router_replay"),
        (_training(ds_config={"gradient_accumulation_steps": 4}), "gradient_accumulation_steps"),
        (_training(ds_config={"bf16": {"enabled": True}}), "ds_config.bf16.enabled"),
        (_training(prime_rl={"optimization_dtype": "bfloat16"}), "prime_rl.optimization_dtype"),
        (_training(optimizer={"name": "AdamW", "lr": 1e-3, "amsgrad": True}), "amsgrad"),
        (_training(peft_config={**PEFT, "use_dora": True}), "use_dora"),
        ({**TRAINING, "model_post_init": ["freeze_embeddings"]}, "model_post_init"),
    ],
)
async def test_a_key_that_would_change_training_and_is_not_supported_is_a_400(data_dir, sub_job, named):
    async with asgi_client(make_app(data_dir)) as http:
        refused = await Api(http).call("POST", "/", json={"sub_job_configs": [sub_job]}, check=False)
        assert refused.status_code == 400 and named in refused.json()["message"]


async def test_keys_without_a_counterpart_are_reported_and_honoured_keys_are_not(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        tuned = _training(
            cuda_allocator_conf="expandable_segments:True",
            ds_config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": False}},
            activation_checkpointing=True,
            mb_spec={"max_tokens_per_mb": 8},
        )
        created = (await api.call("POST", "/", json={"sub_job_configs": [tuned, SAMPLING]})).json()
        warnings = created["warnings"]
        assert [w.split(" ")[0] for w in warnings] == [
            "sub_job_configs.0.training_config.cuda_allocator_conf",
            "sub_job_configs.0.training_config.ds_config",
        ]
        job_id = created["job_id"]
        job = await api.wait_status(job_id, "running")
        assert job["warnings"] == warnings
        entries = (
            await api.call("POST", f"/{job_id}/operation", json={"operation_type": "tail-logs", "payload": {}})
        ).json()["entries"]
        assert [e["msg"] for e in entries if e["level"] == "WARNING"] == warnings
        # micro-batches of 8 tokens and activation checkpointing train exactly like one pass
        plain = await api.running(TRAINING)
        assert await _fwd_bwd(api, job_id, 0) == pytest.approx(await _fwd_bwd(api, plain, 0), abs=1e-6)
        assert "warnings" not in (await api.call("POST", "/", json={"sub_job_configs": [TRAINING]})).json()
