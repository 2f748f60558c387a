"""One full SkyRL step on the real ``local`` backend (tiny model), rewards from a real skyrl_gym env.

generate (chat template → token ids) → score in worker processes → SkyRL's batch layout → old
log-probs from a real ``forward`` → GRPO advantages → forward_backward → optim_step →
save_weights_for_sampler.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from icefloe.client import Client
from icefloe.integrations.skyrl.config import client_config_from_skyrl
from icefloe.integrations.skyrl.scoring import Sample, ScoringPool, score_one

from . import skyrl_arith_env  # noqa: F401  (registers the env in this process too, for re-scoring)

# Arithmetic prompts the tiny model's vocabulary can answer; the env gives partial credit per answer digit.
PROBLEMS = [("12+7=", "19"), ("25+17=", "42")]
NUM_SAMPLES = 4
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture
def cfg(make_cfg, tmp_path):
    return make_cfg(
        "trainer.policy.model.path=tiny:arith",
        "trainer.seed=0",
        f"trainer.ckpt_path={tmp_path / 'ckpt'}",
        f"trainer.export_path={tmp_path / 'export'}",
        "trainer.policy.optimizer_config.lr=1e-2",
        "trainer.policy.optimizer_config.weight_decay=0.0",
        "trainer.train_batch_size=2",
        "trainer.policy_mini_batch_size=2",
        "trainer.max_prompt_length=16",
        "trainer.algorithm.use_kl_loss=false",
        f"generator.n_samples_per_prompt={NUM_SAMPLES}",
        "generator.sampling_params.max_generate_length=6",
        "trainer.icefloe.device=cpu",
        "trainer.icefloe.dtype=float32",
        "trainer.icefloe.scoring_workers=1",
        "trainer.icefloe.env_modules=[tests.integrations.skyrl.skyrl_arith_env]",
    )


def _generator_input():
    prompts, env_classes, extras, uids = [], [], [], []
    for index, (question, answer) in enumerate(PROBLEMS):
        for _ in range(NUM_SAMPLES):  # SkyRL repeats each prompt n_samples_per_prompt times
            prompts.append([{"role": "user", "content": question}])
            env_classes.append("icefloe_answer_digits")
            extras.append({"reward_spec": {"method": "rule", "ground_truth": answer}})
            uids.append(str(index))
    batch = {"prompts": prompts, "env_classes": env_classes, "env_extras": extras, "sampling_params": None,
             "trajectory_ids": None}  # fmt: skip
    return batch, uids


def _grpo_advantages(rewards_B, uids):
    advantages = torch.zeros_like(rewards_B)
    for uid in set(uids):
        rows = [i for i, u in enumerate(uids) if u == uid]
        group = rewards_B[rows]
        advantages[rows] = (group - group.mean()) / (group.std() + 1e-6)
    return advantages


def test_one_step_trains_on_rewards_from_a_skyrl_gym_env(cfg):
    from icefloe.integrations.skyrl.generator import IcefloeGenerator
    from icefloe.integrations.skyrl.trainer import IcefloeInferenceEngineStub, IcefloePPOTrainer

    torch.set_num_threads(1)
    section = cfg.trainer.icefloe
    with Client(client_config_from_skyrl(cfg)) as client:
        tokenizer = client.tokenizer
        tokenizer.chat_template = CHAT_TEMPLATE
        generator = IcefloeGenerator(
            client, tokenizer, ScoringPool(section.scoring_workers, section.env_modules),
            default_sampling_params={"temperature": 1.0, "max_tokens": 6},
        )  # fmt: skip
        trainer = IcefloePPOTrainer(
            cfg=cfg, tracker=None, tokenizer=tokenizer, train_dataset=None,
            inference_engine_client=IcefloeInferenceEngineStub(client, colocate=False), generator=generator,
            icefloe_client=client,
        )  # fmt: skip
        trainer.build_models()
        assert trainer.dispatch.has_forward
        try:
            generator_input, uids = _generator_input()
            record = asyncio.run(trainer.train_one_step(generator_input, uids))
        finally:
            generator.close()
        after = client.generate([tokenizer("12+7=")["input_ids"]], {"max_tokens": 2})

    out, batch, status = record["generator_output"], record["training_input"], record["status"]
    # The rewards are the environment's: re-scoring each response text in this process gives the same values.
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in out["response_ids"]]
    rescored = [
        score_one(Sample("icefloe_answer_digits", extras, prompt, text))
        for extras, prompt, text in zip(generator_input["env_extras"], generator_input["prompts"], texts, strict=True)
    ]
    assert out["rewards"] == pytest.approx(rescored)
    assert out["prompt_token_ids"][0] == tokenizer("12+7=", add_special_tokens=False)["input_ids"]
    rewards_B = torch.tensor(out["rewards"])
    assert len(set(out["rewards"])) > 1, "the tiny model's samples should earn different partial credit"

    # Old log-probs came from a real forward: the first update is on-policy, so the ratio is 1.
    assert batch["action_log_probs"] is not None
    assert batch["action_log_probs"].shape == batch["response_mask"].shape
    assert status["importance_weight"] == pytest.approx(1.0, abs=1e-5)

    # The policy loss is the on-policy GRPO surrogate of those rewards: -Σ_i A_i·len_i / Σ_i len_i.
    lengths_B = batch["response_mask"].sum(dim=1).to(torch.float32)
    advantages_B = _grpo_advantages(rewards_B, uids)
    expected = -float((advantages_B * lengths_B).sum() / lengths_B.sum())
    assert math.isfinite(status["policy_loss"])
    assert status["policy_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert expected != 0.0
    assert status["grad_norm"] > 0.0
    assert trainer.all_metrics["policy/policy_loss"] == status["policy_loss"]

    # Weights reached the sampler after the step.
    assert trainer.dispatch.last_sync["policy_version"] >= 1
    assert after[0]["policy_version"] == trainer.dispatch.last_sync["policy_version"]


@pytest.fixture(scope="module")
def tiny_client(tmp_path_factory):
    from icefloe.config import ClientConfig

    config = ClientConfig.build(
        {"model": "tiny:arith", "training": {"checkpoint_dir": str(tmp_path_factory.mktemp("ckpt"))}},
        backend={"type": "local", "device": "cpu"},
    )
    with Client(config) as client:
        yield client


def _skyrl_batch(tokenizer, prompts_text, responses_text):
    from .skyrl_standins import TrainingInputBatch, convert_prompts_responses_to_batch_tensors

    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts_text]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in responses_text]
    sequences, attention_mask, response_mask, rewards, loss_mask = convert_prompts_responses_to_batch_tensors(
        tokenizer.pad_token_id, prompts, responses, [1.0] * len(prompts)
    )
    batch = TrainingInputBatch(sequences=sequences, attention_mask=attention_mask, response_mask=response_mask,
                               rewards=rewards, loss_mask=loss_mask)  # fmt: skip
    batch.metadata = {
        "uids": [str(i) for i in range(len(prompts))],
        "response_length": response_mask.shape[1],
    }
    return batch, prompts, responses


def test_dispatch_forward_of_skyrl_layout_matches_canonical_rows(cfg, tiny_client):
    """SkyRL's left-padded rows go through unchanged and come back right-aligned in [B, A]."""
    from icefloe.client import build_batch
    from icefloe.integrations.skyrl.dispatch import IcefloeDispatch

    tokenizer = tiny_client.tokenizer
    batch, prompts, responses = _skyrl_batch(tokenizer, ["12+7=", "3+4=", "125+17="], ["19", "7 ", "1"])
    dispatch = IcefloeDispatch(cfg, tiny_client, pad_token_id=tokenizer.pad_token_id)
    logprobs_BA = dispatch.forward("policy", batch)["output"]

    reference = tiny_client.forward(build_batch(prompts, responses, pad_id=tokenizer.pad_token_id))["logprobs"]
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        expected = reference[row, len(prompt) - 1 : len(prompt) - 1 + len(response)]
        torch.testing.assert_close(logprobs_BA[row, -len(response) :], expected)


