"""Micro-batches by token budget: which rows of a batch run together, cut to what width.

A row's span is the columns it needs computed: from its first attended or scored column to its
last, plus the token a shifted column scores. :func:`plan_micro_batches` sorts rows by span
length and groups neighbours so that a pass computes at most ``budget`` positions (rows × width)
and pads at most ``_SLACK`` of its real tokens. :func:`cut_micro_batch` cuts each row of a pass
to its span, right-padded to the pass's width. Under causal attention right padding changes
nothing a real position sees, so a pass whose spans have no gap runs without an attention mask:
SDPA's causal kernel, no ``[S, S]`` mask. Packing several sequences into one row would pad less,
but outside flash-attention it needs exactly such a block-diagonal mask.

A plan names rows of the caller's batch, so per-row metadata rides along, and
:func:`place_rows` puts a pass's per-token outputs back in the caller's rows and columns.
Tensors: B rows and S positions of the batch, b rows and W positions of a pass.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from icefloe.protocol import InvalidRequestError

__all__ = [
    "MicroBatch",
    "Spans",
    "check_rows_fit",
    "cut_micro_batch",
    "default_token_budget",
    "place_rows",
    "plan_micro_batches",
    "row_spans",
    "sampling_bytes_per_token",
    "training_bytes_per_token",
]

# A pass pads at most this share of its real tokens: the plan's positions stay within 5% of them.
_SLACK = 0.05
# Share of free memory a step's activations may take. A CUDA pass holds at most 16384 tokens
# (verl's ppo_max_token_len_per_gpu default); a CPU pass at most _CPU_PASS_BYTES of activations:
# there throughput is flat once a pass's matmuls have a few hundred rows while memory grows with
# every token (16 runs' gathered fwd_bwd on tiny:bench, ~160 KB per token: 1,024 tokens per pass
# as fast as 2,048, and ~300 MB less held).
_MEMORY_SHARE = {"cuda": 0.5, "cpu": 0.25}
_CUDA_PASS_TOKENS = 16384
_CPU_PASS_BYTES = 160 * 2**20


@dataclass(frozen=True, slots=True)
class Spans:
    """Each row's span: its first column ``start_B`` and its ``length_B`` columns (int64 ``[B]``)."""

    start_B: Tensor
    length_B: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.length_B.sum())


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward pass: ``rows`` of the caller's batch, each cut to its span and padded to ``width``.

    ``rows`` is empty for an idle pass (a data-parallel rank with no work left runs one so that
    sharded ranks run the same number of passes).
    """

    rows: tuple[int, ...]
    width: int

    @property
    def num_positions(self) -> int:
        return len(self.rows) * self.width


def row_spans(frame: Mapping[str, Any], *, whole: bool = False) -> Spans:
    """The span of every row of a validated batch; ``whole=True``: every row spans all S columns.

    A row with nothing attended or scored gets the span ``[0, 1)``, so every row is computed once.
    """
    attention_BS = frame["kwargs"]["attention_mask"] != 0
    rows, width = attention_BS.shape
    if whole:
        return Spans(torch.zeros(rows, dtype=torch.int64), torch.full((rows,), width, dtype=torch.int64))
    needed_BS = attention_BS.clone()
    context = frame.get("context") or {}
    if context.get("loss_mask") is not None:
        scored_BS = context["loss_mask"] != 0
        needed_BS |= scored_BS
        if "target_tokens" not in context:  # column i scores token i+1, which the pass must hold
            needed_BS[:, 1:] |= scored_BS[:, :-1]
    columns_S = torch.arange(width)
    first_B = torch.where(needed_BS, columns_S, width).min(dim=1).values
    last_B = torch.where(needed_BS, columns_S, -1).max(dim=1).values
    empty_B = last_B < 0
    start_B = torch.where(empty_B, 0, first_B)
    return Spans(start_B, torch.where(empty_B, 1, last_B + 1 - start_B))


def check_rows_fit(spans: Spans, budget: int, field: str) -> None:
    """Refuse, before any work, a batch with a row longer than ``budget`` positions; lists every such row."""
    too_long = (spans.length_B > budget).nonzero().flatten().tolist()
    if not too_long:
        return
    named = ", ".join(f"row {row} has {int(spans.length_B[row])}" for row in too_long[:8])
    more = f" and {len(too_long) - 8} more" if len(too_long) > 8 else ""
    raise InvalidRequestError(
        f"{named}{more} tokens, more than the micro-batch budget of {budget} tokens per pass ({field}); "
        f"raise {field} to at least {int(spans.length_B.max())} or shorten those rows"
    )


def plan_micro_batches(spans: Spans, budget: int) -> list[MicroBatch]:
    """Group rows into passes of at most ``budget`` positions; ``budget=0``: one pass of every row, in order.

    Rows go longest first; a row joins the current pass while the pass stays within the budget
    and pads at most ``_SLACK`` of its real tokens, otherwise it opens the next pass. A row longer
    than the budget gets a pass of its own (:func:`check_rows_fit` refuses such batches first).
    """
    lengths = spans.length_B.tolist()
    if budget <= 0:
        return [MicroBatch(tuple(range(len(lengths))), max(lengths))]
    order = sorted(range(len(lengths)), key=lambda row: -lengths[row])
    groups: list[list[int]] = []
    widths: list[int] = []
    real = 0
    for row in order:
        if groups:
            positions = (len(groups[-1]) + 1) * widths[-1]
            if positions <= budget and positions <= (1.0 + _SLACK) * (real + lengths[row]):
                groups[-1].append(row)
                real += lengths[row]
                continue
        groups.append([row])
        widths.append(lengths[row])
        real = lengths[row]
    return [MicroBatch(tuple(group), width) for group, width in zip(groups, widths, strict=True)]


def cut_micro_batch(frame: Mapping[str, Any], micro: MicroBatch, spans: Spans) -> dict[str, Any]:
    """The pass's ``{kwargs, context}``: its rows cut to their spans and right-padded to ``micro.width``.

    Padding holds zeros in float context tensors (nothing is trained there) and elsewhere what the
    batch holds in the columns after the span (valid ids); position ids keep counting up through
    it. ``kwargs.attention_mask`` is left out when every span is fully attended with consecutive
    positions (causal attention then needs no mask); otherwise it is kept, with zeros on the
    padding. Context tensors without a column axis (per-row extras) are taken by row.
    """
    rows_b = torch.tensor(micro.rows, dtype=torch.int64)
    start_b, length_b = spans.start_B[rows_b], spans.length_B[rows_b]
    width = frame["kwargs"]["input_ids"].shape[1]
    offsets_W = torch.arange(micro.width)
    valid_bW = offsets_W < length_b[:, None]
    columns_bW = (start_b[:, None] + offsets_W).clamp(max=width - 1)

    def take(tensor: Tensor) -> Tensor:
        if tensor.dim() < 2 or tensor.shape[1] != width:
            return tensor[rows_b]
        cut = tensor[rows_b[:, None], columns_bW]
        if cut.is_floating_point():
            cut = cut * valid_bW.reshape(*valid_bW.shape, *[1] * (cut.dim() - 2))
        return cut

    kwargs = frame["kwargs"]
    attention_bW = take(kwargs["attention_mask"]) * valid_bW
    positions_bW = take(kwargs["position_ids"])
    last_b = positions_bW.gather(1, (length_b - 1)[:, None])
    positions_bW = torch.where(valid_bW, positions_bW, last_b + offsets_W - length_b[:, None] + 1)
    steps_ok = (positions_bW.diff(dim=1) == 1) | ~valid_bW[:, 1:]
    cut_kwargs = {"input_ids": take(kwargs["input_ids"]), "position_ids": positions_bW}
    if not (bool((attention_bW != 0).eq(valid_bW).all()) and bool(steps_ok.all())):
        cut_kwargs["attention_mask"] = attention_bW
    context = {name: take(tensor) for name, tensor in (frame.get("context") or {}).items()}
    return {"kwargs": cut_kwargs, "context": context}


def place_rows(out_BS: Tensor, values_bW: Tensor, micro: MicroBatch, spans: Spans, *, shifted: bool) -> None:
    """Write a pass's per-token ``values_bW`` into ``out_BS`` at the rows' own rows and columns.

    ``shifted``: column i scored token i+1, so a span's last column scored a token outside the
    span and is left out (it stays as ``out_BS`` holds it, zero for a fresh tensor).
    """
    rows_b = torch.tensor(micro.rows, dtype=torch.int64)
    start_b, length_b = spans.start_B[rows_b], spans.length_B[rows_b]
    offsets_W = torch.arange(micro.width)
    valid_bW = offsets_W < (length_b - int(shifted))[:, None]
    columns_bW = start_b[:, None] + offsets_W
    out_BS[rows_b[:, None].expand_as(columns_bW)[valid_bW], columns_bW[valid_bW]] = values_bW.to(out_BS)[valid_bW]


# --- the default budget --------------------------------------------------------------------------
def training_bytes_per_token(model_config: Any, *, dtype_bytes: int, checkpointed: bool) -> int:
    """Estimated activation bytes a training pass keeps per token for ``model_config`` (a HF config).

    Per decoder layer about 16 hidden-size and 4 MLP-size values per token are saved for backward
    (only the layer's input under activation checkpointing, plus one layer being recomputed);
    the float32 logits, their log-softmax and their gradient add 3 vocabulary-size values.
    """
    hidden = int(getattr(model_config, "hidden_size", 4096))
    mlp = int(getattr(model_config, "intermediate_size", None) or 4 * hidden)
    layers = int(getattr(model_config, "num_hidden_layers", 32))
    vocab = int(getattr(model_config, "vocab_size", 32000))
    layer_bytes = dtype_bytes * (16 * hidden + 4 * mlp)
    kept = layers * dtype_bytes * hidden + layer_bytes if checkpointed else layers * layer_bytes
    return kept + 3 * 4 * vocab


def sampling_bytes_per_token(model_config: Any, *, dtype_bytes: int, max_seq_len: int) -> int:
    """Estimated bytes a decode batch holds per position for ``model_config``: the KV cache of every
    layer, and while the prompts prefill one layer's float32 attention scores over the longest one."""
    hidden = int(getattr(model_config, "hidden_size", 4096))
    heads = int(getattr(model_config, "num_attention_heads", 32))
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
    layers = int(getattr(model_config, "num_hidden_layers", 32))
    return 2 * layers * kv_heads * head_dim * dtype_bytes + 4 * heads * max_seq_len


def default_token_budget(bytes_per_token: int, device: torch.device, *, floor: int, capped: bool = True) -> int:
    """Positions per pass when no budget is configured: a share of the device's free memory
    (``_MEMORY_SHARE``) over ``bytes_per_token``; with ``capped`` at most ``_CUDA_PASS_TOKENS`` on
    CUDA and ``_CPU_PASS_BYTES`` worth on CPU; never below ``floor`` (the longest row the engine
    accepts must fit)."""
    per_token = max(bytes_per_token, 1)
    kind = "cuda" if device.type == "cuda" else "cpu"
    fitting = int(_MEMORY_SHARE[kind] * _free_memory_bytes(device)) // per_token
    cap = _CUDA_PASS_TOKENS if kind == "cuda" else _CPU_PASS_BYTES // per_token
    return max(floor, min(cap, fitting) if capped else fitting)


def _free_memory_bytes(device: torch.device) -> int:
    """Free accelerator memory, or on CPU the memory the OS reports as available."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
