"""Golden densification and lowering of verl's V0 (partly nested) and V1 (all nested) batches."""

from __future__ import annotations

import pytest
import torch

from icefloe.client.batch import responses_from_canonical, to_canonical
from icefloe.integrations.verl.payload import (
    densify,
    log_prob_payload,
    nested_rows,
    row_lengths,
    update_payload,
)
from icefloe.protocol import InvalidRequestError

PAD = 0
PROMPTS = [[5, 6, 7], [8, 9]]
RESPONSES = [[10, 11], [12, 13, 14]]


def _nested(rows: list[list[float]], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _v1_fields() -> dict[str, torch.Tensor]:
    return {
        "prompts": _nested(PROMPTS),
        "responses": _nested(RESPONSES),
        "input_ids": _nested([p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]),
        "response_mask": _nested([[1, 1], [1, 1, 1]], torch.float32),
        "advantages": _nested([[0.5, 0.5], [-1.0, -1.0, -1.0]], torch.float32),
    }


def _v0_fields() -> dict[str, torch.Tensor]:
    return {
        "input_ids": _nested([p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]),
        "prompts": torch.tensor([[5, 6, 7], [PAD, 8, 9]]),
        "responses": torch.tensor([[10, 11, PAD], [12, 13, 14]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]),
        "response_mask": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        "advantages": torch.tensor([[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]),
    }


def test_densify_v0_golden_lowers_to_the_canonical_frame() -> None:
    dense = densify(_v0_fields(), pad_token_id=PAD)
    assert dense["input_ids"].tolist() == [[5, 6, 7, 10, 11, PAD], [PAD, 8, 9, 12, 13, 14]]
    frame = to_canonical(update_payload(dense, slice(0, 2), pad_token_id=PAD, temperature=1.0,
                                        actor_config={}, loss_fn="vanilla", use_kl_loss=False))  # fmt: skip
    assert frame["kwargs"]["input_ids"].tolist() == [[5, 6, 7, 10, 11], [8, 9, 12, 13, 14]]
    # Column i scores token i+1: response tokens start at column p-1.
    assert frame["context"]["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]
    assert frame["context"]["advantages"].tolist() == [[0, 0, 0.5, 0.5, 0], [0, -1, -1, -1, 0]]
    assert frame["processing"]["loss_fn"] == "grpo"
    assert frame["processing"]["config"]["global_batch_size"] == 2
    assert frame["processing"]["config"]["batch_num_tokens"] == 5


def test_densify_v1_pads_to_config_maxima_not_batch_maxima() -> None:
    dense = densify(_v1_fields(), pad_token_id=PAD, max_prompt_length=6, max_response_length=4)
    assert dense["prompts"].shape == (2, 6) and dense["responses"].shape == (2, 4)
    assert dense["attention_mask"].tolist() == [
        [0, 0, 0, 1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 0, 1, 1, 1, 1, 1, 0],
    ]
    assert dense["input_ids"][0].tolist() == [PAD, PAD, PAD, 5, 6, 7, 10, 11, PAD, PAD]
    assert dense["advantages"].tolist() == [[0.5, 0.5, 0, 0], [-1, -1, -1, 0]]
    v0 = to_canonical(log_prob_payload(densify(_v0_fields(), pad_token_id=PAD), pad_token_id=PAD, temperature=1.0))
    v1 = to_canonical(log_prob_payload(dense, pad_token_id=PAD, temperature=1.0))
    assert torch.equal(v0["kwargs"]["input_ids"], v1["kwargs"]["input_ids"])  # both layouts reach one frame


def test_densify_v1_rejects_rows_longer_than_the_config() -> None:
    with pytest.raises(InvalidRequestError, match=r"prompts\[0\] has 3 tokens.*max_prompt_length"):
        densify(_v1_fields(), pad_token_id=PAD, max_prompt_length=2, max_response_length=4)
    with pytest.raises(InvalidRequestError, match=r"data\.max_prompt_length"):
        densify(_v1_fields(), pad_token_id=PAD)


def test_nested_rows_are_verls_predict_next_layout() -> None:
    """verl slices values[end - R_b - 1 : end - 1] of each nested row; that must equal the [B, R] mapping."""
    dense = densify(_v1_fields(), pad_token_id=PAD, max_prompt_length=6, max_response_length=4)
    values_BS = torch.arange(10, dtype=torch.float32).repeat(2, 1) + torch.tensor([[0.0], [100.0]])
    nested = nested_rows(values_BS, row_lengths(dense))
    expected_BR = responses_from_canonical(values_BS, dense, response_width=4)
    for row, response in enumerate(RESPONSES):
        end = len(PROMPTS[row]) + len(response)
        sliced = nested[row][end - len(response) - 1 : end - 1]
        assert sliced.tolist() == expected_BR[row, : len(response)].tolist()
    assert [len(nested[row]) for row in range(2)] == [5, 5]