def test_dispatch_without_forward_trains_on_policy_without_old_logprobs(cfg, tiny_client):
    """A backend without forward: no old log-probs are sent, so the ratio is exactly 1 (π_old = π)."""
    from icefloe.integrations.skyrl.dispatch import IcefloeDispatch

    tokenizer = tiny_client.tokenizer
    batch, _, _ = _skyrl_batch(tokenizer, ["12+7=", "12+7="], ["19", "5*"])
    dispatch = IcefloeDispatch(cfg, tiny_client, pad_token_id=tokenizer.pad_token_id)
    dispatch.has_forward = False
    batch["action_log_probs"] = None
    batch["advantages"] = torch.tensor([[0.0, 1.0], [0.0, -1.0]]) * batch["response_mask"]
    assert "old_log_probs" not in dispatch._payload(batch, slice(0, 2), training=True)["batch"]
    metrics = dispatch.forward_backward("policy", batch)
    assert metrics["importance_weight"] == 1.0
    assert math.isfinite(metrics["policy_loss"])
    assert dispatch.optim_step("policy") > 0.0


def test_dispatch_sequence_mean_divides_by_every_row_sent(make_cfg, tmp_path, tiny_client):
    """SkyRL's sequence_mean averages over all rows: a masked-out row halves a one-row loss."""
    from icefloe.integrations.skyrl.dispatch import IcefloeDispatch

    cfg = make_cfg(
        "trainer.policy.model.path=tiny:arith",
        f"trainer.ckpt_path={tmp_path / 'ckpt'}",
        "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.loss_reduction=sequence_mean",
    )
    tokenizer = tiny_client.tokenizer
    batch, _, _ = _skyrl_batch(tokenizer, ["12+7=", "3+4="], ["19", "7"])
    batch["advantages"] = torch.ones_like(batch["response_mask"], dtype=torch.float32) * batch["response_mask"]
    batch["action_log_probs"] = None
    dispatch = IcefloeDispatch(cfg, tiny_client, pad_token_id=tokenizer.pad_token_id)
    dispatch.has_forward = False
    one_row = dispatch.forward_backward("policy", batch, rows=(0, 1))["policy_loss"]
    batch["loss_mask"] = batch["loss_mask"].clone()
    batch["loss_mask"][1] = 0
    with_masked_row = dispatch.forward_backward("policy", batch)["policy_loss"]
    assert one_row != 0.0
    assert with_masked_row == pytest.approx(one_row / 2, rel=1e-5)
