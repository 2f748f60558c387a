"""Losses against per-token reference implementations written out plainly here."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from icefloe.engines.losses import AGG_MODES, KL_TYPES, get_loss, kl_penalty, register_loss, registered_losses
from icefloe.protocol import InvalidRequestError

B, S = 3, 7


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(B, S)
    loss_mask[0, 2:6] = 1
    loss_mask[1, 1:3] = 1
    loss_mask[2, 3:6] = 1
    advantages = torch.tensor([1.5, -0.7, -2.0])[:, None] * loss_mask
    logprobs = -torch.rand(B, S, generator=gen) * 3
    return {
        "logprobs": logprobs,
        "old": logprobs + 0.4 * torch.randn(B, S, generator=gen),
        "ref": logprobs + 0.6 * torch.randn(B, S, generator=gen),
        "entropy": torch.rand(B, S, generator=gen) * 2,
        "advantages": advantages,
        "loss_mask": loss_mask,
    }


# --- plain references ------------------------------------------------------------------------------
def _ref_aggregate(values, mask, mode, num_tokens=None, batch_size=None, scale=S):
    num_tokens = sum(mask[b][s] for b in range(B) for s in range(S)) if num_tokens is None else num_tokens
    batch_size = B if batch_size is None else batch_size
    masked_sum = sum(values[b][s] * mask[b][s] for b in range(B) for s in range(S))
    if mode == "token-mean":
        return masked_sum / num_tokens
    if mode == "token-sum":
        return masked_sum
    total = 0.0
    for b in range(B):
        row = sum(values[b][s] * mask[b][s] for s in range(S))
        if mode == "seq-mean-token-mean":
            row /= max(sum(mask[b]), 1.0)
        elif mode == "seq-mean-token-sum-norm":
            row /= scale
        total += row
    return total / batch_size


def _ref_kl(logp, ref, kind):
    kind = kind.rstrip("+")
    if kind in ("k1", "kl"):
        return logp - ref
    if kind == "abs":
        return abs(logp - ref)
    if kind in ("k2", "mse"):
        return 0.5 * (logp - ref) ** 2
    log_ratio = min(max(ref - logp, -20.0), 20.0)
    return min(max(math.exp(log_ratio) - log_ratio - 1.0, -10.0), 10.0)


def _ref_grpo(x, *, mode="token-mean", eps=0.2, eps_high=None, c_clip=None, entropy_coeff=0.0, kl=None, kl_coef=0.0):
    eps_high = eps if eps_high is None else eps_high
    logp, old, adv, mask = (x[k].tolist() for k in ("logprobs", "old", "advantages", "loss_mask"))
    per_token = [[0.0] * S for _ in range(B)]
    for b in range(B):
        for s in range(S):
            ratio = math.exp(logp[b][s] - old[b][s])
            a = adv[b][s]
            value = max(-a * ratio, -a * min(max(ratio, 1 - eps), 1 + eps_high))
            if c_clip is not None and a < 0:
                value = min(value, -a * c_clip)
            per_token[b][s] = value
    loss = _ref_aggregate(per_token, mask, mode)
    loss -= entropy_coeff * _ref_aggregate(x["entropy"].tolist(), mask, mode)
    if kl is not None:
        ref = x["ref"].tolist()
        kl_tokens = [[_ref_kl(logp[b][s], ref[b][s], kl) for s in range(S)] for b in range(B)]
        loss += kl_coef * _ref_aggregate(kl_tokens, mask, mode)
    return torch.tensor(loss)


def _call(name, x, config, *, with_old=True, with_ref=False, entropy=True):
    context = {"advantages": x["advantages"], "loss_mask": x["loss_mask"]}
    if with_old:
        context["old_logprobs"] = x["old"]
    if with_ref:
        context["ref_logprobs"] = x["ref"]
    return get_loss(name)(x["logprobs"], context=context, config=config, entropy_BS=x["entropy"] if entropy else None)


# --- grpo --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_matches_reference_for_every_aggregation_mode(mode):
    x = _inputs()
    loss, _ = _call("grpo", x, {"loss_agg_mode": mode, "eps_clip": 0.1, "eps_clip_higher": 0.3})
    assert_close(loss, _ref_grpo(x, mode=mode, eps=0.1, eps_high=0.3))


def test_grpo_dual_clip_caps_negative_advantage_tokens():
    x = _inputs(1)
    x["old"] = x["logprobs"] - 2.0  # ratio e² ≈ 7.4: beyond c_clip=3 for the negative-advantage rows
    loss, metrics = _call("grpo", x, {"c_clip": 3.0})
    assert_close(loss, _ref_grpo(x, c_clip=3.0))
    unclipped, _ = _call("grpo", x, {})
    assert loss.item() < unclipped.item()
    # As verl's pg_clipfrac / pg_clipfrac_lower: row 0 (A > 0) is clipped at 1 + eps, rows 1-2 (A < 0) at c.
    mask = x["loss_mask"]
    assert metrics["clip_ratio"].item() == pytest.approx(mask[0].sum().item() / mask.sum().item())
    assert metrics["clip_ratio_lower"].item() == pytest.approx(mask[1:].sum().item() / mask.sum().item())


def test_grpo_clip_ratio_counts_ordinary_clipping_only():
    x = _inputs(1)
    ratio_BS = torch.full((B, S), 1.5)
    ratio_BS[2] = 5.0  # row 2 (A < 0) beyond c_clip: dual clipped, not clipped at 1 + eps (max(-A·r, ...) = -A·r)
    x["old"] = x["logprobs"] - ratio_BS.log()
    _, metrics = _call("grpo", x, {"c_clip": 3.0})
    mask = x["loss_mask"]
    assert metrics["clip_ratio"].item() == pytest.approx(mask[0].sum().item() / mask.sum().item())
    assert metrics["clip_ratio_lower"].item() == pytest.approx(mask[2].sum().item() / mask.sum().item())
    _, without_dual = _call("grpo", x, {})
    assert "clip_ratio_lower" not in without_dual


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_grpo_kl_term_matches_reference(kl_type):
    x = _inputs(2)
    config = {"use_kl_loss": True, "kl_coef": 0.3, "kl_type": kl_type, "loss_agg_mode": "seq-mean-token-mean"}
    loss, metrics = _call("grpo", x, config, with_ref=True)
    assert_close(loss, _ref_grpo(x, mode="seq-mean-token-mean", kl=kl_type, kl_coef=0.3))
    assert "kl" in metrics


@pytest.mark.parametrize("kl_type", ["kl+", "abs+", "k3+", "low_var_kl+"])
def test_straight_through_kl_keeps_the_value_and_takes_the_gradient_of_k2(kl_type):
    x = _inputs(11)
    logprobs = x["logprobs"].clone().requires_grad_(True)
    plain = kl_penalty(logprobs, x["ref"], kl_type.rstrip("+"))
    through = kl_penalty(logprobs, x["ref"], kl_type)
    assert_close(through, plain)
    (grad,) = torch.autograd.grad(through.sum(), logprobs)
    assert_close(grad, logprobs.detach() - x["ref"])  # d/dx ½(x - ref)²
    (plain_grad,) = torch.autograd.grad(plain.sum(), logprobs)
    assert not torch.allclose(plain_grad, grad)


@pytest.mark.parametrize(("alias", "name"), [("kl", "k1"), ("mse", "k2"), ("k3", "low_var_kl"), ("mse+", "k2")])
def test_kl_aliases_are_one_estimator(alias, name):
    x = _inputs(12)
    logprobs = x["logprobs"].clone().requires_grad_(True)
    (alias_grad,) = torch.autograd.grad(kl_penalty(logprobs, x["ref"], alias).sum(), logprobs)
    (name_grad,) = torch.autograd.grad(kl_penalty(logprobs, x["ref"], name).sum(), logprobs)
    assert_close(kl_penalty(x["logprobs"], x["ref"], alias), kl_penalty(x["logprobs"], x["ref"], name))
    assert_close(alias_grad, name_grad)


def test_seq_mean_token_sum_norm_divides_by_the_loss_scale_factor():
    x = _inputs(13)
    by_width, _ = _call("grpo", x, {"loss_agg_mode": "seq-mean-token-sum-norm"})
    by_factor, _ = _call("grpo", x, {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 2 * S})
    assert_close(by_width, _ref_grpo(x, mode="seq-mean-token-sum-norm"))
    assert_close(by_factor, by_width / 2)


def test_grpo_accepts_the_training_api_aliases():
    x = _inputs(3)
    context = {
        "advantages": x["advantages"],
        "loss_mask": x["loss_mask"],
        "old_log_probs_shifted": x["old"],
        "ref_log_probs_shifted": x["ref"],
    }
    config = {"use_kl_loss": True, "kl_loss_coef": 0.2, "kl_loss_type": "k2"}
    loss, _ = get_loss("grpo")(x["logprobs"], context=context, config=config, entropy_BS=None)
    assert_close(loss, _ref_grpo(x, kl="k2", kl_coef=0.2))


def test_grpo_entropy_bonus_is_subtracted():
    x = _inputs(4)
    loss, metrics = _call("grpo", x, {"entropy_coeff": 0.05, "loss_agg_mode": "seq-mean-token-sum"})
    assert_close(loss, _ref_grpo(x, mode="seq-mean-token-sum", entropy_coeff=0.05))
    expected_entropy = (x["entropy"] * x["loss_mask"]).sum() / x["loss_mask"].sum()
    assert_close(metrics["entropy"], expected_entropy)


def test_grpo_without_old_logprobs_has_unit_ratio_and_policy_gradient():
    x = _inputs(5)
    logprobs = x["logprobs"].clone().requires_grad_(True)
    context = {"advantages": x["advantages"], "loss_mask": x["loss_mask"]}
    loss, metrics = get_loss("grpo")(logprobs, context=context, config={}, entropy_BS=None)
    loss.backward()
    num_tokens = x["loss_mask"].sum()
    assert_close(loss.detach(), -(x["advantages"] * x["loss_mask"]).sum() / num_tokens)
    assert_close(logprobs.grad, -x["advantages"] * x["loss_mask"] / num_tokens)
    assert metrics["importance_weight"].item() == pytest.approx(1.0)
    assert metrics["approx_kl"].item() == pytest.approx(0.0)


def test_grpo_reports_the_documented_metrics():
    _, metrics = _call("grpo", _inputs(6), {})
    assert set(metrics) == {"approx_kl", "clip_ratio", "entropy", "importance_weight", "loss"}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_grpo_two_halves_with_full_normalisers_equal_the_full_batch(mode):
    x = _inputs(7)
    full, _ = _call("grpo", x, {"loss_agg_mode": mode})
    totals = {"loss_agg_mode": mode, "batch_num_tokens": x["loss_mask"].sum().item(), "global_batch_size": B}
    halves = []
    for rows in (slice(0, 1), slice(1, B)):
        part = {k: v[rows] for k, v in x.items()}
        context = {"advantages": part["advantages"], "loss_mask": part["loss_mask"], "old_logprobs": part["old"]}
        loss, _ = get_loss("grpo")(part["logprobs"], context=context, config=totals, entropy_BS=part["entropy"])
        halves.append(loss)
    assert_close(halves[0] + halves[1], full)


def test_grpo_dp_size_scales_the_loss():
    x = _inputs(8)
    single, _ = _call("grpo", x, {})
    double, _ = _call("grpo", x, {"dp_size": 2})
    assert_close(double, 2 * single)


def test_grpo_rejects_bad_options():
    x = _inputs()
    with pytest.raises(InvalidRequestError, match="c_clip must be > 1"):
        _call("grpo", x, {"c_clip": 0.5})
    with pytest.raises(InvalidRequestError, match="loss_agg_mode must be one of"):
        _call("grpo", x, {"loss_agg_mode": "sum"})
    with pytest.raises(InvalidRequestError, match=r"context\.ref_logprobs is missing"):
        _call("grpo", x, {"use_kl_loss": True})
    with pytest.raises(InvalidRequestError, match="kl_type must be one of"):
        _call("grpo", x, {"use_kl_loss": True, "kl_type": "k9"}, with_ref=True)
    with pytest.raises(InvalidRequestError, match="'full' needs whole-vocabulary distributions"):
        _call("grpo", x, {"use_kl_loss": True, "kl_type": "full"}, with_ref=True)
    with pytest.raises(InvalidRequestError, match="needs token entropies"):
        _call("grpo", x, {"entropy_coeff": 0.1}, entropy=False)
    with pytest.raises(InvalidRequestError, match=r"processing\.config\.kl_agg_mode must be one of"):
        _call("grpo", x, {"use_kl_loss": True, "kl_agg_mode": "sum"}, with_ref=True)


def test_grpo_regularisers_take_their_own_aggregation_modes():
    x = _inputs(9)
    terms = {"use_kl_loss": True, "kl_type": "k1", "kl_coef": 0.3, "entropy_coeff": 0.05}
    loss, _ = _call(
        "grpo", x, {**terms, "loss_agg_mode": "token-sum", "kl_agg_mode": "seq-mean-token-mean",
                    "entropy_agg_mode": "token-mean"}, with_ref=True,
    )  # fmt: skip
    mask = x["loss_mask"].tolist()
    policy = _ref_grpo(x, mode="token-sum")
    logp, ref = x["logprobs"].tolist(), x["ref"].tolist()
    kl_tokens = [[logp[b][s] - ref[b][s] for s in range(S)] for b in range(B)]
    kl = _ref_aggregate(kl_tokens, mask, "seq-mean-token-mean")
    entropy = _ref_aggregate(x["entropy"].tolist(), mask, "token-mean")
    assert_close(loss, policy + 0.3 * kl - 0.05 * entropy)


# --- importance sampling and cross entropy -----------------------------------------------------------
@pytest.mark.parametrize("mode", AGG_MODES)
def test_importance_sampling_matches_reference(mode):
    x = _inputs(9)
    loss, metrics = _call("importance_sampling", x, {"loss_agg_mode": mode})
    logp, old, adv = x["logprobs"].tolist(), x["old"].tolist(), x["advantages"].tolist()
    per_token = [[-adv[b][s] * math.exp(logp[b][s] - old[b][s]) for s in range(S)] for b in range(B)]
    assert_close(loss, torch.tensor(_ref_aggregate(per_token, x["loss_mask"].tolist(), mode)))
    assert "clip_ratio" not in metrics


def test_cross_entropy_is_token_mean_negative_logprob():
    x = _inputs(10)
    loss, metrics = get_loss("cross_entropy")(
        x["logprobs"], context={"loss_mask": x["loss_mask"]}, config={}, entropy_BS=None
    )
    logp, mask = x["logprobs"].tolist(), x["loss_mask"].tolist()
    expected = -sum(logp[b][s] for b in range(B) for s in range(S) if mask[b][s]) / sum(map(sum, mask))
    assert_close(loss, torch.tensor(expected))
    assert metrics["loss"].item() == pytest.approx(expected)
    halved, _ = get_loss("cross_entropy")(
        x["logprobs"], context={"loss_mask": x["loss_mask"]}, config={"batch_num_tokens": 2 * sum(map(sum, mask))},
        entropy_BS=None,
    )  # fmt: skip
    assert_close(halved, loss / 2)


# --- registry ----------------------------------------------------------------------------------------
def test_get_loss_unknown_name_lists_known_losses():
    with pytest.raises(InvalidRequestError) as info:
        get_loss("ppo_typo")
    message = str(info.value)
    assert "processing.loss_fn 'ppo_typo'" in message
    for name in ("cross_entropy", "grpo", "importance_sampling"):
        assert name in message


def test_register_loss_refuses_to_shadow_an_existing_name():
    with pytest.raises(ValueError, match="already registered"):

        @register_loss("grpo")
        def other(logprobs_BS, *, context, config, entropy_BS):  # pragma: no cover - never called
            return logprobs_BS.sum(), {}

    assert "grpo" in registered_losses()


# --- gspo ----------------------------------------------------------------------------------------
def _ref_gspo(x, ratio_mask, low, high):
    """Per row: s = exp(mean log-ratio over ratio_mask); loss = Σ_t -min(s·A_t, clip(s)·A_t) over loss_mask."""
    total = 0.0
    for b in range(B):
        count = sum(ratio_mask[b][s] for s in range(S))
        log_ratio = sum((x["logprobs"][b][s] - x["old"][b][s]) * ratio_mask[b][s] for s in range(S)) / count
        ratio = math.exp(log_ratio)
        for s in range(S):
            advantage = x["advantages"][b][s]
            total += -min(ratio * advantage, min(max(ratio, low), high) * advantage) * x["loss_mask"][b][s]
    return total


def _gspo(x, config, ratio_mask=None):
    logprobs = x["logprobs"].clone().requires_grad_(True)
    context = {"loss_mask": x["loss_mask"], "advantages": x["advantages"], "old_logprobs": x["old"]}
    if ratio_mask is not None:
        context["sequence_ratio_mask"] = ratio_mask
    loss, metrics = get_loss("gspo")(logprobs, context=context, config=config, entropy_BS=None)
    loss.backward()
    return loss, metrics, logprobs.grad


@pytest.mark.parametrize("low, high", [(1.0 - 3e-4, 1.0 + 4e-4), (0.5, 2.0)])
def test_gspo_matches_the_sequence_ratio_reference(low, high):
    x = _inputs(4)
    ratio_mask = x["loss_mask"].clone()
    ratio_mask[0, 2] = 0  # the ratio over fewer positions than the loss covers
    config = {"clip_low_threshold": low, "clip_high_threshold": high}
    loss, _, _ = _gspo(x, config, ratio_mask)
    expected = _ref_gspo({k: v.tolist() for k, v in x.items()}, ratio_mask.tolist(), low, high)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_gspo_without_a_mask_takes_the_ratio_over_the_positions_with_an_advantage():
    x = _inputs(7)
    x["advantages"][0, 2] = 0.0  # e.g. a prompt position: no sampler log-prob there
    x["old"][0, 2] = 0.0
    config = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    loss, _, _ = _gspo(x, config)
    ratio_mask = x["loss_mask"] * (x["advantages"] != 0)
    assert loss.item() == pytest.approx(_gspo(x, config, ratio_mask)[0].item(), rel=1e-6)
    assert loss.item() != pytest.approx(_gspo(x, config, x["loss_mask"])[0].item(), rel=1e-3)


def test_gspo_gradient_is_the_sequence_ratio_times_the_token_gradient_when_unclipped():
    x = _inputs(5)
    _, metrics, grad = _gspo(x, {"clip_low_threshold": 0.0, "clip_high_threshold": 1e9})
    mask = x["loss_mask"]
    ratio_B = (((x["logprobs"] - x["old"]) * mask).sum(-1) / mask.sum(-1)).exp()
    assert_close(grad, -ratio_B[:, None] * x["advantages"] * mask)
    assert metrics["clip_ratio"] == 0.0


def test_gspo_defaults_clip_every_row_off_the_sampler_and_none_on_it():
    x = _inputs(6)
    _, metrics, _ = _gspo(x, {})  # old log-probs 0.4 nats off: every sequence ratio leaves 1 ± 4e-4
    assert metrics["clip_ratio"] == 1.0
    on_policy = {**x, "old": x["logprobs"]}
    loss, metrics, _ = _gspo(on_policy, {})
    assert metrics["clip_ratio"] == 0.0
    assert loss.item() == pytest.approx(-(x["advantages"] * x["loss_mask"]).sum().item(), rel=1e-6)
