"""Every client op defined once: a builder returning ``Request`` and a parser to the canonical result.

``Client`` and ``AsyncClient`` are thin over these: ``parse(transport.handle(request))``. The
parsers are additive normalisers, so they accept both an engine's canonical result and the
training API's spelling (``avg_loss``, ``last_lr``, ``global_steps``) and never drop a key.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from icefloe.client.batch import to_canonical
from icefloe.config import validation_problems
from icefloe.protocol import (
    OP_CANCEL,
    OP_DELETE_CHECKPOINT,
    OP_FORWARD,
    OP_FWD_BWD,
    OP_GENERATE,
    OP_GET_CHECKPOINT,
    OP_LIST_CHECKPOINTS,
    OP_LOAD,
    OP_RESET_PREFIX_CACHE,
    OP_SAVE,
    OP_SLEEP_INFERENCE,
    OP_SLEEP_TRAINING,
    OP_STEP,
    OP_WAKE_INFERENCE,
    OP_WAKE_TRAINING,
    OP_WEIGHT_SYNC,
    TARGET_JOB,
    TARGET_REFERENCE,
    TARGET_SAMPLING,
    TARGET_TRAINING,
    InvalidRequestError,
    Request,
    SamplingParams,
)

__all__ = [
    "CHECKPOINT_KINDS",
    "OpCall",
    "cancel",
    "delete_checkpoint",
    "forward",
    "fwd_bwd",
    "generate",
    "get_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "merge_generates",
    "normalize_fwd_bwd",
    "normalize_step",
    "reset_prefix_cache",
    "save_checkpoint",
    "sleep_inference",
    "sleep_training",
    "step",
    "sync_weights",
    "wake_inference",
    "wake_training",
]

CHECKPOINT_KINDS = ("resumable", "weights-only")


@dataclass(frozen=True, slots=True)
class OpCall:
    """A built request and the parser that turns the transport's answer into the canonical result."""

    request: Request
    parse: Callable[[Any], Any]


def _empty(result: Any) -> dict[str, Any]:
    return dict(result) if isinstance(result, Mapping) else {}


# --- training ----------------------------------------------------------------------------------
def fwd_bwd(batch: Mapping[str, Any], processing: Mapping[str, Any] | None = None) -> OpCall:
    """Forward + backward on the training role; gradients accumulate until ``step``."""
    frame = to_canonical(batch, processing)
    return OpCall(Request(OP_FWD_BWD, TARGET_TRAINING, {"batch": frame}), normalize_fwd_bwd)


def forward(batch: Mapping[str, Any], *, reference: bool = False) -> OpCall:
    """Shifted log-probs and entropy ``[B, S]`` without gradients, from the policy or the reference."""
    frame = to_canonical(batch)
    target = TARGET_REFERENCE if reference else TARGET_TRAINING
    return OpCall(Request(OP_FORWARD, target, {"batch": frame}), _parse_forward)


def step(learning_rate: float | None = None) -> OpCall:
    """Apply the optimizer to the accumulated gradients."""
    if learning_rate is not None and not 0 < learning_rate < math.inf:
        raise InvalidRequestError(
            f"learning_rate must be > 0 and finite, or None for the scheduled rate; got {learning_rate!r}"
        )
    body = {} if learning_rate is None else {"learning_rate": float(learning_rate)}
    return OpCall(Request(OP_STEP, TARGET_TRAINING, body), normalize_step)


def normalize_fwd_bwd(result: Mapping[str, Any]) -> dict[str, Any]:
    """``{loss, avg_loss, metrics, num_tokens}``; flat scalars are mirrored into ``metrics``."""
    out = dict(result)
    loss = out.get("loss", out.get("avg_loss", (out.get("metrics") or {}).get("loss")))
    metrics = _mirror_scalars(out, exclude={"metrics", "job_id", "post_process_outputs", "num_tokens"})
    if loss is not None:
        out["loss"] = out["avg_loss"] = float(loss)
        metrics.setdefault("loss", float(loss))
    out["metrics"] = metrics
    out.setdefault("num_tokens", int(metrics.get("num_tokens", 0)))
    return _only(out, "loss", "avg_loss", "metrics", "num_tokens")


def normalize_step(result: Mapping[str, Any]) -> dict[str, Any]:
    """``{global_step, lr, grad_norm, metrics}``; ``global_steps`` / ``last_lr`` are accepted."""
    out = dict(result)
    if "global_step" not in out and "global_steps" in out:
        out["global_step"] = out["global_steps"]
    if "lr" not in out and "last_lr" in out:
        out["lr"] = _first(out["last_lr"])
    if "grad_norm" in out:
        out["grad_norm"] = _first(out["grad_norm"])
    metrics = _mirror_scalars(out, exclude={"metrics", "job_id", "batch", "peak_memory"})
    for key, names in (("lr", ("lr", "last_lr")), ("grad_norm", ("grad_norm",))):
        found = next((metrics[name] for name in names if name in metrics), None)
        if out.get(key) is None and found is not None:
            out[key] = _first(found)
    out["metrics"] = metrics
    out.setdefault("grad_norm", None)
    return _only(out, "global_step", "lr", "grad_norm", "metrics", "peak_memory")


