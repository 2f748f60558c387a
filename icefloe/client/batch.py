"""Building canonical training batches, and the one lowering of verl-style payloads.

Legend: ``B`` rows, ``S`` positions of the canonical (right-padded) frame, ``L`` positions of a
verl batch (prompt left-padded, response right-padded), ``R`` response positions.

The canonical frame is pre-shifted: column ``i`` scores the prediction of token ``i + 1``. Every
backend accepts only this frame; :func:`to_canonical` is the single place a verl-style
``{batch, meta, processing}`` payload becomes one, so the local, Ray and remote paths agree.
torch is imported inside the functions: a light install can import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from icefloe.protocol import InvalidRequestError

if TYPE_CHECKING:
    import torch

__all__ = [
    "VERL_POLICY_LOSSES",
    "build_batch",
    "is_canonical",
    "is_verl_payload",
    "responses_from_canonical",
    "to_canonical",
]

# verl actor_config names → grpo config names of the canonical frame, and verl 0.9.1's defaults
# (``ActorConfig``), applied where the actor config leaves a knob unset.
_VERL_ACTOR_KEYS = {
    "clip_ratio_c": ("c_clip", 3.0),  # verl always applies dual clip
    "loss_agg_mode": ("loss_agg_mode", "token-mean"),
    "entropy_coeff": ("entropy_coeff", 0.0),
    "use_kl_loss": ("use_kl_loss", False),
    "kl_loss_coef": ("kl_coef", 0.001),
    "kl_loss_type": ("kl_type", "low_var_kl"),
}
_VERL_META_KEYS = ("global_batch_size", "batch_num_tokens", "temperature")
# verl loss names that mean the canonical clipped surrogate.
VERL_POLICY_LOSSES = {"verl_grpo": "grpo", "grpo": "grpo", "vanilla": "grpo"}


def build_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    advantages: Sequence[float] | None = None,
    *,
    pad_id: int,
    loss_fn: str = "grpo",
    loss_config: Mapping[str, Any] | None = None,
    old_logprobs: Sequence[Sequence[float]] | None = None,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
    max_seq_len: int | None = None,
) -> dict[str, Any]:
    """Build the canonical frame from per-row prompt and response token lists.

    Args:
        prompt_ids: one token list per row (``_D`` rows; a GRPO group repeats its prompt).
        response_ids: the sampled tokens of each row, EOS included when sampled.
        advantages: one scalar per row; ``None`` means zeros (SFT with ``cross_entropy``).
        loss_config: the loss's ``processing.config`` (see :mod:`icefloe.engines.losses`). Unset
            knobs take this API's defaults, not verl's: no dual clip without ``c_clip``, seq-mean
            modes over every row, ``seq-mean-token-sum-norm`` ÷ the frame's width S.
        old_logprobs / ref_logprobs: per-row lists aligned with ``response_ids``.
        max_seq_len: refuse rows longer than this instead of truncating silently.

    Returns:
        ``{args, kwargs, context, processing}`` with ``[B, S]`` tensors.
    """
    import torch

    num_rows = len(prompt_ids)
    if len(response_ids) != num_rows:
        raise InvalidRequestError(
            f"response_ids has {len(response_ids)} rows but prompt_ids has {num_rows}; pass one response per prompt row"
        )
    if num_rows == 0:
        raise InvalidRequestError("prompt_ids is empty; a batch needs at least one row")
    for name, values in (("advantages", advantages), ("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if values is not None and len(values) != num_rows:
            raise InvalidRequestError(f"{name} has {len(values)} rows but the batch has {num_rows}; pass one per row")
    lengths = []
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        if not prompt:
            raise InvalidRequestError(f"prompt_ids[{row}] is empty; every row needs at least one prompt token")
        if not response:
            raise InvalidRequestError(f"response_ids[{row}] is empty; drop rows without sampled tokens")
        lengths.append(len(prompt) + len(response))
        if max_seq_len is not None and lengths[-1] > max_seq_len:
            raise InvalidRequestError(
                f"row {row} has {lengths[-1]} tokens, over max_seq_len={max_seq_len}; shorten the prompt or max_tokens"
            )
    width = max(lengths)
    input_ids_BS = torch.full((num_rows, width), pad_id, dtype=torch.int64)
    attention_mask_BS = torch.zeros((num_rows, width), dtype=torch.int64)
    loss_mask_BS = torch.zeros((num_rows, width), dtype=torch.float32)
    advantages_BS = torch.zeros((num_rows, width), dtype=torch.float32)
    old_BS = torch.zeros((num_rows, width), dtype=torch.float32) if old_logprobs is not None else None
    ref_BS = torch.zeros((num_rows, width), dtype=torch.float32) if ref_logprobs is not None else None
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        num_prompt, num_response = len(prompt), len(response)
        input_ids_BS[row, : num_prompt + num_response] = torch.tensor([*prompt, *response], dtype=torch.int64)
        attention_mask_BS[row, : num_prompt + num_response] = 1
        # Column i predicts token i+1: response token j sits at num_prompt+j, scored at num_prompt+j-1.
        scored = slice(num_prompt - 1, num_prompt - 1 + num_response)
        loss_mask_BS[row, scored] = 1.0
        if advantages is not None:
            advantages_BS[row, scored] = float(advantages[row])
        for name, source, target in (("old_logprobs", old_logprobs, old_BS), ("ref_logprobs", ref_logprobs, ref_BS)):
            if source is None or target is None:
                continue
            if len(source[row]) != num_response:
                raise InvalidRequestError(
                    f"{name}[{row}] has {len(source[row])} values for {num_response} response tokens; align them"
                )
            target[row, scored] = torch.tensor(source[row], dtype=torch.float32)
    position_ids_BS = torch.arange(width, dtype=torch.int64).expand(num_rows, width).contiguous()
    context: dict[str, Any] = {"input_ids": input_ids_BS, "advantages": advantages_BS, "loss_mask": loss_mask_BS}
    if old_BS is not None:
        context["old_logprobs"] = old_BS
    if ref_BS is not None:
        context["ref_logprobs"] = ref_BS
    return {
        "args": (),
        "kwargs": {"input_ids": input_ids_BS, "attention_mask": attention_mask_BS, "position_ids": position_ids_BS},
        "context": context,
        "processing": {"loss_fn": loss_fn, "config": dict(loss_config or {})},
    }


def is_canonical(payload: Mapping[str, Any]) -> bool:
    """True for the training API's ``{args, kwargs, context?, processing?}`` frame."""
    return isinstance(payload, Mapping) and "kwargs" in payload and "batch" not in payload


