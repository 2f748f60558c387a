"""Weight sync between engines that share a process: parameter tensors copied in place.

No tensor is reallocated and nothing is serialised: each trainer tensor the sync moves is
``copy_``-ed into the sampler parameter of the same name. With LoRA only the adapter tensors move
(``weight_format="lora"``); the base weights are the same on both ends and never change.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from icefloe.engines.lora import check_weight_format
from icefloe.engines.sampling import SamplingEngine, VLLMSamplingEngine
from icefloe.engines.training import TrainingEngine

__all__ = ["sync_weights_local"]


def sync_weights_local(
    trainer: TrainingEngine, sampler: SamplingEngine | VLLMSamplingEngine, weight_format: str | None = None
) -> dict[str, Any]:
    """Copy the trainer's weights (or, with LoRA, its adapters) into the sampler.

    ``policy_version`` becomes the trainer's ``global_step``: a sample's version names the optimizer
    step its weights came from, so a sync without a step in between keeps the same version.
    ``weight_format`` is the training API's (``"vllm"``, ``"hf"``, ``"lora"``; None = what the
    engines hold: ``"lora"`` with LoRA, else full weights); see :func:`check_weight_format`.

    Returns:
        ``{"policy_version", "seconds", "bytes"}``.

    Raises:
        InvalidRequestError: a format the two engines cannot use (e.g. ``"lora"`` without adapters).
    """
    check_weight_format(weight_format, trainer.lora, sampler.lora)
    start = time.perf_counter()
    num_bytes = sampler.load_weights(trainer.named_weights(), policy_version=trainer.global_step)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    return {"policy_version": trainer.global_step, "seconds": time.perf_counter() - start, "bytes": num_bytes}
