"""``IcefloePPOTrainer``: SkyRL's ``RayPPOTrainer`` with every model call routed to icefloe.

SkyRL keeps its loop (generate → rewards → advantages → train → weight sync), its GRPO advantage
estimators and its logging. What changes: no Ray actor groups are built; old log-probs come from a
real ``forward`` once per batch (so PPO epochs after the first are genuinely off-policy), or, on a
backend without ``forward``, are left out so the loss uses π_old = π (one on-policy epoch only,
which the preflight enforces); the policy update is one ``fwd_bwd`` + ``step`` per SkyRL mini-batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Any

from skyrl.train.trainer import RayPPOTrainer

from icefloe.client import Client
from icefloe.integrations.skyrl.dispatch import IcefloeDispatch

__all__ = ["IcefloeInferenceEngineStub", "IcefloePPOTrainer", "PolicyStub"]

logger = logging.getLogger(__name__)


class PolicyStub:
    """Stands where SkyRL keeps its policy actor group; the policy lives on the icefloe backend."""

    async def async_run_method(self, *args: Any, **kwargs: Any) -> None:
        return None

    def async_run_ray_method(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []


class IcefloeInferenceEngineStub:
    """Stands where SkyRL keeps its inference client; sleep and wake reach the backend only when colocated."""

    def __init__(self, client: Client, *, colocate: bool) -> None:
        self.client = client
        self.colocate = colocate

    async def sleep(self, *args: Any, level: int = 2, **kwargs: Any) -> None:
        # Level 2 also drops the sampler's weights: a colocated trainer needs that memory for its step.
        if self.colocate:
            await _in_thread(self.client.sleep_inference, level)

    async def wake_up(self, *args: Any, tags: list[str] | None = None, **kwargs: Any) -> None:
        if self.colocate:
            await _in_thread(self.client.wake_inference, tags)

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> None:
        await _in_thread(self.client.reset_prefix_cache)

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def resume_generation(self, *args: Any, **kwargs: Any) -> None:
        return None


class IcefloePPOTrainer(RayPPOTrainer):
    """SkyRL's PPO trainer whose dispatch is :class:`IcefloeDispatch` (policy only: no critic, no ref actors)."""

    def __init__(self, *args: Any, icefloe_client: Client, **kwargs: Any) -> None:
        self.icefloe_client = icefloe_client
        super().__init__(*args, **kwargs)

    def build_models(self, PolicyWorker: Any = None, CriticWorker: Any = None, RefWorker: Any = None) -> None:
        pad_token_id = self.tokenizer.pad_token_id
        if pad_token_id is None:
            pad_token_id = self.tokenizer.eos_token_id
        self.dispatch = IcefloeDispatch(self.cfg, self.icefloe_client, pad_token_id=pad_token_id)
        self.policy_model = PolicyStub()
        self.ref_model = None
        self.critic_model = None
        logger.info("icefloe: policy on the %s backend", self.icefloe_client.config.backend.type)

    def fwd_logprobs_values_reward(self, training_input: Any) -> Any:
        """Old log-probs (and reference log-probs when a KL term needs them) from the backend's ``forward``."""
        training_input["values"] = None
        algorithm = self.cfg.trainer.algorithm
        if not self.dispatch.has_forward:
            training_input["action_log_probs"] = None
            training_input["base_action_log_probs"] = None
            return training_input
        training_input["action_log_probs"] = self.dispatch.forward("policy", training_input)["output"]
        if algorithm.use_kl_loss or algorithm.use_kl_in_reward:
            training_input["base_action_log_probs"] = self.dispatch.forward("ref", training_input)["output"]
        else:
            training_input["base_action_log_probs"] = None
        return training_input

    def train_critic_and_policy(self, data: Any) -> dict[str, float]:
        """``update_epochs_per_batch`` passes over SkyRL's mini-batches: one ``fwd_bwd`` + ``step`` each."""
        data.metadata["global_step"] = self.global_step
        num_rows = data["sequences"].shape[0]
        boundaries = data.metadata.get("policy_mini_batch_boundaries") or _even_boundaries(
            num_rows, self.cfg.trainer.policy_mini_batch_size * self.cfg.generator.n_samples_per_prompt
        )
        collected: dict[str, list[float]] = defaultdict(list)
        for _ in range(int(self.cfg.trainer.update_epochs_per_batch)):
            for start, end in boundaries:
                for name, value in self.dispatch.forward_backward("policy", data, rows=(start, end)).items():
                    collected[name].append(value)
                grad_norm = self.dispatch.optim_step("policy")
                if grad_norm is not None:
                    collected["grad_norm"].append(grad_norm)
        status = {name: sum(values) / len(values) for name, values in collected.items() if values}
        if self.dispatch.last_lr is not None:
            status["policy_lr"] = float(self.dispatch.last_lr)
        for name, value in status.items():
            self.all_metrics[f"policy/{name}"] = value
        return status


def _even_boundaries(num_rows: int, mini_batch_rows: int) -> list[tuple[int, int]]:
    size = max(1, min(mini_batch_rows, num_rows))
    return [(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


async def _in_thread(function: Any, *args: Any) -> Any:
    return await asyncio.to_thread(function, *args)