def _only(result: dict[str, Any], *keys: str) -> dict[str, Any]:
    """The canonical keys of a result (README's table), on every backend: a service's own (``job_id``,
    ``weight_format``, ...) stay on the wire."""
    return {key: result[key] for key in keys if key in result}


def _parse_sync(result: Mapping[str, Any]) -> dict[str, Any]:
    return _only(dict(result), "policy_version", "seconds", "bytes")


def _parse_saved(result: Mapping[str, Any]) -> dict[str, Any]:
    return _only(_parse_checkpoint(result), "checkpoint_id", "global_step", "path", "kind")


def _parse_forward(result: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(result)
    if "logprobs" not in out:
        nested = out.get("batch") or {}
        if "logprobs" in nested or "log_probs" in nested:
            out["logprobs"] = nested.get("logprobs", nested.get("log_probs"))
            out["entropy"] = nested.get("entropy")
        elif "log_probs" in out:
            out["logprobs"] = out["log_probs"]
    if "logprobs" not in out:
        raise InvalidRequestError(f"forward returned no logprobs; got keys {sorted(out)}")
    return out


# --- sampling ----------------------------------------------------------------------------------
def generate(
    prompts: Sequence[Sequence[int] | str],
    sampling_params: SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None = None,
) -> OpCall:
    """Sample completions; results are prompt-major (``n`` samples of prompt 0 first)."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise InvalidRequestError("prompts must be a list of token-id lists or strings; wrap a single prompt in a list")
    if not prompts:
        raise InvalidRequestError("prompts is empty; pass at least one prompt")
    prompt_list: list[list[int] | str] = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt_list.append(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_list.append([int(t) for t in prompt])
        else:
            raise InvalidRequestError(
                f"prompts[{index}] must be a non-empty list of int token ids or a string; got {type(prompt).__name__}"
            )
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str | bytes):
        if len(sampling_params) != len(prompt_list):
            raise InvalidRequestError(
                f"sampling_params has {len(sampling_params)} entries for {len(prompt_list)} prompts; pass one "
                "per prompt or a single set for all"
            )
        params: SamplingParams | list[SamplingParams] = [_params(p) for p in sampling_params]
    else:
        params = _params(sampling_params)
    return OpCall(
        Request(OP_GENERATE, TARGET_SAMPLING, {"prompts": prompt_list, "sampling_params": params}), _parse_generate
    )


def merge_generates(calls: Sequence[OpCall]) -> tuple[OpCall, list[int]]:
    """One generate call holding the prompts of ``calls`` (each keeps its own sampling params per prompt).

    Returns the merged call and how many samples of its prompt-major result belong to each call.
    """
    prompts: list[Any] = []
    params: list[SamplingParams] = []
    counts: list[int] = []
    for call in calls:
        body = call.request.body
        own = body["sampling_params"]
        own = list(own) if isinstance(own, list) else [own] * len(body["prompts"])
        prompts += body["prompts"]
        params += own
        counts.append(sum(p.n for p in own))
    merged = Request(OP_GENERATE, TARGET_SAMPLING, {"prompts": prompts, "sampling_params": params})
    return OpCall(merged, _parse_generate), counts


def _params(value: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    try:
        return SamplingParams.model_validate(dict(value))
    except ValidationError as exc:
        raise InvalidRequestError("; ".join(validation_problems(exc, prefix="sampling_params."))) from None


def _parse_generate(result: Any) -> list[dict[str, Any]]:
    samples = result.get("results", result) if isinstance(result, Mapping) else result
    return [dict(sample) for sample in samples]


def sync_weights(*, cuda_ipc: bool = False, low_memory: bool = False, weight_format: str | None = None) -> OpCall:
    """Copy the trainer's weights into the sampler and bump ``policy_version``."""
    body: dict[str, Any] = {"cuda_ipc": cuda_ipc, "low_memory": low_memory}
    if weight_format is not None:
        body["weight_format"] = weight_format
    return OpCall(Request(OP_WEIGHT_SYNC, TARGET_TRAINING, body), _parse_sync)


# --- checkpoints -------------------------------------------------------------------------------
def save_checkpoint(kind: str = "resumable") -> OpCall:
    """Save the training state; ``weights-only`` doubles as a Hugging Face export."""
    kind = str(kind).lower()
    if kind not in CHECKPOINT_KINDS:
        raise InvalidRequestError(f"kind must be one of {list(CHECKPOINT_KINDS)}; got {kind!r}")
    return OpCall(Request(OP_SAVE, TARGET_TRAINING, {"checkpoint_type": kind}), _parse_saved)


def load_checkpoint(checkpoint_id: str, *, source_job_id: str | None = None) -> OpCall:
    """Load a saved checkpoint into the running training role."""
    body: dict[str, Any] = {"checkpoint_id": _checkpoint_id(checkpoint_id)}
    if source_job_id:
        body["source_job_id"] = source_job_id
    return OpCall(Request(OP_LOAD, TARGET_TRAINING, body), _parse_saved)


def list_checkpoints() -> OpCall:
    """Metadata of every checkpoint the job saved."""
    return OpCall(Request(OP_LIST_CHECKPOINTS, TARGET_JOB), _parse_checkpoint_list)


def get_checkpoint(checkpoint_id: str) -> OpCall:
    """One checkpoint's metadata and its files (paths or download URLs)."""
    return OpCall(
        Request(OP_GET_CHECKPOINT, TARGET_JOB, {"checkpoint_id": _checkpoint_id(checkpoint_id)}), _parse_checkpoint
    )


def delete_checkpoint(checkpoint_id: str) -> OpCall:
    """Delete a checkpoint; a missing one is an error, not a success."""
    return OpCall(Request(OP_DELETE_CHECKPOINT, TARGET_JOB, {"checkpoint_id": _checkpoint_id(checkpoint_id)}), _empty)


def _checkpoint_id(checkpoint_id: str) -> str:
    if not checkpoint_id:
        raise InvalidRequestError("checkpoint_id is required, e.g. 'global_step12' from save_checkpoint()")
    return checkpoint_id


def _parse_checkpoint(result: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(result)
    if "global_step" not in out and "global_steps" in out:
        out["global_step"] = out["global_steps"]
    if "path" not in out and "checkpoint_path" in out:
        out["path"] = out["checkpoint_path"]
    if "kind" not in out and "checkpoint_type" in out:
        out["kind"] = out["checkpoint_type"]
    if isinstance(out.get("created_at"), int | float):  # a folder's mtime (local, ray) → the API's ISO-8601 text
        out["created_at"] = datetime.fromtimestamp(out["created_at"], UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return out


def _parse_checkpoint_list(result: Any) -> list[dict[str, Any]]:
    entries = result.get("checkpoints", []) if isinstance(result, Mapping) else result
    return [_parse_checkpoint(entry) for entry in entries]


# --- memory control ----------------------------------------------------------------------------
def sleep_training() -> OpCall:
    """Move training weights and optimizer state off the device."""
    return OpCall(Request(OP_SLEEP_TRAINING, TARGET_TRAINING), _empty)


def wake_training() -> OpCall:
    """Bring training weights and optimizer state back on the device."""
    return OpCall(Request(OP_WAKE_TRAINING, TARGET_TRAINING), _empty)


def sleep_inference(level: int = 1) -> OpCall:
    """Free the sampler's memory (level 1: KV cache; level 2: weights too)."""
    return OpCall(Request(OP_SLEEP_INFERENCE, TARGET_SAMPLING, {"level": int(level)}), _empty)


def wake_inference(tags: Sequence[str] | None = None) -> OpCall:
    """Restore what ``sleep_inference`` freed (``tags``: "weights", "kv_cache"; None = both)."""
    return OpCall(Request(OP_WAKE_INFERENCE, TARGET_SAMPLING, {"tags": list(tags) if tags else None}), _empty)


def reset_prefix_cache() -> OpCall:
    """Drop cached prefixes so no sample reuses state computed with old weights."""
    # The training API's payload defaults: wait for in-flight generates, then reset.
    body = {"drain": True, "timeout_s": 60.0, "retry_interval_s": 0.1}
    return OpCall(Request(OP_RESET_PREFIX_CACHE, TARGET_SAMPLING, body), lambda result: {})


def cancel() -> OpCall:
    """Cancel the job and release its resources."""
    return OpCall(Request(OP_CANCEL, TARGET_JOB), _empty)


# --- helpers -----------------------------------------------------------------------------------
def _first(value: Any) -> Any:
    """Per-rank lists (on-prem step results) collapse to their first element."""
    if isinstance(value, list | tuple):
        return value[0] if value else None
    return value


def _mirror_scalars(result: Mapping[str, Any], *, exclude: set[str]) -> dict[str, Any]:
    metrics = dict(result.get("metrics") or {})
    for key, value in result.items():
        if key in exclude or key in metrics:
            continue
        if isinstance(value, bool | int | float) and not isinstance(value, bool):
            metrics[key] = value
        elif isinstance(value, list | tuple) and value and isinstance(value[0], int | float):
            metrics[key] = _first(value)
    return metrics
