"""A pure-Python ``skyrl_gym`` environment for arithmetic prompts; importing this module registers it.

Scoring workers are spawned processes that only know skyrl_gym's built-in environments, so tests
list this module in ``env_modules`` and each worker imports it before scoring.
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs import register
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.registration import registry

ENV_ID = "icefloe_answer_digits"


class AnswerDigitsEnv(BaseTextEnv):
    """Partial credit: the share of the answer's distinct characters that appear in the response."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.ground_truth = str((extras or {})["reward_spec"]["ground_truth"])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        wanted = set(self.ground_truth)
        reward = len(wanted & set(action)) / len(wanted)
        return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={})


if ENV_ID not in registry:
    register(id=ENV_ID, entry_point=f"{__name__}:AnswerDigitsEnv")
