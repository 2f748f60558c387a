"""Weight sync between engines that share a process: parameter tensors copied in place.

No tensor is reallocated and nothing is serialised: each trainer parameter is ``copy_``-ed into
the sampler parameter of the same name.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from icefloe.engines.sampling import SamplingEngine, VLLMSamplingEngine
from icefloe.engines.training import TrainingEngine

__all__ = ["sync_weights_local"]


def sync_weights_local(trainer: TrainingEngine, sampler: SamplingEngine | VLLMSamplingEngine) -> dict[str, Any]:
    """Copy the trainer's weights into the sampler.

    ``policy_version`` becomes the trainer's ``global_step``: a sample's version names the optimizer
    step its weights came from, so a sync without a step in between keeps the same version.

    Returns:
        ``{"policy_version", "seconds", "bytes"}``.
    """
    start = time.perf_counter()
    num_bytes = sampler.load_weights(trainer.named_weights(), policy_version=trainer.global_step)
    if trainer.device.type == "cuda":
        torch.cuda.synchronize(trainer.device)
    return {"policy_version": trainer.global_step, "seconds": time.perf_counter() - start, "bytes": num_bytes}
