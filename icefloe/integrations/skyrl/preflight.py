"""Checks that run before any client or Ray task exists, so a bad run fails in seconds, not hours.

Two failure modes motivate them. A verl-shaped GSM8K parquet (``reward_model``, no ``env_class``)
makes SkyRL's environments score every rollout 0.0: the run trains mechanically on a zero signal.
And SkyRL settings that need something icefloe's backend cannot give (multi-epoch PPO or KL
without a ``forward`` op, a critic, SkyRL's own colocation) must be refused, all at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from icefloe.integrations._guards import PolicyRegime, refuse_zero_logprobs
from icefloe.integrations.skyrl.config import section_of
from icefloe.protocol import ConfigError

__all__ = ["PREPARE_DATA_COMMAND", "REQUIRED_COLUMNS", "check_settings", "check_train_data"]

logger = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("env_class", "reward_spec")
PREPARE_DATA_COMMAND = "python examples/skyrl/prepare_gsm8k.py --output-dir ~/data/gsm8k-skyrl"
# Advantage estimators that need no critic (SkyRL's outcome-reward estimators).
_CRITIC_FREE_ESTIMATORS = ("grpo", "rloo", "reinforce++")


def check_train_data(paths: Iterable[str]) -> None:
    """Refuse training parquet files that lack SkyRL's ``env_class`` / ``reward_spec`` columns.

    Non-parquet sources (JSON files, Hub dataset names) are not opened here.

    Raises:
        ConfigError: a file is missing, or lacks columns; names each file and the command that writes the data.
    """
    import pyarrow.parquet as pq

    problems = []
    for raw in paths:
        path = os.path.expanduser(str(raw))
        if not path.endswith(".parquet"):
            logger.info("data.train_data entry %s is not a parquet file; its schema is not checked", raw)
            continue
        if not os.path.exists(path):
            problems.append(f"{raw}: no such file")
            continue
        columns = set(pq.read_schema(path).names)
        missing = [name for name in REQUIRED_COLUMNS if name not in columns]
        if missing:
            hint = " (this is verl's GSM8K schema)" if "reward_model" in columns else ""
            problems.append(f"{raw}: missing column(s) {', '.join(missing)}{hint}")
    if problems:
        raise ConfigError(
            "data.train_data is not in SkyRL's schema (each row needs env_class and reward_spec, or every "
            "reward is silently 0.0):\n  "
            + "\n  ".join(problems)
            + f"\nwrite SkyRL-shaped data with: {PREPARE_DATA_COMMAND}"
        )


def check_settings(cfg: Any, *, has_forward: bool, backend: str) -> None:
    """Refuse SkyRL settings the chosen backend cannot honour, listing every offender in one error.

    Args:
        cfg: the parsed SkyRL config (with ``trainer.icefloe``).
        has_forward: the backend executes ``forward`` (old / reference log-probs).
        backend: the backend's name, for the message.
    """
    trainer, algorithm = cfg.trainer, cfg.trainer.algorithm
    if not has_forward:
        refuse_zero_logprobs(
            PolicyRegime(
                use_kl_loss=bool(algorithm.use_kl_loss),
                use_kl_in_reward=bool(algorithm.use_kl_in_reward),
                epochs=int(trainer.update_epochs_per_batch),
                advantage_estimator=str(algorithm.advantage_estimator),
                policy_loss=None if algorithm.policy_loss_type == "regular" else str(algorithm.policy_loss_type),
                multi_turn=int(getattr(cfg.generator, "max_turns", 1) or 1) > 1,
                labels={
                    "use_kl_loss": "trainer.algorithm.use_kl_loss",
                    "use_kl_in_reward": "trainer.algorithm.use_kl_in_reward",
                    "epochs": "trainer.update_epochs_per_batch",
                    "advantage_estimator": "trainer.algorithm.advantage_estimator",
                    "policy_loss": "trainer.algorithm.policy_loss_type",
                    "multi_turn": "generator.max_turns>1",
                },
            ),
            backend=backend,
        )
    problems = []
    if trainer.placement.colocate_all:
        problems.append(
            "trainer.placement.colocate_all=true (icefloe colocates on the backend: set it false and use "
            "trainer.icefloe.colocate=true)"
        )
    if algorithm.advantage_estimator not in _CRITIC_FREE_ESTIMATORS:
        problems.append(
            f"trainer.algorithm.advantage_estimator={algorithm.advantage_estimator!r} (needs a critic; use one of "
            f"{list(_CRITIC_FREE_ESTIMATORS)})"
        )
    if getattr(trainer.critic.model, "path", None):
        problems.append("trainer.critic.model.path is set (icefloe trains no critic; unset it)")
    if int(trainer.update_epochs_per_batch) < 1:
        problems.append(f"trainer.update_epochs_per_batch={trainer.update_epochs_per_batch} (must be >= 1)")
    needs_reference = bool(algorithm.use_kl_loss or algorithm.use_kl_in_reward)
    if has_forward and needs_reference and section_of(cfg).num_log_prob_workers < 1:
        problems.append(
            "trainer.algorithm.use_kl_loss / use_kl_in_reward need reference log-probs (set "
            "trainer.icefloe.num_log_prob_workers=1, or turn both off)"
        )
    if problems:
        raise ConfigError("these SkyRL settings do not work with icefloe:\n  " + "\n  ".join(sorted(problems)))
