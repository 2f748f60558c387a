"""Weight sync: after a sync the sampler scores tokens exactly as the trainer does."""

from __future__ import annotations

import torch
from torch.testing import assert_close

from icefloe.engines.sampling import SamplingEngine
from icefloe.engines.training import TrainingEngine
from icefloe.engines.weight_sync import sync_weights_local
from icefloe.protocol import SamplingParams

from .engine_batches import make_batch, make_config, random_rows


def test_sync_weights_local_makes_sampler_logprobs_equal_trainer_forward(model_dir):
    config = make_config(training={"optimizer": {"lr": 5e-2}})
    trainer = TrainingEngine(config, model_dir=model_dir)
    sampler = SamplingEngine(config, model_dir=model_dir)
    trainer.fwd_bwd(make_batch(*random_rows(4, seed=0)))
    trainer.step()
    pointers = {name: p.data_ptr() for name, p in sampler.model.named_parameters()}

    synced = sync_weights_local(trainer, sampler)

    param_bytes = sum(p.numel() * p.element_size() for _, p in trainer.named_weights())
    assert synced["policy_version"] == trainer.global_step == sampler.policy_version == 1
    assert synced["bytes"] == param_bytes and synced["seconds"] >= 0
    assert pointers == {name: p.data_ptr() for name, p in sampler.model.named_parameters()}  # copied in place
    prompts = [sampler.tokenizer.encode(p) for p in ["12+7=", "3*4=", "100-58="]]
    results = sampler.generate(prompts, SamplingParams(max_tokens=8, seed=1, logprobs=True))
    assert {r["policy_version"] for r in results} == {1}
    responses = [r["token_ids"] for r in results]
    forward = trainer.forward(make_batch(prompts, responses, [0.0] * 3))["logprobs"]
    for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        expected = forward[b, len(prompt) - 1 : len(prompt) + len(response) - 1]
        assert_close(torch.tensor(results[b]["logprobs"]), expected, rtol=1e-5, atol=1e-5)


def test_sync_without_a_step_keeps_the_version(model_dir):
    config = make_config()
    trainer = TrainingEngine(config, model_dir=model_dir)
    sampler = SamplingEngine(config, model_dir=model_dir)
    assert sync_weights_local(trainer, sampler)["policy_version"] == 0
    assert sync_weights_local(trainer, sampler)["policy_version"] == 0
