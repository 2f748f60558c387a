"""The canonical training batch: validation and shifted log-probs.

See ``docs/architecture.md`` for the frame. Validation runs on the CPU tensors as they arrive, so
its checks never wait on an accelerator. Tensors: B rows, S positions, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from icefloe.engines.losses import loss_requirements
from icefloe.protocol import InvalidRequestError

__all__ = [
    "CONTEXT_ALIASES",
    "IGNORE_INDEX",
    "Frame",
    "as_frame",
    "batch_rows",
    "check_vocabulary",
    "shifted_token_logprobs",
    "validate_batch",
]

# Training-API spellings accepted for context tensors, mapped to the canonical names.
CONTEXT_ALIASES = {"old_log_probs_shifted": "old_logprobs", "ref_log_probs_shifted": "ref_logprobs"}
_FLOAT_CONTEXT = ("advantages", "loss_mask", "old_logprobs", "ref_logprobs", "rollout_is_weights")
IGNORE_INDEX = -100  # a label that trains nothing
# Logit values per chunk of shifted_token_logprobs: 128 MiB of float32 per temporary.
_CHUNK_VALUES = 1 << 25


class Frame(dict):
    """A batch :func:`validate_batch` checked and normalised: engines take it as it is (see
    :func:`as_frame`), so a batch is validated once, where it enters, and its errors reach the caller
    before any work. ``training``: checked for a fwd_bwd (its context holds what its loss needs), not
    only for a forward. Treat it as read-only: what it holds is not checked again."""

    def __init__(self, batch: Mapping[str, Any], *, training: bool) -> None:
        super().__init__(batch)
        self.training = training


def as_frame(batch: Mapping[str, Any], *, require_context: bool = True, vocab_size: int | None = None) -> Frame:
    """The batch as a :class:`Frame`: one already validated for as much is taken as it is, checked only
    against ``vocab_size`` (which the service's routes cannot know); anything else goes through
    :func:`validate_batch`."""
    if isinstance(batch, Frame) and (batch.training or not require_context):
        if vocab_size is not None:
            check_vocabulary(batch, vocab_size)
        return batch
    return validate_batch(batch, require_context=require_context, vocab_size=vocab_size)


def check_vocabulary(frame: Frame, vocab_size: int) -> None:
    """Refuse a validated batch whose token ids (and explicit targets) are not in ``[0, vocab_size)``."""
    _check_token_ids(frame["kwargs"]["input_ids"], vocab_size)
    if "target_tokens" in frame["context"]:
        _check_targets(frame["context"]["target_tokens"], vocab_size)


def validate_batch(batch: Mapping[str, Any], *, require_context: bool = True, vocab_size: int | None = None) -> Frame:
    """Check a canonical batch and return it normalised, as a :class:`Frame`.

    Normalised means: context aliases renamed, ids and ``attention_mask`` int64, context floats
    float32, ``position_ids`` filled with ``arange(S)`` when absent, ``processing`` defaulted to
    ``{"loss_fn": "grpo", "config": {}}``. ``require_context=False`` accepts a forward-only batch.

    The training API's SFT frame, ``kwargs.labels`` (pre-shifted: ``labels[:, i]`` is
    ``input_ids[:, i+1]``, or ``-100`` to ignore) without ``context.advantages``, gets
    ``context.loss_mask`` = 1 where a label is set, and its loss defaults to ``cross_entropy``.

    Raises:
        InvalidRequestError: naming the offending field (e.g. ``context.loss_mask``) and the fix.
    """
    if not isinstance(batch, Mapping):
        raise InvalidRequestError(f"batch must be a dict with kwargs/context/processing; got {type(batch).__name__}")
    kwargs = batch.get("kwargs")
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(
            "batch.kwargs is missing; pass {'kwargs': {'input_ids', 'attention_mask', 'position_ids'}, ...} "
            "(icefloe.client.batch.build_batch builds it)"
        )
    input_ids_BS = _tensor(kwargs, "input_ids", "kwargs", integer=True)
    if input_ids_BS.dim() != 2 or input_ids_BS.shape[0] == 0 or input_ids_BS.shape[1] == 0:
        raise InvalidRequestError(
            f"kwargs.input_ids must be a non-empty [B, S] tensor; got shape {list(input_ids_BS.shape)}"
        )
    shape = tuple(input_ids_BS.shape)
    _check_token_ids(input_ids_BS, vocab_size)

    normal_kwargs = {"input_ids": input_ids_BS}
    attention_BS = kwargs.get("attention_mask")
    if attention_BS is None:
        attention_BS = torch.ones(shape, dtype=torch.int64)
    else:
        attention_BS = _tensor(kwargs, "attention_mask", "kwargs", integer=True, shape=shape)
        _binary(attention_BS, "kwargs.attention_mask")
    normal_kwargs["attention_mask"] = attention_BS
    position_BS = kwargs.get("position_ids")
    if position_BS is None:
        position_BS = torch.arange(shape[1], dtype=torch.int64).expand(shape)
    else:
        position_BS = _tensor(kwargs, "position_ids", "kwargs", integer=True, shape=shape)
    normal_kwargs["position_ids"] = position_BS

    raw_context = batch.get("context")
    labels_mask_BS = None
    if kwargs.get("labels") is not None:
        labels_BS = _tensor(kwargs, "labels", "kwargs", integer=True, shape=shape)
        labels_mask_BS = _labels_mask(labels_BS, input_ids_BS)
    sft = labels_mask_BS is not None and "advantages" not in (raw_context if isinstance(raw_context, Mapping) else {})
    processing = _processing(batch.get("processing"), default_loss="cross_entropy" if sft else "grpo")
    context = _context(raw_context, shape, input_ids_BS, processing["loss_fn"], require_context, labels_mask_BS)
    if "target_tokens" in context:  # explicit targets (the Tinker API's): column i scores target_tokens[:, i]
        context["target_tokens"] = _tensor(context, "target_tokens", "context", integer=True, shape=shape)
        _check_targets(context["target_tokens"], vocab_size)
    frame = {"args": (), "kwargs": normal_kwargs, "context": context, "processing": processing}
    return Frame(frame, training=require_context)


def _check_token_ids(input_ids_BS: Tensor, vocab_size: int | None) -> None:
    if input_ids_BS.min() < 0 or (vocab_size is not None and input_ids_BS.max() >= vocab_size):
        bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
        raise InvalidRequestError(f"kwargs.input_ids must hold token ids in {bound}; replace padding with pad_id")


def _processing(processing: Any, *, default_loss: str) -> dict[str, Any]:
    if processing is None:
        return {"loss_fn": default_loss, "config": {}}
    if not isinstance(processing, Mapping):
        raise InvalidRequestError(
            f"batch.processing must be a dict {{loss_fn, config}}; got {type(processing).__name__}"
        )
    config = processing.get("config") or {}
    if not isinstance(config, Mapping):
        raise InvalidRequestError(f"processing.config must be a dict; got {type(config).__name__}")
    return {**processing, "loss_fn": processing.get("loss_fn") or default_loss, "config": dict(config)}


def _labels_mask(labels_BS: Tensor, input_ids_BS: Tensor) -> Tensor:
    """1.0 where ``kwargs.labels`` sets a target; each target must be the next input token."""
    scored_BS = labels_BS != IGNORE_INDEX
    if scored_BS[:, -1].any():
        raise InvalidRequestError(
            "kwargs.labels[:, -1] must be -100: labels are pre-shifted (labels[:, i] = input_ids[:, i+1]), so the "
            "last column has no target; shift Hugging Face style labels left by one"
        )
    wrong_BS = scored_BS[:, :-1] & (labels_BS[:, :-1] != input_ids_BS[:, 1:])
    if wrong_BS.any():
        row, col = wrong_BS.nonzero()[0].tolist()
        raise InvalidRequestError(
            f"kwargs.labels[{row}, {col}] is {int(labels_BS[row, col])} but input_ids[{row}, {col + 1}] is "
            f"{int(input_ids_BS[row, col + 1])}; labels must be pre-shifted (labels[:, i] = input_ids[:, i+1]) "
            "or -100 where nothing is trained"
        )
    return scored_BS.to(torch.float32)


def _context(
    raw: Any, shape: tuple[int, ...], input_ids_BS: Tensor, loss_fn: str, required: bool, labels_mask_BS: Tensor | None
) -> dict[str, Tensor]:
    if raw is None and (labels_mask_BS is not None or not required):
        raw = {}
    if not isinstance(raw, Mapping):
        raise InvalidRequestError(
            "batch.context is missing; a training batch needs context.loss_mask (and context.advantages for "
            "policy-gradient losses), each float32 [B, S], or pre-shifted kwargs.labels for cross-entropy"
        )
    context: dict[str, Tensor] = {}
    for key, value in raw.items():
        name = CONTEXT_ALIASES.get(key, key)
        if name in context and value is not None:
            raise InvalidRequestError(f"context.{name} is given twice (also as {key!r}); keep one of the two names")
        if name in _FLOAT_CONTEXT or name in ("input_ids", "target_tokens"):
            if value is not None:
                context[name] = value
        elif isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == shape[0]:
            context[name] = value  # per-row extras reach custom losses and split with the rows
        # Anything else (cu_seqlens, version lists) describes the whole batch and no loss reads it.
    if "input_ids" in context:
        ids_BS = _tensor(context, "input_ids", "context", integer=True, shape=shape)
        if not torch.equal(ids_BS, input_ids_BS):
            raise InvalidRequestError("context.input_ids must equal kwargs.input_ids; pass the same tensor to both")
        context["input_ids"] = ids_BS
    if labels_mask_BS is not None:
        context.setdefault("loss_mask", labels_mask_BS)
    if not required:
        return context
    needed = ("loss_mask", *loss_requirements(loss_fn))
    missing = [name for name in needed if name not in context]
    if missing:
        listed = ", ".join(f"context.{name}" for name in missing)
        raise InvalidRequestError(f"{listed} missing for loss {loss_fn!r}; add float32 [B, S] tensors")
    for name in _FLOAT_CONTEXT:
        if name in context:
            context[name] = _tensor(context, name, "context", integer=False, shape=shape)
    loss_mask_BS = context["loss_mask"]
    if labels_mask_BS is not None and not torch.equal(loss_mask_BS, labels_mask_BS):
        raise InvalidRequestError(
            "context.loss_mask disagrees with kwargs.labels (1 exactly where a label is not -100); send one of the two"
        )
    _binary(loss_mask_BS, "context.loss_mask")
    if "target_tokens" not in context and loss_mask_BS[:, -1].any():  # explicit targets score the last one too
        raise InvalidRequestError(
            "context.loss_mask[:, -1] must be 0: labels are pre-shifted (column i scores token i+1), so the "
            "last column has no target; shift the mask left by one"
        )
    return context


def _tensor(
    where: Mapping[str, Any], name: str, section: str, *, integer: bool, shape: tuple[int, ...] | None = None
) -> Tensor:
    value = where.get(name)
    field = f"{section}.{name}"
    if value is None:
        raise InvalidRequestError(f"{field} is missing; add a [B, S] tensor")
    if not isinstance(value, Tensor):
        raise InvalidRequestError(f"{field} must be a torch.Tensor; got {type(value).__name__} (use torch.tensor)")
    if shape is not None and tuple(value.shape) != shape:
        raise InvalidRequestError(
            f"{field} has shape {list(value.shape)}; every batch tensor must be [B, S] = {list(shape)} "
            "like kwargs.input_ids"
        )
    if integer:
        if value.is_floating_point() or value.is_complex():
            raise InvalidRequestError(f"{field} must be an integer tensor (int64); got {value.dtype}")
        return value.to(torch.int64)
    if value.is_complex():
        raise InvalidRequestError(f"{field} must be a float32 tensor; got {value.dtype}")
    return value.to(torch.float32)


def _check_targets(targets_BS: Tensor, vocab_size: int | None) -> None:
    """``context.target_tokens`` must hold ids in ``[0, vocab_size)``: gather would fail on any other."""
    low, high = int(targets_BS.min()), int(targets_BS.max())
    limit = vocab_size if vocab_size is not None else high + 1
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
        raise InvalidRequestError(
            f"context.target_tokens holds {bad}, not a token id in {bound}; put any token id where nothing is "
            "scored and set loss_mask (or weights) to 0 there, instead of -100"
        )


def _binary(mask_BS: Tensor, field: str) -> None:
    if not ((mask_BS == 0) | (mask_BS == 1)).all():
        raise InvalidRequestError(f"{field} must hold only 0 and 1; got values {torch.unique(mask_BS)[:8].tolist()}")


def batch_rows(batch: Mapping[str, Any]) -> int:
    """Number of rows B of a validated batch."""
    return int(batch["kwargs"]["input_ids"].shape[0])


def shifted_token_logprobs(
    logits_BSV: Tensor,
    input_ids_BS: Tensor,
    temperature: float = 1.0,
    *,
    entropy_requires_grad: bool = True,
    targets_BS: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Log-prob of each next token and the entropy of each next-token distribution, float32 [B, S].

    Column ``i`` scores ``input_ids[:, i+1]`` under ``logits[:, i] / temperature``; the last column
    has no target and is 0 in both outputs. With ``targets_BS`` (explicit targets, the Tinker API's
    ``target_tokens``) column ``i`` scores ``targets_BS[:, i]`` instead, the last column included.
    ``entropy_requires_grad=False`` computes the entropy without building its backward graph.

    Columns go in chunks of about ``_CHUNK_VALUES`` logits, so the float32 copy, log-softmax and
    its exp exist for one chunk at a time; under autograd each chunk is recomputed in backward
    instead of kept, so a pass holds nothing ``[S, V]``-sized beyond the logits and their gradient.
    """
    if targets_BS is None:
        targets_BS, pad = input_ids_BS[:, 1:], 1
    else:
        pad = 0
    rows, width, vocab = logits_BSV.shape
    scored = width - pad
    step = max(1, _CHUNK_VALUES // max(rows * vocab, 1))
    recompute = torch.is_grad_enabled() and logits_BSV.requires_grad
    parts = []
    # split(), not one slice per chunk: its backward joins the chunks' gradients once.
    chunks = zip(logits_BSV[:, :scored].split(step, dim=1), targets_BS.split(step, dim=1), strict=True)
    for logits_BCV, targets_BC in chunks:
        args = (logits_BCV, targets_BC, temperature, entropy_requires_grad)
        if recompute:
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            parts.append(_chunk_logprobs(*args))
    logprobs_BS = torch.cat([p[0] for p in parts], dim=1)
    entropy_BS = torch.cat([p[1] for p in parts], dim=1)
    return F.pad(logprobs_BS, (0, pad)), F.pad(entropy_BS, (0, pad))


def _chunk_logprobs(
    logits_BCV: Tensor, targets_BC: Tensor, temperature: float, entropy_requires_grad: bool
) -> tuple[Tensor, Tensor]:
    logits_BCV = logits_BCV.float()
    if temperature != 1.0:
        logits_BCV = logits_BCV / temperature
    logp_BCV = F.log_softmax(logits_BCV, dim=-1)
    logprobs_BC = logp_BCV.gather(-1, targets_BC[..., None]).squeeze(-1)
    with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
        entropy_BC = -(logp_BCV.exp() * logp_BCV).sum(-1)
    return logprobs_BC, entropy_BC