def is_verl_payload(payload: Mapping[str, Any]) -> bool:
    """True for a verl-style ``{batch, meta, processing}`` payload."""
    return isinstance(payload, Mapping) and isinstance(payload.get("batch"), Mapping)


def to_canonical(payload: Mapping[str, Any], processing: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return the canonical frame for either accepted payload shape.

    A canonical frame passes as given: the training API's SFT frame (pre-shifted ``kwargs.labels``,
    no ``context``) and the RL frame alike. ``processing`` (the ``fwd_bwd`` argument) is merged
    over the payload's own: its ``loss_fn`` wins and its ``config`` keys override.
    """
    if is_verl_payload(payload):
        frame = _lower_verl(payload)
    elif is_canonical(payload):
        frame = {"args": (), **payload}  # sent as given: the service fills the defaults (SFT or RL)
    else:
        keys = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
        raise InvalidRequestError(
            "batch must be the canonical {args, kwargs, context, processing} frame (see "
            f"icefloe.client.batch.build_batch) or a verl-style {{batch, meta, processing}} payload; got {keys}"
        )
    if processing:
        merged = dict(frame.get("processing") or {})
        if processing.get("loss_fn") is not None:
            merged["loss_fn"] = processing["loss_fn"]
        merged["config"] = {**dict(merged.get("config") or {}), **dict(processing.get("config") or {})}
        frame["processing"] = merged
    return frame


def _lower_verl(payload: Mapping[str, Any]) -> dict[str, Any]:
    """verl's left-padded prompt + right-padded response rows → the shifted, right-padded frame.

    The loss config is verl's (:func:`_verl_loss_config`, with verl's defaults); without
    ``meta.global_batch_size`` the seq-mean modes divide by the rows that have a token, as verl does.
    """
    import torch

    batch = payload["batch"]
    meta = dict(payload.get("meta") or {})
    for required in ("input_ids", "attention_mask"):
        if required not in batch:
            raise InvalidRequestError(f"verl payload batch.{required} is missing; verl always sends it")
    input_ids_BL = _dense(batch["input_ids"], "batch.input_ids").to(torch.int64)
    attention_mask_BL = _dense(batch["attention_mask"], "batch.attention_mask").to(torch.int64)
    if input_ids_BL.shape != attention_mask_BL.shape or input_ids_BL.dim() != 2:
        raise InvalidRequestError(
            f"batch.input_ids {tuple(input_ids_BL.shape)} and batch.attention_mask "
            f"{tuple(attention_mask_BL.shape)} must both be [B, L]"
        )
    num_rows, width = input_ids_BL.shape
    lengths_B = attention_mask_BL.sum(dim=1)
    starts_B = attention_mask_BL.argmax(dim=1)  # first real token (prompts are left-padded)
    # Move each row left by its padding so real tokens start at column 0, then trim to the longest row.
    num_cols = max(int(lengths_B.max()), 1)
    gather_BS = (torch.arange(num_cols).expand(num_rows, num_cols) + starts_B[:, None]).clamp(max=width - 1)
    real_BS = torch.arange(num_cols).expand(num_rows, num_cols) < lengths_B[:, None]
    pad_id = int(meta.get("pad_token_id", 0) or 0)
    input_ids_BS = torch.where(real_BS, input_ids_BL.gather(1, gather_BS), pad_id)
    attention_mask_BS = real_BS.to(torch.int64)
    position_ids_BS = torch.arange(num_cols, dtype=torch.int64).expand(num_rows, num_cols).contiguous()

    def shifted(name: str, *, fill: float = 0.0) -> torch.Tensor:
        """A response-aligned tensor, placed under its tokens, moved like the ids, then shifted by one."""
        values = _dense(batch[name], f"batch.{name}").to(torch.float32)
        if values.dim() != 2 or values.shape[0] != num_rows or values.shape[1] > width:
            raise InvalidRequestError(
                f"batch.{name} has shape {tuple(values.shape)}; expected [B, R] or [B, L] with B={num_rows}, L={width}"
            )
        if values.shape[1] < width:  # [B, R] → under the last R columns (response positions)
            values = torch.cat([values.new_full((num_rows, width - values.shape[1]), fill), values], dim=1)
        moved_BS = torch.where(real_BS, values.gather(1, gather_BS), fill)
        out_BS = torch.full_like(moved_BS, fill)
        out_BS[:, :-1] = moved_BS[:, 1:]
        return out_BS

    mask_name = next((n for n in ("loss_mask", "response_mask") if batch.get(n) is not None), None)
    context: dict[str, Any] = {"input_ids": input_ids_BS}
    if mask_name is not None:
        loss_mask_BS = shifted(mask_name)
        context["loss_mask"] = loss_mask_BS
        if batch.get("advantages") is not None:
            context["advantages"] = shifted("advantages") * loss_mask_BS
        for source, target in (("old_log_probs", "old_logprobs"), ("ref_log_prob", "ref_logprobs")):
            if batch.get(source) is not None:
                context[target] = shifted(source)
        if batch.get("rollout_is_weights") is not None:
            context["rollout_is_weights"] = shifted("rollout_is_weights", fill=1.0)
    config = _verl_loss_config(meta.get("actor_config") or {}, response_width=_response_width(batch, mask_name))
    for key in _VERL_META_KEYS:
        if meta.get(key) is not None:
            config[key] = meta[key]
    if config.get("global_batch_size") is None and mask_name is not None:
        # verl's default seq-mean normaliser counts the rows that have at least one token.
        config["global_batch_size"] = int(context["loss_mask"].sum(dim=1).gt(0).sum())
    processing = dict(payload.get("processing") or {})
    loss_name = processing.get("loss_fn")
    loss_fn = VERL_POLICY_LOSSES.get(loss_name, loss_name) if loss_name else "grpo"
    return {
        "args": (),
        "kwargs": {"input_ids": input_ids_BS, "attention_mask": attention_mask_BS, "position_ids": position_ids_BS},
        "context": context,
        "processing": {"loss_fn": loss_fn, "config": {**config, **dict(processing.get("config") or {})}},
    }


def _verl_loss_config(actor: Mapping[str, Any], *, response_width: int | None) -> dict[str, Any]:
    """verl's actor loss knobs, with verl's defaults, as the grpo loss's config.

    ``clip_ratio_low`` / ``clip_ratio_high`` each fall back to ``clip_ratio`` (then 0.2).
    ``seq-mean-token-sum-norm`` divides by ``loss_scale_factor``, else by the response width.
    """

    def knob(name: str, default: Any) -> Any:
        return default if actor.get(name) is None else actor[name]

    clip = knob("clip_ratio", 0.2)
    config = {"eps_clip": knob("clip_ratio_low", clip), "eps_clip_higher": knob("clip_ratio_high", clip)}
    config.update({target: knob(source, default) for source, (target, default) in _VERL_ACTOR_KEYS.items()})
    scale = knob("loss_scale_factor", response_width)
    if scale is not None:
        config["loss_scale_factor"] = scale
    return config


def _response_width(batch: Mapping[str, Any], mask_name: str | None) -> int | None:
    """R, the width of verl's response-only tensors (``responses``, else the mask as sent)."""
    for name in ("responses", mask_name):
        if name is not None and batch.get(name) is not None:
            return int(_dense(batch[name], f"batch.{name}").shape[-1])
    return None


