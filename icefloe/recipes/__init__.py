"""Training loops written against the public client API, and the tasks they learn."""

from icefloe.recipes.grpo import GRPOConfig, group_advantages, main, run, summarize
from icefloe.recipes.tasks import ArithmeticTask, Problem, exact_match_reward, load_gsm8k

__all__ = [
    "ArithmeticTask",
    "GRPOConfig",
    "Problem",
    "exact_match_reward",
    "group_advantages",
    "load_gsm8k",
    "main",
    "run",
    "summarize",
]
