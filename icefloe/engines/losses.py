"""Policy losses, registered by name and looked up from ``processing.loss_fn``.

A loss is a pure function::

    loss_fn(logprobs_BS, *, context, config, entropy_BS) -> (loss, metrics)

``logprobs_BS`` are the current policy's shifted log-probs (column ``i`` scores token ``i+1``),
``context`` holds the batch's ``[B, S]`` context tensors (``advantages``, ``loss_mask``,
``old_logprobs``, ``ref_logprobs``; the training API's ``*_log_probs_shifted`` names are accepted),
``config`` is ``processing.config``. ``loss`` is a scalar with a gradient; ``metrics`` maps names to
detached 0-dim tensors (or floats), so the engine converts every metric with a single device sync.

Normalisers: token-mean divides by ``batch_num_tokens`` and the seq-mean modes by
``global_batch_size``. Both default to this call's own totals (Σ loss_mask and B); passing the
totals of the whole optimizer batch makes several ``fwd_bwd`` calls sum to one full-batch call.
``dp_size`` (default 1) multiplies the loss so that averaging gradients over data-parallel ranks
yields the global sum. Tensors: B rows, S positions.

The aggregation modes and KL estimators are verl's (``core_algos.agg_loss`` / ``kl_penalty``),
with the same names and meaning. Defaults of this direct API differ from verl's in three places,
and a verl payload gets verl's (``icefloe.client.batch.to_canonical`` fills them in): no dual clip
unless ``c_clip`` is set (verl: ``clip_ratio_c=3.0`` always), ``global_batch_size`` = B (verl: rows
with at least one token), and ``seq-mean-token-sum-norm`` divides by S, the frame's width (verl:
the response width).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor

from icefloe.protocol import InvalidRequestError

__all__ = [
    "AGG_MODES",
    "KL_TYPES",
    "LossFn",
    "Metrics",
    "aggregate",
    "get_loss",
    "kl_penalty",
    "loss_requirements",
    "register_loss",
    "registered_losses",
]

Metrics = dict[str, Tensor | float]
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")
# verl's KL estimator names → the estimator; "kl"/"mse"/"k3" are verl's aliases of k1/k2/low_var_kl.
_KL_ESTIMATORS = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "k3": "k3", "low_var_kl": "k3"}
# Every name with a "+" suffix is the straight-through variant: its value, the gradient of k2.
KL_TYPES = (*_KL_ESTIMATORS, *(f"{name}+" for name in _KL_ESTIMATORS))
# exp() of a log-ratio beyond this overflows float32 gradients; verl clamps at the same bound.
_LOG_RATIO_BOUND = 20.0
_LOW_VAR_KL_BOUND = 10.0


class LossFn(Protocol):
    def __call__(
        self, logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any],
        entropy_BS: Tensor | None,
    ) -> tuple[Tensor, Metrics]: ...  # fmt: skip


_LOSSES: dict[str, LossFn] = {}
_REQUIRES: dict[str, tuple[str, ...]] = {}


def register_loss(name: str, *, requires: tuple[str, ...] = ()) -> Callable[[LossFn], LossFn]:
    """Register a loss under ``name``; ``requires`` lists the context keys it cannot run without.

    Raises:
        ValueError: ``name`` is already registered (two losses must not silently shadow each other).
    """

    def decorate(fn: LossFn) -> LossFn:
        if name in _LOSSES and _LOSSES[name] is not fn:
            raise ValueError(f"a loss named {name!r} is already registered ({_LOSSES[name].__qualname__})")
        _LOSSES[name] = fn
        _REQUIRES[name] = tuple(requires)
        return fn

    return decorate


def get_loss(name: str) -> LossFn:
    """Return the loss registered as ``name``; the error lists every known name."""
    try:
        return _LOSSES[name]
    except KeyError:
        raise InvalidRequestError(
            f"processing.loss_fn {name!r} is not a registered loss; use one of {registered_losses()}"
        ) from None


def loss_requirements(name: str) -> tuple[str, ...]:
    """Context keys the loss ``name`` needs (besides ``loss_mask``, which every loss needs)."""
    get_loss(name)
    return _REQUIRES[name]


def registered_losses() -> list[str]:
    return sorted(_LOSSES)


# --- shared pieces -----------------------------------------------------------------------------
def _context(context: Mapping[str, Tensor], name: str, alias: str | None = None) -> Tensor | None:
    value = context.get(name)
    if value is None and alias is not None:
        value = context.get(alias)
    return value


def _required(context: Mapping[str, Tensor], name: str, loss: str) -> Tensor:
    value = context.get(name)
    if value is None:
        raise InvalidRequestError(f"context.{name} is required by loss {loss!r}; add a float32 [B, S] tensor")
    return value


def _option(config: Mapping[str, Any], name: str, default: Any, alias: str | None = None) -> Any:
    if config.get(name) is not None:
        return config[name]
    if alias is not None and config.get(alias) is not None:
        return config[alias]
    return default


def _masked_mean(values_BS: Tensor, mask_BS: Tensor) -> Tensor:
    return (values_BS * mask_BS).sum() / mask_BS.sum().clamp_min(1.0)


def aggregate(
    loss_BS: Tensor, mask_BS: Tensor, mode: str, config: Mapping[str, Any], *, field: str = "loss_agg_mode"
) -> Tensor:
    """Reduce per-token values to a scalar with one of :data:`AGG_MODES` (verl's ``agg_loss``).

    token-mean: Σ masked / batch_num_tokens. token-sum: Σ masked. seq-mean-token-sum: Σ per-row
    sums / global_batch_size; ``-norm`` additionally ÷ ``loss_scale_factor`` (default S, the frame's
    width). seq-mean-token-mean: Σ per-row token means / global_batch_size. The result is
    multiplied by ``dp_size`` (default 1). ``field`` names the config key ``mode`` came from, for errors.
    """
    masked_BS = loss_BS * mask_BS
    if mode == "token-mean":
        num_tokens = _option(config, "batch_num_tokens", None)
        total = masked_BS.sum() / (mask_BS.sum().clamp_min(1.0) if num_tokens is None else max(num_tokens, 1))
    elif mode == "token-sum":
        total = masked_BS.sum()
    elif mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        rows_B = masked_BS.sum(dim=-1)
        if mode == "seq-mean-token-mean":
            rows_B = rows_B / mask_BS.sum(dim=-1).clamp_min(1.0)
        total = rows_B.sum() / max(_option(config, "global_batch_size", mask_BS.shape[0]), 1)
        if mode == "seq-mean-token-sum-norm":
            total = total / _option(config, "loss_scale_factor", mask_BS.shape[-1])
    else:
        raise InvalidRequestError(f"processing.config.{field} must be one of {list(AGG_MODES)}; got {mode!r}")
    return total * _option(config, "dp_size", 1)


def kl_penalty(logprobs_BS: Tensor, ref_logprobs_BS: Tensor, kl_type: str) -> Tensor:
    """Per-token KL estimate of the policy from the reference, by verl's name (:data:`KL_TYPES`).

    k1 (kl) = log π - log π_ref; abs = |k1|; k2 (mse) = ½ k1²; k3 (low_var_kl) = r - log r - 1
    with r = π_ref / π, the log-ratio clamped to ±20 and the estimate to ±10 for stability. A
    ``+`` suffix keeps the value and takes the gradient of k2 (straight through), since k2's
    gradient is the unbiased estimate of the KL's gradient.
    """
    straight_through = kl_type.endswith("+")
    estimator = _KL_ESTIMATORS.get(kl_type[:-1] if straight_through else kl_type)
    if estimator is None:
        why = " ('full' needs whole-vocabulary distributions; verl does not implement it either)"
        raise InvalidRequestError(
            f"processing.config.kl_type must be one of {list(KL_TYPES)}; got {kl_type!r}"
            + (why if kl_type == "full" else "")
        )
    diff_BS = logprobs_BS - ref_logprobs_BS
    if estimator == "k1":
        kl_BS = diff_BS
    elif estimator == "abs":
        kl_BS = diff_BS.abs()
    elif estimator == "k2":
        kl_BS = 0.5 * diff_BS.square()
    else:
        log_ratio_BS = (-diff_BS).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        kl_BS = (log_ratio_BS.exp() - log_ratio_BS - 1.0).clamp(-_LOW_VAR_KL_BOUND, _LOW_VAR_KL_BOUND)
    if straight_through and estimator != "k2":
        k2_BS = 0.5 * diff_BS.square()
        kl_BS = k2_BS - k2_BS.detach() + kl_BS.detach()
    return kl_BS


def _importance_ratio(logprobs_BS: Tensor, context: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
    """π / π_old and its log; without old log-probs the old policy is the current one (ratio 1)."""
    old_BS = _context(context, "old_logprobs", "old_log_probs_shifted")
    if old_BS is None:
        old_BS = logprobs_BS.detach()
    log_ratio_BS = (logprobs_BS - old_BS).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    return log_ratio_BS.exp(), log_ratio_BS


def _regularise(
    loss: Tensor, metrics: Metrics, logprobs_BS: Tensor, *, context: Mapping[str, Tensor],
    config: Mapping[str, Any], entropy_BS: Tensor | None, mask_BS: Tensor, mode: str, name: str,
) -> Tensor:  # fmt: skip
    """Add the entropy bonus and the KL-to-reference term shared by the policy-gradient losses.

    Each term is aggregated with ``loss_agg_mode`` unless ``entropy_agg_mode`` / ``kl_agg_mode``
    names another mode (SkyRL: entropy token-mean, KL seq-mean-token-mean, whatever its reduction).
    """
    entropy_coeff = float(_option(config, "entropy_coeff", 0.0))
    if entropy_BS is not None:
        metrics["entropy"] = _masked_mean(entropy_BS.detach(), mask_BS)
    if entropy_coeff != 0.0:
        if entropy_BS is None:
            raise InvalidRequestError(
                f"processing.config.entropy_coeff={entropy_coeff} needs token entropies, but loss {name!r} "
                "was called without entropy_BS"
            )
        entropy_mode = _option(config, "entropy_agg_mode", mode)
        loss = loss - entropy_coeff * aggregate(entropy_BS, mask_BS, entropy_mode, config, field="entropy_agg_mode")
    if _option(config, "use_kl_loss", False):
        ref_BS = _context(context, "ref_logprobs", "ref_log_probs_shifted")
        if ref_BS is None:
            raise InvalidRequestError(
                "processing.config.use_kl_loss is true but context.ref_logprobs is missing; add the reference "
                "policy's shifted log-probs or set use_kl_loss=false"
            )
        kl_type = _option(config, "kl_type", "low_var_kl", alias="kl_loss_type")
        kl_coef = float(_option(config, "kl_coef", 0.001, alias="kl_loss_coef"))
        kl_BS = kl_penalty(logprobs_BS, ref_BS, kl_type)
        kl_mode = _option(config, "kl_agg_mode", mode)
        loss = loss + kl_coef * aggregate(kl_BS, mask_BS, kl_mode, config, field="kl_agg_mode")
        metrics["kl"] = _masked_mean(kl_BS.detach(), mask_BS)
    return loss


# --- losses ------------------------------------------------------------------------------------
@register_loss("grpo", requires=("advantages",))
def grpo_loss(
    logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any], entropy_BS: Tensor | None
) -> tuple[Tensor, Metrics]:
    """PPO/GRPO clipped surrogate with optional dual clip, entropy bonus and KL to a reference.

    Per token: max(-A·r, -A·clip(r, 1-eps_clip, 1+eps_clip_higher)), and for A < 0 additionally
    capped at -A·c_clip (dual clip). Normaliser: see :func:`aggregate` (``loss_agg_mode``, default
    token-mean over ``batch_num_tokens``). ``context.rollout_is_weights`` (optional) scales each token.
    Metrics as verl's: ``clip_ratio`` is the fraction of tokens clipped at 1 ± eps (``pg_clipfrac``),
    ``clip_ratio_lower`` (with dual clip) the fraction capped at -A·c_clip (``pg_clipfrac_lower``).
    """
    mask_BS = context["loss_mask"]
    advantages_BS = _required(context, "advantages", "grpo")
    eps_low = float(_option(config, "eps_clip", 0.2))
    eps_high = float(_option(config, "eps_clip_higher", eps_low))
    c_clip = _option(config, "c_clip", None)
    mode = _option(config, "loss_agg_mode", "token-mean")
    ratio_BS, log_ratio_BS = _importance_ratio(logprobs_BS, context)

    unclipped_BS = -advantages_BS * ratio_BS
    clipped_BS = -advantages_BS * ratio_BS.clamp(1.0 - eps_low, 1.0 + eps_high)
    surrogate_BS = torch.maximum(unclipped_BS, clipped_BS)
    metrics: Metrics = {"clip_ratio": _masked_mean((clipped_BS > unclipped_BS).float(), mask_BS)}
    if c_clip is not None:
        if float(c_clip) <= 1.0:
            raise InvalidRequestError(f"processing.config.c_clip must be > 1 (or null for no dual clip); got {c_clip}")
        dual_BS = -advantages_BS * float(c_clip)
        negative_BS = advantages_BS < 0
        metrics["clip_ratio_lower"] = _masked_mean((negative_BS & (surrogate_BS > dual_BS)).float(), mask_BS)
        surrogate_BS = torch.where(negative_BS, torch.minimum(surrogate_BS, dual_BS), surrogate_BS)
    weights_BS = context.get("rollout_is_weights")
    if weights_BS is not None:
        surrogate_BS = surrogate_BS * weights_BS

    loss = aggregate(surrogate_BS, mask_BS, mode, config)
    metrics["approx_kl"] = _masked_mean(-log_ratio_BS.detach(), mask_BS)
    metrics["importance_weight"] = _masked_mean(ratio_BS.detach(), mask_BS)
    loss = _regularise(
        loss, metrics, logprobs_BS, context=context, config=config, entropy_BS=entropy_BS, mask_BS=mask_BS,
        mode=mode, name="grpo",
    )  # fmt: skip
    metrics["loss"] = loss.detach()
    return loss, metrics


@register_loss("importance_sampling", requires=("advantages",))
def importance_sampling_loss(
    logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any], entropy_BS: Tensor | None
) -> tuple[Tensor, Metrics]:
    """REINFORCE with an unclipped importance weight: per token -A·exp(log π - log π_old).

    Normaliser: see :func:`aggregate` (``loss_agg_mode``, default token-mean over ``batch_num_tokens``).
    Entropy bonus and KL term as for ``grpo``.
    """
    mask_BS = context["loss_mask"]
    advantages_BS = _required(context, "advantages", "importance_sampling")
    mode = _option(config, "loss_agg_mode", "token-mean")
    ratio_BS, log_ratio_BS = _importance_ratio(logprobs_BS, context)
    loss = aggregate(-advantages_BS * ratio_BS, mask_BS, mode, config)
    metrics: Metrics = {
        "approx_kl": _masked_mean(-log_ratio_BS.detach(), mask_BS),
        "importance_weight": _masked_mean(ratio_BS.detach(), mask_BS),
    }
    loss = _regularise(
        loss, metrics, logprobs_BS, context=context, config=config, entropy_BS=entropy_BS, mask_BS=mask_BS,
        mode=mode, name="importance_sampling",
    )  # fmt: skip
    metrics["loss"] = loss.detach()
    return loss, metrics


@register_loss("cross_entropy")
def cross_entropy_loss(
    logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any], entropy_BS: Tensor | None
) -> tuple[Tensor, Metrics]:
    """Supervised fine-tuning: -Σ masked w·log π(target) / batch_num_tokens (token-mean).

    ``context.weights`` (optional, [B, S]) weighs each token (w = 1 without it); ``loss_agg_mode``
    (default token-mean) picks the normaliser, ``token-sum`` giving the Tinker API's plain sum.
    """
    mask_BS = context["loss_mask"]
    weights_BS = context.get("weights")
    nll_BS = -logprobs_BS if weights_BS is None else -logprobs_BS * weights_BS
    loss = aggregate(nll_BS, mask_BS, _option(config, "loss_agg_mode", "token-mean"), config)
    metrics: Metrics = {"loss": loss.detach()}
    if entropy_BS is not None:
        metrics["entropy"] = _masked_mean(entropy_BS.detach(), mask_BS)
    return loss, metrics


# --- the Tinker API's RL losses: sums over tokens unless loss_agg_mode says otherwise -------------
def _clipped_surrogate(ratio_BS: Tensor, advantages_BS: Tensor, low: float, high: float) -> Tensor:
    """Per token -min(r·A, clip(r, low, high)·A): PPO's pessimistic bound, shared by ppo and gspo."""
    return -torch.minimum(ratio_BS * advantages_BS, ratio_BS.clamp(low, high) * advantages_BS)


def _clipped_ratio(
    logprobs_BS: Tensor, context: Mapping[str, Tensor], config: Mapping[str, Any], name: str
) -> tuple[Tensor, float, float]:
    """The sampling ratio r = exp(logp - old_logp) and the clip range (``clip_low_threshold`` /
    ``clip_high_threshold``, default 0.8 / 1.2) of the Tinker API's clipped losses."""
    old_BS = _context(context, "old_logprobs", "old_log_probs_shifted")
    if old_BS is None:
        raise InvalidRequestError(f"context.old_logprobs is required by loss {name!r}; add the sampler's log-probs")
    ratio_BS = (logprobs_BS - old_BS).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    return (
        ratio_BS,
        float(_option(config, "clip_low_threshold", 0.8)),
        float(_option(config, "clip_high_threshold", 1.2)),
    )


def _tinker_aggregate(per_token_BS: Tensor, context: Mapping[str, Tensor], config: Mapping[str, Any]) -> Tensor:
    """The Tinker losses' normaliser: :func:`aggregate` with ``loss_agg_mode`` default token-sum."""
    return aggregate(per_token_BS, context["loss_mask"], _option(config, "loss_agg_mode", "token-sum"), config)


@register_loss("ppo", requires=("advantages", "old_logprobs"))
def ppo_loss(
    logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any], entropy_BS: Tensor | None
) -> tuple[Tensor, Metrics]:
    """PPO clipped objective as the Tinker API defines it: per token -min(r·A, clip(r, low, high)·A).

    ``clip_low_threshold`` / ``clip_high_threshold`` default to 0.8 / 1.2. Normaliser: see
    :func:`aggregate` (``loss_agg_mode``, default token-sum).
    """
    advantages_BS = context["advantages"]
    ratio_BS, low, high = _clipped_ratio(logprobs_BS, context, config, "ppo")
    loss = _tinker_aggregate(_clipped_surrogate(ratio_BS, advantages_BS, low, high), context, config)
    clipped_BS = ((ratio_BS < low) | (ratio_BS > high)).float()
    return loss, {"loss": loss.detach(), "clip_ratio": _masked_mean(clipped_BS, context["loss_mask"])}


