"""LoRA on the Ray engines: two data-parallel trainer ranks and a sampler; only adapters move."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from icefloe.engines.training import TrainingEngine
from tests.engines.engine_batches import make_config

ray = pytest.importorskip("ray")
pytest.importorskip("peft")

pytestmark = pytest.mark.integration


def test_lora_on_ray_syncs_adapters_and_sampler_matches_trainer(ray_session, model_dir, tmp_path):
    from icefloe.client import Client, build_batch

    config = make_config(
        model=str(model_dir),
        lora={"rank": 4, "alpha": 8},
        num_training_workers=2,
        training={"optimizer": {"lr": 2e-2}, "checkpoint_dir": str(tmp_path)},
        backend={"type": "ray", "namespace": "icefloe-tests", "num_cpus_per_worker": 0.25},
    )
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    with Client(config) as client:
        samples = client.generate(prompts, {"max_tokens": 5, "seed": 2})
        batch = build_batch(prompts, [s["token_ids"] for s in samples], [1.0, -0.5, 0.5], pad_id=0)
        for _ in range(2):
            client.fwd_bwd(batch)
            client.step()
        synced = client.sync_weights()
        after = client.generate(prompts, {"max_tokens": 5, "seed": 3, "logprobs": True})
        scored = build_batch(prompts, [s["token_ids"] for s in after], [0.0] * 3, pad_id=0)
        policy = client.forward(scored)["logprobs"]
        saved = client.save_checkpoint("weights-only")

    local = TrainingEngine(make_config(lora={"rank": 4, "alpha": 8}), model_dir=model_dir)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in local.named_weights())
    assert synced["bytes"] == adapter_bytes and synced["policy_version"] == 2
    for b, (prompt, sample) in enumerate(zip(prompts, after, strict=True)):
        span = slice(len(prompt) - 1, len(prompt) + len(sample["token_ids"]) - 1)
        assert_close(torch.tensor(sample["logprobs"]), policy[b, span], rtol=1e-5, atol=1e-5)
    local.load_checkpoint(saved["path"])  # the ranks' adapters, as one PEFT folder
    assert_close(local.forward(scored)["logprobs"], policy, rtol=1e-5, atol=1e-5)
