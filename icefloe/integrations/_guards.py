"""The zero-log-prob preflight shared by the verl and SkyRL integrations.

A backend without ``forward`` (the managed endpoint) can only answer log-prob requests with zeros.
That is sound only while nothing reads them: single-epoch, on-policy GRPO with the built-in loss,
no KL term and single-turn rollouts (the loss then uses ``old_logprobs = logprobs.detach()``).
Every other setting would train on zeros and still look healthy, so it is refused up front,
before a client exists, with every offending knob in one error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from icefloe.protocol import ConfigError

__all__ = ["PolicyRegime", "refuse_zero_logprobs", "zero_logprob_offenders"]

# Advantage estimators whose math never reads old or reference log-probs.
_SAFE_ESTIMATORS = frozenset({"grpo"})
# Policy losses that are the built-in clipped surrogate (ratio 1 when old log-probs are absent).
_SAFE_POLICY_LOSSES = frozenset({"", "vanilla", "grpo", "verl_grpo"})


@dataclass(frozen=True, slots=True)
class PolicyRegime:
    """The knobs that decide whether zero-filled log-probs would be read.

    ``labels`` maps each field name to the framework's own spelling of the knob, so the error
    tells the user exactly what to change.
    """

    use_kl_loss: bool
    use_kl_in_reward: bool
    epochs: int
    advantage_estimator: str
    policy_loss: str | None
    multi_turn: bool
    labels: Mapping[str, str]


def zero_logprob_offenders(regime: PolicyRegime) -> list[str]:
    """Every knob that reads log-probs a backend without ``forward`` cannot compute, sorted."""
    found: dict[str, str] = {}
    if regime.use_kl_loss:
        found["use_kl_loss"] = "True (KL to the reference needs reference log-probs)"
    if regime.use_kl_in_reward:
        found["use_kl_in_reward"] = "True (the reward penalty needs reference log-probs)"
    if regime.epochs > 1:
        found["epochs"] = f"{regime.epochs} (epochs after the first are off-policy and need old log-probs)"
    estimator = str(regime.advantage_estimator).lower()
    if estimator not in _SAFE_ESTIMATORS:
        found["advantage_estimator"] = f"{regime.advantage_estimator!r} (only 'grpo' never reads log-probs)"
    policy_loss = str(regime.policy_loss or "").lower()
    if policy_loss not in _SAFE_POLICY_LOSSES:
        found["policy_loss"] = f"{regime.policy_loss!r} (a custom policy loss may read old log-probs)"
    if regime.multi_turn:
        found["multi_turn"] = "True (multi-turn rollouts mask tool tokens by old log-probs)"
    return sorted(f"{regime.labels.get(key, key)}={why}" for key, why in found.items())


def refuse_zero_logprobs(regime: PolicyRegime, *, backend: str) -> None:
    """Raise one :class:`ConfigError` naming every knob that needs real log-probs.

    Call it only when the selected backend has no ``forward``; on backends that have one,
    every knob above works.
    """
    offenders = zero_logprob_offenders(regime)
    if not offenders:
        return
    lines = "\n  ".join(offenders)
    raise ConfigError(
        f"the {backend} backend has no forward op, so log-probs would be zero-filled; that is only sound for "
        f"single-epoch on-policy GRPO without KL. Change these settings, or use a backend with forward "
        f"(local, ray, or `icefloe serve`):\n  {lines}"
    )
