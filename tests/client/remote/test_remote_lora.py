"""LoRA over the remote backend: the client asks for adapters, syncs only them, and samples with them."""

from __future__ import annotations

import httpx
import peft  # noqa: F401 (the dev extra installs it: fail, never skip)
import pytest
import torch
from torch.testing import assert_close

from icefloe.client import Client, build_batch
from icefloe.config import ClientConfig
from icefloe.engines.training import TrainingEngine
from icefloe.protocol import InvalidRequestError

LORA = {"rank": 4, "alpha": 8}


def test_sampler_logprobs_equal_trainer_logprobs_after_a_lora_sync(service):
    config = ClientConfig.build(
        lora=LORA,
        num_log_prob_workers=1,  # with LoRA the trainer scores the reference: no log_probability sub-job
        training={"optimizer": {"lr": 2e-2}},
        backend=service.config().backend,
    )
    with Client(config) as client:
        tok = client.tokenizer
        prompts = [tok.encode(p) for p in ["12+7=", "3*4=", "100-58="]]
        params = {"n": 2, "max_tokens": 6, "seed": 3, "logprobs": True}
        samples = client.generate(prompts, params)
        rows = [prompts[i // 2] for i in range(len(samples))]
        batch = build_batch(
            rows, [s["token_ids"] for s in samples], [1.0, -1.0] * 3, pad_id=tok.pad_token_id, loss_fn="grpo"
        )
        for _ in range(3):
            client.fwd_bwd(batch)
            client.step()
        with pytest.raises(InvalidRequestError, match="moves full weights"):
            client.sync_weights(weight_format="vllm")
        synced = client.sync_weights()  # LoRA on: weight_format "lora"
        after = client.generate(prompts, params)
        scored = build_batch(rows, [s["token_ids"] for s in after], [0.0] * len(after), pad_id=tok.pad_token_id)
        policy = client.forward(scored)["logprobs"]
        reference = client.forward(scored, reference=True)["logprobs"]
        job = client.handle()["transport"]["job_id"]
        record = httpx.get(f"{service.base_url}/api/v2/databases/icefloe/schemas/public/cortex-training/{job}").json()

    assert synced["policy_version"] == 3 and {s["policy_version"] for s in after} == {3}
    for b, (prompt, sample) in enumerate(zip(rows, after, strict=True)):
        span = slice(len(prompt) - 1, len(prompt) + len(sample["token_ids"]) - 1)
        assert_close(torch.tensor(sample["logprobs"]), policy[b, span], rtol=1e-5, atol=1e-5)
    # The reference is the base model, scored by the trainer with its adapters disabled: no second copy.
    base = TrainingEngine(config.model_copy(update={"lora": None})).forward(scored)["logprobs"]
    assert_close(reference, base, rtol=0, atol=1e-5)
    assert not torch.allclose(policy, reference, atol=1e-3)
    assert sorted(sub["job_type"] for sub in record["sub_jobs"]) == ["sampling", "training"]
    counts = service.request_counts(job)
    assert counts["weight-sync"] == 1  # the refused format never became a request
    assert counts["forward"] == 2  # policy and reference (the job has no other sub-job to run it)
