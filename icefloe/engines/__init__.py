"""Torch engines: training, sampling, losses, weight sync, batch validation and the engine host."""

from icefloe.engines.batch import shifted_token_logprobs, validate_batch
from icefloe.engines.host import EngineHost, Lane, SyncGate, Worker
from icefloe.engines.losses import get_loss, register_loss, registered_losses
from icefloe.engines.models import load_causal_lm, load_tokenizer, resolve_model
from icefloe.engines.sampling import SamplingEngine, VLLMSamplingEngine, build_sampling_engine
from icefloe.engines.training import TrainingEngine, resolve_device
from icefloe.engines.weight_sync import sync_weights_local

__all__ = [
    "EngineHost",
    "Lane",
    "SamplingEngine",
    "SyncGate",
    "TrainingEngine",
    "VLLMSamplingEngine",
    "Worker",
    "build_sampling_engine",
    "get_loss",
    "load_causal_lm",
    "load_tokenizer",
    "register_loss",
    "registered_losses",
    "resolve_device",
    "resolve_model",
    "shifted_token_logprobs",
    "sync_weights_local",
    "validate_batch",
]