@register_loss("cispo", requires=("advantages", "old_logprobs"))
def cispo_loss(
    logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any], entropy_BS: Tensor | None
) -> tuple[Tensor, Metrics]:
    """CISPO: per token -sg(clip(r, low, high))·A·log π, the clipped ratio a constant weight.

    ``clip_low_threshold`` / ``clip_high_threshold`` default to 0.8 / 1.2. Normaliser: see
    :func:`aggregate` (``loss_agg_mode``, default token-sum).
    """
    ratio_BS, low, high = _clipped_ratio(logprobs_BS, context, config, "cispo")
    weight_BS = ratio_BS.clamp(low, high).detach()
    loss = _tinker_aggregate(-weight_BS * context["advantages"] * logprobs_BS, context, config)
    return loss, {"loss": loss.detach()}


@register_loss("dro", requires=("advantages", "old_logprobs"))
def dro_loss(
    logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any], entropy_BS: Tensor | None
) -> tuple[Tensor, Metrics]:
    """DRO: per token -(A·log π - ½·beta·(log π - log π_old)²), a quadratic pull to the sampler.

    ``beta`` defaults to 0.05. Normaliser: see :func:`aggregate` (``loss_agg_mode``, default token-sum).
    """
    old_BS = _context(context, "old_logprobs", "old_log_probs_shifted")
    assert old_BS is not None  # required above
    beta = float(_option(config, "beta", 0.05))
    per_token_BS = -(context["advantages"] * logprobs_BS - 0.5 * beta * (logprobs_BS - old_BS).square())
    loss = _tinker_aggregate(per_token_BS, context, config)
    return loss, {"loss": loss.detach()}


