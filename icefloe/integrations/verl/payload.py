"""verl worker batches → dense verl layout → ``{batch, meta, processing}`` payloads, and back.

Legend: ``B`` rows, ``P`` prompt columns (left-padded), ``R`` response columns (right-padded),
``L = P + R``, ``S`` canonical positions (a row's real tokens from column 0, shifted).

V0 hands the worker nested-jagged ``input_ids`` with the other fields dense; V1 (TransferQueue)
hands every field nested. :func:`densify` turns either into verl's dense layout, padding V1 rows
to the CONFIG maxima (``data.max_prompt_length`` / ``max_response_length``), never to batch
maxima, so the prompt/response split is the same on every call. The payloads then go through
``icefloe.client.batch.to_canonical`` (the one lowering); results come back as verl's nested
"predict-next" rows, which for canonical row ``b`` is exactly ``values_BS[b, :len_b]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from icefloe.protocol import InvalidRequestError

__all__ = [
    "RESPONSE_FIELDS",
    "densify",
    "log_prob_payload",
    "nested_rows",
    "row_lengths",
    "update_payload",
]

# Response-aligned fields and the value their padding takes.
RESPONSE_FIELDS: dict[str, float] = {
    "response_mask": 0.0,
    "loss_mask": 0.0,
    "old_log_probs": 0.0,
    "advantages": 0.0,
    "ref_log_prob": 0.0,
    "rollout_is_weights": 1.0,
}


def densify(
    fields: Mapping[str, Tensor | None],
    *,
    pad_token_id: int,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> dict[str, Tensor]:
    """verl's dense layout: ``prompts [B,P]``, ``responses [B,R]``, ``input_ids`` / ``attention_mask [B,L]``.

    Nested ``prompts``/``responses`` (V1) are padded to the config maxima, which are then required;
    dense ones (V0) are kept as they are. Response-aligned fields become ``[B, R]``.
    """
    for name in ("prompts", "responses"):
        if fields.get(name) is None:
            raise InvalidRequestError(f"the verl batch has no {name!r}; verl's agent loop always provides it")
    prompts, responses = fields["prompts"], fields["responses"]
    out: dict[str, Tensor] = {}
    if prompts.is_nested:
        prompt_width = _config_max(max_prompt_length, "data.max_prompt_length")
        out["prompts"] = _pad_rows(prompts, prompt_width, pad_token_id, left=True, name="prompts")
    else:
        out["prompts"] = prompts
    if responses.is_nested:
        response_width = _config_max(max_response_length, "data.max_response_length")
        out["responses"] = _pad_rows(responses, response_width, pad_token_id, left=False, name="responses")
    else:
        out["responses"] = responses
    num_rows, response_width = out["responses"].shape
    if out["prompts"].shape[0] != num_rows:
        raise InvalidRequestError(
            f"prompts has {out['prompts'].shape[0]} rows but responses has {num_rows}; they must match"
        )
    for name, fill in RESPONSE_FIELDS.items():
        value = fields.get(name)
        if value is None:
            continue
        if value.is_nested:
            value = _pad_rows(value, response_width, fill, left=False, name=name)
        if tuple(value.shape) != (num_rows, response_width):
            raise InvalidRequestError(
                f"{name} has shape {tuple(value.shape)}; expected [B, R] = {[num_rows, response_width]}"
            )
        out[name] = value
    if prompts.is_nested or responses.is_nested or fields.get("attention_mask") is None:
        out["attention_mask"] = _mask_from_lengths(prompts, responses, out)
    else:
        out["attention_mask"] = fields["attention_mask"]
    out["input_ids"] = torch.cat([out["prompts"], out["responses"]], dim=1)
    if "response_mask" not in out:
        out["response_mask"] = out["attention_mask"][:, -response_width:].to(torch.float32)
    return out


def log_prob_payload(dense: Mapping[str, Tensor], *, pad_token_id: int, temperature: float) -> dict[str, Any]:
    """The payload for ``forward``: ids and mask; the temperature divides the logits."""
    return {
        "batch": {"input_ids": dense["input_ids"], "attention_mask": dense["attention_mask"]},
        "meta": {"pad_token_id": pad_token_id, "temperature": float(temperature)},
        "processing": {},
    }


def update_payload(
    dense: Mapping[str, Tensor],
    rows: slice,
    *,
    pad_token_id: int,
    temperature: float,
    actor_config: Mapping[str, Any],
    loss_fn: str,
    use_kl_loss: bool,
) -> dict[str, Any]:
    """The payload for one mini-batch's ``fwd_bwd``; the loss normalises by this mini-batch's totals."""
    if dense.get("advantages") is None:
        raise InvalidRequestError("update_actor needs 'advantages' in the batch; compute advantages first")
    names = ["input_ids", "attention_mask", "responses", "response_mask", "advantages"]
    names += [n for n in ("loss_mask", "old_log_probs", "rollout_is_weights") if dense.get(n) is not None]
    if use_kl_loss:
        if dense.get("ref_log_prob") is None:
            raise InvalidRequestError(
                "actor_rollout_ref.actor.use_kl_loss is true but the batch has no 'ref_log_prob'; "
                "verl computes it with compute_ref_log_prob when a reference policy is configured"
            )
        names.append("ref_log_prob")
    batch = {name: dense[name][rows] for name in names}
    mask_R = batch.get("loss_mask", batch["response_mask"])
    return {
        "batch": batch,
        "meta": {
            "actor_config": dict(actor_config),
            "temperature": float(temperature),
            "global_batch_size": int(batch["input_ids"].shape[0]),
            "batch_num_tokens": int(mask_R.sum().item()),
            "pad_token_id": pad_token_id,
        },
        "processing": {"loss_fn": loss_fn},
    }


def row_lengths(dense: Mapping[str, Tensor]) -> Tensor:
    """Real tokens (prompt + response) of each row: the jagged length verl's nested outputs have."""
    return dense["attention_mask"].sum(dim=1).to(torch.int64)


