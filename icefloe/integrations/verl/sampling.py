"""verl's per-request sampling params (vLLM / SGLang spelling) → icefloe ``SamplingParams``.

Knobs icefloe does not implement (``repetition_penalty``, ``min_p``, ...) are dropped with one
warning per name per process, so a run never fails on them and never silently pretends to honour
them either.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from icefloe.protocol import InvalidRequestError, SamplingParams

__all__ = ["to_sampling_params"]

logger = logging.getLogger(__name__)

# Names that either map onto SamplingParams or only steer how max_tokens is chosen.
_HANDLED = frozenset(
    {
        "max_tokens", "max_new_tokens", "response_length", "temperature", "top_p", "top_k", "logprobs",
        "stop", "stop_token_ids", "seed", "n",
    }
)  # fmt: skip
# Values that mean "off" for knobs icefloe does not implement: no warning when they are left at these.
_NEUTRAL = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
_warned: set[str] = set()
_warned_lock = threading.Lock()


def to_sampling_params(
    params: Mapping[str, Any], *, prompt_length: int, default_max_tokens: int, max_model_len: int
) -> SamplingParams:
    """Map one request's params; ``max_tokens`` is clamped to the context left after the prompt.

    Args:
        params: verl's sampling dict for one request.
        prompt_length: tokens in this request's prompt.
        default_max_tokens: used when the request names no limit (``rollout.response_length``).
        max_model_len: the model's context (prompt + response) limit.

    Raises:
        InvalidRequestError: the prompt alone fills the context.
    """
    room = max_model_len - prompt_length
    if room <= 0:
        raise InvalidRequestError(
            f"the prompt has {prompt_length} tokens and leaves no room under max_model_len={max_model_len}; "
            "raise data.max_prompt_length + data.max_response_length or shorten the prompt"
        )
    requested = next(
        (params[k] for k in ("max_tokens", "max_new_tokens", "response_length") if params.get(k) is not None),
        default_max_tokens,
    )
    if int(params.get("n", 1) or 1) != 1:
        raise InvalidRequestError(f"verl sends one request per sample; got n={params['n']!r}, expected 1")
    top_k = int(params.get("top_k", 0) or 0)
    mapped: dict[str, Any] = {
        "max_tokens": max(1, min(int(requested), room)),
        "temperature": float(params.get("temperature", 1.0)),
        "top_p": float(params.get("top_p", 1.0)),
        "top_k": 0 if top_k < 0 else top_k,
        "logprobs": params.get("logprobs"),
    }
    for name in ("stop", "stop_token_ids"):
        if params.get(name):
            value = params[name]
            mapped[name] = (value,) if isinstance(value, str | int) else tuple(value)
    if params.get("seed") is not None:
        mapped["seed"] = int(params["seed"])
    _warn_dropped(params)
    return SamplingParams.model_validate(mapped)


def _warn_dropped(params: Mapping[str, Any]) -> None:
    dropped = sorted(
        name
        for name, value in params.items()
        if name not in _HANDLED and value is not None and _NEUTRAL.get(name, object()) != value
    )
    with _warned_lock:
        fresh = [name for name in dropped if name not in _warned]
        _warned.update(fresh)
    if fresh:
        logger.warning("icefloe sampling ignores these verl sampling params (not supported): %s", ", ".join(fresh))