@register_loss("gspo", requires=("advantages", "old_logprobs"))
def gspo_loss(
    logprobs_BS: Tensor, *, context: Mapping[str, Tensor], config: Mapping[str, Any], entropy_BS: Tensor | None
) -> tuple[Tensor, Metrics]:
    """GSPO (token form): PPO's clipped objective on each row's sequence ratio instead of the token's.

    A row's ratio is s = exp(mean of (log π - log π_old) over its ``context.sequence_ratio_mask``
    positions), the geometric mean of its token ratios. Without a mask it is taken over the
    positions with a nonzero advantage: the sampled tokens of an RL datum, whose prompt positions
    carry advantage 0 and no sampler log-prob. Per token
    the ratio is sg(s)·π/sg(π): its value is s, its gradient that of the token's log π, so with one
    advantage per row this is the sequence-level objective. Per token -min(s·A, clip(s, low,
    high)·A); ``clip_low_threshold`` / ``clip_high_threshold`` default to 1 - 3e-4 / 1 + 4e-4, the
    ranges GSPO was published with. Normaliser: see :func:`aggregate` (default token-sum).
    ``clip_ratio`` is the share of scored tokens in rows whose ratio was clipped.
    """
    mask_BS, advantages_BS = context["loss_mask"], context["advantages"]
    old_BS = _context(context, "old_logprobs", "old_log_probs_shifted")
    assert old_BS is not None  # required above
    ratio_mask_BS = context.get("sequence_ratio_mask")
    if ratio_mask_BS is None:
        ratio_mask_BS = mask_BS * (advantages_BS != 0)
    log_ratio_B = ((logprobs_BS - old_BS).detach() * ratio_mask_BS).sum(-1) / ratio_mask_BS.sum(-1).clamp_min(1.0)
    sequence_ratio_B = log_ratio_B.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND).exp()
    ratio_BS = sequence_ratio_B[:, None] * (logprobs_BS - logprobs_BS.detach()).exp()
    low = float(_option(config, "clip_low_threshold", 1.0 - 3e-4))
    high = float(_option(config, "clip_high_threshold", 1.0 + 4e-4))
    loss = _tinker_aggregate(_clipped_surrogate(ratio_BS, advantages_BS, low, high), context, config)
    clipped_B = ((sequence_ratio_B < low) | (sequence_ratio_B > high)).float()
    # Token-weighted like every metric, so micro-batches and data-parallel ranks combine it exactly.
    return loss, {"loss": loss.detach(), "clip_ratio": _masked_mean(clipped_B[:, None].expand_as(mask_BS), mask_BS)}
