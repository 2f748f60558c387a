"""What verl's ActorRolloutRef role does when icefloe owns the model, independent of verl's classes.

The V0 and V1 worker classes only unwrap verl's TensorDicts into the plain ``fields`` /
``options`` dicts this module takes, and wrap its answers back; everything that can be wrong
(densification, mini-batching, metric names, MFU) lives here and is tested without verl.
V1's ``@register`` stack turns coroutine methods into plain ones, so :class:`BackgroundLoop`
runs the async client on one persistent event loop instead of a fresh ``asyncio.run`` per call
(which would strand the client's per-loop connections).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from icefloe.integrations.verl.backend import IcefloeBackend

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "TENSOR_FIELDS",
    "BackgroundLoop",
    "FlopsEstimator",
    "Forwarder",
    "flops_estimator",
    "read_fields",
    "read_options",
]

T = TypeVar("T")
# Tensor fields the forwarder reads from a verl batch (absent ones are skipped).
TENSOR_FIELDS = (
    "input_ids",
    "attention_mask",
    "prompts",
    "responses",
    "response_mask",
    "loss_mask",
    "old_log_probs",
    "advantages",
    "ref_log_prob",
    "rollout_is_weights",
)
# (per-row token counts, seconds) → (achieved FLOP/s, peak FLOP/s), as verl's FlopsCounter answers.
FlopsEstimator = Callable[[list[int], float], tuple[float, float]]


class BackgroundLoop:
    """One event loop on a daemon thread; ``run`` submits a coroutine and blocks for its result."""

    def __init__(self, name: str = "icefloe-verl-loop") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        if self._loop.is_closed():
            raise RuntimeError("the icefloe worker's event loop was closed by destroy(); build a new worker")
        future: Future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return future.result()

    def close(self) -> None:
        """Stop the loop and join its thread. Idempotent."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class Forwarder:
    """compute_log_prob / update_actor / weight sync / checkpoints over an :class:`IcefloeBackend`."""

    def __init__(self, backend: IcefloeBackend, *, nested_batches: bool, flops: FlopsEstimator | None = None) -> None:
        self.backend = backend
        self._nested = nested_batches  # V1: every field arrives nested and is padded to the config maxima
        self._flops = flops

    @classmethod
    def attach(cls, main_config: Any, handle: Mapping[str, Any], *, nested_batches: bool) -> Forwarder:
        return cls(IcefloeBackend.from_config(main_config, handle=handle), nested_batches=nested_batches)

    def set_flops_estimator(self, flops: FlopsEstimator | None) -> None:
        self._flops = flops

    def dense(self, fields: Mapping[str, Tensor | None]) -> dict[str, Tensor]:
        """verl's dense layout; V1 batches padded to ``data.max_{prompt,response}_length``."""
        from icefloe.integrations.verl.payload import densify

        settings = self.backend.settings
        return densify(
            fields,
            pad_token_id=int(settings.pad_token_id or 0),
            max_prompt_length=settings.max_prompt_length,
            max_response_length=settings.max_response_length,
        )

    async def compute_log_prob(
        self, fields: Mapping[str, Tensor | None], options: Mapping[str, Any], *, ref: bool
    ) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """Nested ``log_probs`` (+ ``entropy`` for the actor) and ``metrics`` with ``mfu``."""
        dense = self.dense(fields)
        started = time.perf_counter()
        outputs = await self.backend.compute_log_prob(
            dense,
            ref=ref,
            calculate_entropy=not ref,  # V1's trainer always reads entropy from the actor pass
            temperature=_temperature(options, self.backend.settings.temperature),
        )
        seconds = time.perf_counter() - started
        tokens = dense["attention_mask"].sum(dim=1).tolist()
        return outputs, {"metrics": {"mfu": self._mfu(tokens, seconds)}}

    async def update_actor(self, fields: Mapping[str, Tensor | None], options: Mapping[str, Any]) -> dict[str, Any]:
        """Mini-batches × epochs of fwd_bwd + step; returns ``{"metrics": {..., "mfu"}}``."""
        settings = self.backend.settings
        dense = self.dense(fields)
        loader = options.get("dataloader_kwargs") or {}
        started = time.perf_counter()
        result = await self.backend.update_actor(
            dense,
            mini_batch_size=int(options.get("mini_batch_size") or settings.mini_batch_size),
            epochs=int(options.get("epochs") or settings.ppo_epochs),
            temperature=_temperature(options, settings.temperature),
            shuffle=bool(loader.get("shuffle", False)),
            seed=int(options.get("seed") or 0),
        )
        seconds = time.perf_counter() - started
        metrics = dict(result["metrics"])
        metrics["mfu"] = self._mfu(result["global_token_num"], seconds)
        return {"metrics": metrics}

    async def update_weights(self) -> dict[str, Any]:
        return await self.backend.update_weights()

    async def save_checkpoint(self) -> dict[str, Any]:
        return await self.backend.save_checkpoint()

    async def destroy(self) -> None:
        await self.backend.destroy()

    def _mfu(self, tokens: list[int], seconds: float) -> float:
        """Model FLOPs utilisation; 0.0 when no estimator knows the model (e.g. a remote service)."""
        if self._flops is None or seconds <= 0:
            return 0.0
        achieved, peak = self._flops(tokens, seconds)
        return float(achieved / peak) if peak else 0.0


def read_fields(data: Any, get: Callable[[Any, str, Any], Any]) -> dict[str, Tensor | None]:
    """The tensor fields of a verl TensorDict, through verl's own accessor ``get``."""
    return {name: get(data, name, None) for name in TENSOR_FIELDS}


def read_options(data: Any, get: Callable[[Any, str, Any], Any]) -> dict[str, Any]:
    """The per-call non-tensor keys verl attaches (temperature, mini_batch_size, epochs, ...)."""
    names = ("temperature", "calculate_entropy", "mini_batch_size", "global_batch_size", "epochs", "seed")
    options = {name: get(data, name, None) for name in names}
    options["dataloader_kwargs"] = get(data, "dataloader_kwargs", None)
    return options


def flops_estimator(model_path: str | None) -> FlopsEstimator | None:
    """verl's FlopsCounter for the model at ``model_path``; None without verl or a readable model config."""
    if not model_path:
        return None
    try:
        from transformers import AutoConfig
        from verl.utils.flops_counter import FlopsCounter

        counter = FlopsCounter(AutoConfig.from_pretrained(str(model_path)))
    except Exception:  # a remote-only model name, or a verl without FlopsCounter: MFU is reported as 0
        return None

    def estimate(tokens: list[int], seconds: float) -> tuple[float, float]:
        try:
            achieved, peak = counter.estimate_flops(tokens, seconds)
        except (AssertionError, RuntimeError, KeyError):  # peak FLOP/s of a CPU-only forwarder is unknown
            return 0.0, 0.0
        return float(achieved), float(peak)

    return estimate


def _temperature(options: Mapping[str, Any], default: float) -> float:
    value = options.get("temperature")
    return float(default if value is None else value)
