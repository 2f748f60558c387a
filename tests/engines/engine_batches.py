"""Builders shared by the engine tests: configs and right-padded canonical batches."""

from __future__ import annotations

import torch

from icefloe.config import ClientConfig


def make_config(**overrides) -> ClientConfig:
    """A config for the tiny model; ``training`` etc. are merged from ``overrides``."""
    return ClientConfig.build({"model": "tiny:arith", "seed": 0, "max_seq_len": 48, **overrides})


def make_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    advantages: list[float],
    *,
    pad_id: int = 0,
    loss_fn: str = "grpo",
    config: dict | None = None,
    old_logprobs: torch.Tensor | None = None,
) -> dict:
    """Right-padded canonical frame; loss_mask marks the columns that predict response tokens."""
    width = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    rows = len(prompts)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.int64)
    attention = torch.zeros((rows, width), dtype=torch.int64)
    loss_mask = torch.zeros((rows, width))
    for b, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        sequence = prompt + response
        input_ids[b, : len(sequence)] = torch.tensor(sequence)
        attention[b, : len(sequence)] = 1
        loss_mask[b, len(prompt) - 1 : len(sequence) - 1] = 1.0
    context = {
        "input_ids": input_ids,
        "advantages": loss_mask * torch.tensor(advantages)[:, None],
        "loss_mask": loss_mask,
    }
    if old_logprobs is not None:
        context["old_logprobs"] = old_logprobs
    return {
        "args": (),
        "kwargs": {
            "input_ids": input_ids,
            "attention_mask": attention,
            "position_ids": torch.arange(width).expand(rows, width).clone(),
        },
        "context": context,
        "processing": {"loss_fn": loss_fn, "config": dict(config or {})},
    }


def random_rows(num_rows: int, *, seed: int, low: int = 4, high: int = 19) -> tuple[list, list, list]:
    """Prompts, responses and advantages of varied lengths drawn from the tiny vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, advantages = [], [], []
    for _ in range(num_rows):
        p_len = int(torch.randint(2, 6, (1,), generator=gen))
        r_len = int(torch.randint(1, 7, (1,), generator=gen))
        prompts.append(torch.randint(low, high, (p_len,), generator=gen).tolist())
        responses.append(torch.randint(low, high, (r_len,), generator=gen).tolist())
        advantages.append(float(torch.randn(1, generator=gen)))
    return prompts, responses, advantages