def nested_rows(values_BS: Tensor, lengths_B: Tensor) -> Tensor:
    """verl's nested "predict-next" layout from a shifted canonical ``[B, S]`` result."""
    if values_BS.shape[0] != lengths_B.shape[0]:
        raise InvalidRequestError(f"result has {values_BS.shape[0]} rows for a batch of {lengths_B.shape[0]}")
    width = values_BS.shape[1]
    if width < int(lengths_B.max()):
        # The lowering trims to the longest row; pad back so every row can be sliced.
        values_BS = torch.nn.functional.pad(values_BS, (0, int(lengths_B.max()) - width))
    rows = [values_BS[b, : int(n)].to(torch.float32) for b, n in enumerate(lengths_B.tolist())]
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def _config_max(value: int | None, field: str) -> int:
    if value is None or value <= 0:
        raise InvalidRequestError(
            f"nested (V1) batches are padded to {field}; it is missing from the settings the worker received"
        )
    return int(value)


def _pad_rows(nested: Tensor, width: int, fill: float | int, *, left: bool, name: str) -> Tensor:
    """A nested-jagged ``[B, j]`` tensor → dense ``[B, width]``, left- or right-padded with ``fill``."""
    offsets = nested.offsets().tolist()
    values = nested.values()
    num_rows = len(offsets) - 1
    dense = values.new_full((num_rows, width), fill)
    for row in range(num_rows):
        segment = values[offsets[row] : offsets[row + 1]]
        if segment.shape[0] > width:
            raise InvalidRequestError(
                f"{name}[{row}] has {segment.shape[0]} tokens, more than the configured maximum {width}; "
                "raise data.max_prompt_length / data.max_response_length"
            )
        if segment.shape[0]:
            if left:
                dense[row, width - segment.shape[0] :] = segment
            else:
                dense[row, : segment.shape[0]] = segment
    return dense


def _mask_from_lengths(prompts: Tensor, responses: Tensor, dense: Mapping[str, Tensor]) -> Tensor:
    """``[B, P+R]``: ones under each row's real prompt (right-aligned) and response (left-aligned)."""
    num_rows, prompt_width = dense["prompts"].shape
    response_width = dense["responses"].shape[1]
    prompt_lens = _lengths(prompts, dense.get("attention_mask"), prompt_width)
    if responses.is_nested:
        response_lens = responses.offsets().diff()
    elif dense.get("response_mask") is not None:
        response_lens = dense["response_mask"].ne(0).sum(dim=1)
    else:
        raise InvalidRequestError("dense responses need a response_mask (or an attention_mask) to find their lengths")
    columns = torch.arange(prompt_width + response_width)
    prompt_part = (columns[None, :] >= (prompt_width - prompt_lens)[:, None]) & (columns[None, :] < prompt_width)
    response_part = (columns[None, :] >= prompt_width) & (columns[None, :] < prompt_width + response_lens[:, None])
    return (prompt_part | response_part).to(torch.int64).reshape(num_rows, -1)


def _lengths(prompts: Tensor, attention_mask: Tensor | None, width: int) -> Tensor:
    if prompts.is_nested:
        return prompts.offsets().diff()
    if attention_mask is not None:
        return attention_mask[:, :width].sum(dim=1)
    raise InvalidRequestError("dense prompts need an attention_mask to find their lengths")
