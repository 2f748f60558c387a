"""Canonical training batches for the service tests, built by hand from token rows.

Rows are prompt + response, right-padded; labels are pre-shifted (column i scores token i+1), so
``loss_mask[:, i]`` is 1 where ``input_ids[:, i+1]`` is a response token.
"""

from __future__ import annotations

from typing import Any

import torch

PAD_ID = 0


def canonical_batch(rows: list[tuple[list[int], list[int]]], advantages: list[float]) -> dict[str, Any]:
    """``rows`` = (prompt_ids, response_ids) per row; one advantage per row."""
    width = max(len(p) + len(r) for p, r in rows)
    input_ids_BS = torch.full((len(rows), width), PAD_ID, dtype=torch.int64)
    attention_BS = torch.zeros((len(rows), width), dtype=torch.int64)
    loss_mask_BS = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, (prompt, response) in enumerate(rows):
        tokens = prompt + response
        input_ids_BS[b, : len(tokens)] = torch.tensor(tokens)
        attention_BS[b, : len(tokens)] = 1
        loss_mask_BS[b, len(prompt) - 1 : len(tokens) - 1] = 1.0
    advantages_BS = torch.tensor(advantages, dtype=torch.float32)[:, None] * loss_mask_BS
    position_BS = torch.arange(width, dtype=torch.int64).expand(len(rows), width).clone()
    return {
        "args": (),
        "kwargs": {"input_ids": input_ids_BS, "attention_mask": attention_BS, "position_ids": position_BS},
        "context": {"input_ids": input_ids_BS, "advantages": advantages_BS, "loss_mask": loss_mask_BS},
        "processing": {"loss_fn": "grpo", "config": {}},
    }


def small_batch(seed: int = 0) -> dict[str, Any]:
    """Four rows over the tiny:arith vocabulary (ids 1..14), advantages centred per group."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(4):
        prompt = torch.randint(1, 15, (3,), generator=generator).tolist()
        response = torch.randint(1, 15, (4,), generator=generator).tolist()
        rows.append((prompt, response))
    return canonical_batch(rows, [1.0, -1.0, 0.5, -0.5])