def responses_from_canonical(
    values_BS: torch.Tensor, verl_batch: Mapping[str, Any], response_width: int
) -> torch.Tensor:
    """Map a shifted canonical ``[B, S]`` result (log-probs, entropy) back to verl's ``[B, R]``.

    Slot ``j`` of the result holds the value for response token ``j`` (verl's convention), taken
    from canonical column ``prompt_len + j - 1`` of each row.
    """
    import torch

    attention_mask_BL = _dense(verl_batch["attention_mask"], "batch.attention_mask").to(torch.int64)
    width = attention_mask_BL.shape[1]
    starts_B = attention_mask_BL.argmax(dim=1)
    # Response token j is at verl column (width - R + j); after removing left padding, at that minus start.
    first_BR = (width - response_width) - starts_B[:, None] - 1 + torch.arange(response_width)[None, :]
    index_BR = first_BR.clamp(0, values_BS.shape[1] - 1)
    return values_BS.gather(1, index_BR.to(values_BS.device)).to(torch.float32)


def _dense(value: Any, name: str) -> torch.Tensor:
    import torch

    if isinstance(value, torch.Tensor):
        if value.is_nested:
            raise InvalidRequestError(
                f"{name} is a nested (jagged) tensor; densify it first (pad to the config maxima)"
            )
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(
            f"{name} must be a tensor or nested list of numbers; got {type(value).__name__}"
        ) from exc
