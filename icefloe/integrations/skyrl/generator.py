"""``IcefloeGenerator``: SkyRL's ``GeneratorInterface`` over icefloe's ``generate``, scored by ``skyrl_gym``.

Single-turn: each prompt (a chat message list from the dataset) goes through the tokenizer's chat
template, is sampled once per row (SkyRL already repeats each prompt ``n_samples_per_prompt``
times), and the response text is scored by the row's environment in a process pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from skyrl.train.generators.base import GeneratorInterface

from icefloe.client import Client
from icefloe.integrations.skyrl.scoring import Sample, ScoringPool
from icefloe.protocol import ConfigError, SamplingParams

__all__ = ["IcefloeGenerator", "to_sampling_params"]

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = frozenset(SamplingParams.model_fields) - {"n"}
# SkyRL / vLLM spellings with an icefloe equivalent under another name.
_RENAMED = {"max_generate_length": "max_tokens"}


def to_sampling_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """SkyRL's sampling-params dict (vLLM spelling) → icefloe's; keys icefloe lacks are dropped with a note."""
    out: dict[str, Any] = {}
    dropped = []
    for key, value in (params or {}).items():
        name = _RENAMED.get(key, key)
        if name in _SAMPLING_FIELDS:
            if value is not None:
                out[name] = list(value) if isinstance(value, list | tuple) else value
        elif value not in (None, False, {}, []):
            dropped.append(key)
    if dropped:
        logger.debug("sampling params without an icefloe equivalent are ignored: %s", sorted(dropped))
    return out


class IcefloeGenerator(GeneratorInterface):
    """Samples with icefloe and scores with skyrl_gym environments."""

    def __init__(
        self,
        client: Client,
        tokenizer: Any,
        scoring: ScoringPool,
        *,
        default_sampling_params: Mapping[str, Any] | None = None,
        env_configs: Mapping[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.scoring = scoring
        self.default_sampling_params = dict(default_sampling_params or {})
        self.env_configs = dict(env_configs or {})
        self.last_scoring_errors: list[str | None] = []

    def encode_prompt(self, prompt: Any) -> list[int]:
        """Chat template with the generation prompt, then token ids (no special tokens added twice)."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(
                "the policy tokenizer has no chat template, but the dataset's prompts are chat messages; use a chat "
                "model (e.g. Qwen/Qwen3-0.6B) or plain-string prompts"
            )
        text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def generate(self, input_batch: Mapping[str, Any]) -> dict[str, Any]:
        """Sample one response per prompt row and score it; returns SkyRL's ``GeneratorOutput``."""
        prompts = list(input_batch["prompts"])
        env_classes = list(input_batch["env_classes"])
        extras = list(input_batch.get("env_extras") or [{} for _ in prompts])
        if not (len(prompts) == len(env_classes) == len(extras)):
            raise ConfigError(
                f"generator input has {len(prompts)} prompts, {len(env_classes)} env_classes and {len(extras)} "
                "env_extras; SkyRL sends one of each per row"
            )
        params = to_sampling_params({**self.default_sampling_params, **(input_batch.get("sampling_params") or {})})
        prompt_ids = [self.encode_prompt(prompt) for prompt in prompts]
        results = await asyncio.to_thread(self.client.generate, prompt_ids, params)
        response_ids = [list(result["token_ids"]) for result in results]
        texts = [
            result.get("text")
            if result.get("text") is not None
            else self.tokenizer.decode(ids, skip_special_tokens=True)
            for result, ids in zip(results, response_ids, strict=True)
        ]
        samples = [
            Sample(
                env_class=env,
                extras=dict(extra or {}),
                prompt=prompt,
                text=text,
                env_config=self.env_configs.get(env),
            )
            for env, extra, prompt, text in zip(env_classes, extras, prompts, texts, strict=True)
        ]
        rewards, errors = await asyncio.to_thread(self.scoring.score, samples)
        self.last_scoring_errors = errors
        _check_scoring(errors, env_classes)
        logprobs = [result.get("logprobs") for result in results]
        return {
            "prompt_token_ids": prompt_ids,
            "response_ids": response_ids,
            "rewards": rewards,
            "loss_masks": [[1] * len(ids) for ids in response_ids],
            "stop_reasons": [str(result.get("finish_reason") or "length") for result in results],
            "rollout_metrics": _rollout_metrics(rewards, errors, response_ids),
            "rollout_logprobs": logprobs if all(lp is not None for lp in logprobs) else None,
            "trajectory_ids": input_batch.get("trajectory_ids"),
            "trajectory_generation_times": None,
            "trajectory_time_splits": None,
            "rollout_expert_indices": None,
            "is_last_step": None,
            "env_metrics": None,
            "pixel_values": None,
            "image_grid_thw": None,
        }

    def close(self) -> None:
        self.scoring.close()


def _check_scoring(errors: Sequence[str | None], env_classes: Sequence[str]) -> None:
    """Warn about failed scores (reward 0.0); refuse a batch where every score failed: that is a data bug."""
    failed = [(env, error) for env, error in zip(env_classes, errors, strict=True) if error is not None]
    if not failed:
        return
    if len(failed) == len(errors):
        env, error = failed[0]
        raise ConfigError(
            f"every sample's environment failed, e.g. {env!r}: {error}. Check that the data has SkyRL's env_class and "
            "reward_spec columns, and list modules that register custom environments in trainer.icefloe.env_modules"
        )
    logger.warning("%d of %d samples failed scoring and got reward 0.0; first: %s", len(failed), len(errors), failed[0])


def _rollout_metrics(rewards: Sequence[float], errors: Sequence[str | None], response_ids: Sequence[list[int]]) -> dict:
    num = max(len(rewards), 1)
    return {
        "generate/avg_reward": sum(rewards) / num,
        "generate/avg_response_length": sum(len(ids) for ids in response_ids) / num,
        "generate/scoring_failures": sum(error is not None for error in errors),
    }
