"""Engine additions the Tinker API needs, open to every API: explicit targets, sum losses,
per-datum log-probs, forward-only scoring, Adam parameters per step, prompt log-probs, EOS off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from icefloe.engines.losses import get_loss
from icefloe.engines.sampling import SamplingEngine
from icefloe.engines.training import TrainingEngine
from icefloe.protocol import InvalidRequestError, SamplingParams

from .engine_batches import make_config

B, S = 2, 6


def _targets_batch(loss_fn: str, **config) -> dict:
    torch.manual_seed(1)
    input_ids = torch.randint(4, 18, (B, S))
    context = {
        "target_tokens": torch.randint(4, 18, (B, S)),  # scored where they sit, not the next input token
        "loss_mask": torch.ones(B, S),
        "weights": torch.rand(B, S),
        "advantages": torch.randn(B, S),
        "old_logprobs": -torch.rand(B, S) - 1.0,
    }
    processing = {"loss_fn": loss_fn, "config": {"loss_agg_mode": "token-sum", "return_logprobs": True, **config}}
    return {"kwargs": {"input_ids": input_ids, "attention_mask": torch.ones(B, S, dtype=torch.int64)},
            "context": context, "processing": processing}  # fmt: skip


def _target_logprobs(engine: TrainingEngine, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        logits = engine.model(input_ids=batch["kwargs"]["input_ids"]).logits.float()
    return F.log_softmax(logits, -1).gather(-1, batch["context"]["target_tokens"][..., None]).squeeze(-1)


def test_fwd_bwd_scores_explicit_targets_and_returns_per_token_logprobs(model_dir):
    engine = TrainingEngine(make_config(), model_dir=model_dir)
    batch = _targets_batch("cross_entropy")
    expected = _target_logprobs(engine, batch)
    result = engine.fwd_bwd(batch)
    assert_close(result["logprobs"], expected, atol=1e-5, rtol=1e-5)
    weighted_sum = -(expected * batch["context"]["weights"]).sum().item()
    assert result["loss"] == pytest.approx(weighted_sum, rel=1e-5)


def test_forward_only_fwd_bwd_scores_without_touching_gradients(model_dir):
    engine = TrainingEngine(make_config(), model_dir=model_dir)
    result = engine.fwd_bwd(_targets_batch("ppo", forward_only=True))
    assert result["logprobs"].shape == (B, S)
    assert all(p.grad is None for p in engine.model.parameters())


@pytest.mark.parametrize("name", ["ppo", "cispo", "dro"])
def test_tinker_rl_losses_match_their_definitions(name):
    torch.manual_seed(2)
    logp = (-torch.rand(B, S) - 0.5).requires_grad_()
    old, adv, mask = -torch.rand(B, S) - 0.5, torch.randn(B, S), torch.ones(B, S)
    ratio = (logp - old).exp()
    if name == "ppo":
        expected = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum()
    elif name == "cispo":
        expected = -(ratio.clamp(0.8, 1.2).detach() * adv * logp).sum()
    else:
        expected = -(adv * logp - 0.5 * 0.05 * (logp - old).square()).sum()
    context = {"loss_mask": mask, "advantages": adv, "old_logprobs": old}
    loss, _ = get_loss(name)(logp, context=context, config={}, entropy_BS=None)
    assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logp)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    assert_close(grad, expected_grad)


def test_step_takes_adam_parameters_and_a_grad_clip_per_step(model_dir):
    engine = TrainingEngine(make_config(training={"grad_clip": 1.0}), model_dir=model_dir)
    engine.fwd_bwd(_targets_batch("cross_entropy"))
    adam = {"beta1": 0.5, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.1, "grad_clip_norm": 0.0}
    engine.step(1e-3, adam)
    group = engine.optimizer.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"], group["lr"]) == ((0.5, 0.9), 1e-6, 0.1, 1e-3)


def test_generate_prompt_logprobs_and_ignore_eos(model_dir):
    sampler = SamplingEngine(make_config(), model_dir=model_dir)
    prompt = sampler.tokenizer.encode("12+7=")
    eos_only = SamplingParams(max_tokens=6, seed=0, prompt_logprobs=True, ignore_eos=True)
    (result,) = sampler.generate([prompt], eos_only)
    assert len(result["token_ids"]) == 6 and result["finish_reason"] == "length"
    with torch.no_grad():
        logits = sampler.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    expected = F.log_softmax(logits, -1).gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1)
    assert result["prompt_logprobs"][0] is None
    assert result["prompt_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-5)


@pytest.mark.parametrize(
    ("adam", "message"),
    [
        ({"beta2": 1.0, "grad_clip_norm": -3.0}, r"adam\.beta2.*1\.0.*\[0, 1\)"),
        ({"beta2": 1.5}, r"adam\.beta2.*1\.5"),
        ({"beta1": -0.1}, r"adam\.beta1.*-0\.1"),
        ({"eps": 0.0}, r"adam\.eps is 0\.0: .*greater than 0"),
        ({"weight_decay": -1.0}, r"adam\.weight_decay.*greater than or equal to 0"),
        ({"grad_clip_norm": -3.0}, r"adam\.grad_clip_norm.*-3\.0"),
        ({"eps": float("inf")}, r"adam\.eps must be finite; got inf"),
        ({"weight_decay": float("nan")}, r"adam\.weight_decay must be finite; got nan"),
    ],
)
def test_step_refuses_adam_parameters_out_of_range_and_changes_nothing(model_dir, adam, message):
    """Bad values were written into AdamW unchecked: beta2=1 with a negative clip made every weight NaN."""
    engine = TrainingEngine(make_config(), model_dir=model_dir)
    group = engine.optimizer.param_groups[0]
    before = {key: group[key] for key in ("betas", "eps", "weight_decay")}
    batch = _targets_batch("cross_entropy")
    engine.fwd_bwd(batch)
    with pytest.raises(InvalidRequestError, match=message):
        engine.step(1e-3, adam)
    assert {key: group[key] for key in ("betas", "eps", "weight_decay")} == before
    assert engine.step(1e-3)["global_step"] == 1  # the gradients are still there
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())


def test_a_refused_step_leaves_the_adam_parameters_alone(model_dir):
    engine = TrainingEngine(make_config(), model_dir=model_dir)
    group = engine.optimizer.param_groups[0]
    before = {key: group[key] for key in ("betas", "eps", "weight_decay")}
    with pytest.raises(InvalidRequestError, match="needs a fwd_bwd since the last step"):
        engine.step(1e-3, {"beta1": 0.5, "eps": 1e-3, "weight_decay": 0.2})
    assert {key: group[key] for key in ("betas", "eps", "weight_decay")} == before
