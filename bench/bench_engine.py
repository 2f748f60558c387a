"""TrainingEngine fwd_bwd + step vs a bare hand-written torch loop on the same model and batch.

Both train a copy of the same tiny model (``--preset``, default the compute-bound ``bench``) on
the same right-padded batch with the same loss: the GRPO token-mean clipped surrogate (written
inline with plain torch for the bare loop), AdamW and global-norm clipping. The two run
interleaved in one process (alternating which goes first), ``--repeats`` times after ``--warmup``
rounds; medians are reported as tokens/s (non-pad tokens). ``ratio`` = engine ÷ bare (target ≥ 0.95);
``paired_ratio`` is the median of the per-round ratios, steadier on a machine shared with other work.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, timed
from icefloe.config import ClientConfig
from icefloe.engines.models import load_causal_lm, resolve_model
from icefloe.engines.training import TrainingEngine

LR, EPS_CLIP, GRAD_CLIP = 1e-5, 0.2, 1.0


def make_batch(rows: int, width: int, vocab: int, seed: int = 0) -> dict[str, Any]:
    """A canonical GRPO batch: prompts of 1/4 of the width, responses that fill 3/4 to all of it."""
    gen = torch.Generator().manual_seed(seed)
    input_ids_BS = torch.randint(4, vocab, (rows, width), generator=gen)
    lengths_B = torch.randint(3 * width // 4, width + 1, (rows,), generator=gen)
    positions_S = torch.arange(width)
    attention_BS = (positions_S[None, :] < lengths_B[:, None]).long()
    loss_mask_BS = ((positions_S[None, :] >= width // 4 - 1) & (positions_S[None, :] < lengths_B[:, None] - 1)).float()
    advantages_BS = torch.randn(rows, 1, generator=gen) * loss_mask_BS
    old_BS = -torch.rand(rows, width, generator=gen) * 5
    return {
        "args": (),
        "kwargs": {
            "input_ids": input_ids_BS * attention_BS,
            "attention_mask": attention_BS,
            "position_ids": positions_S.expand(rows, width).clone(),
        },
        "context": {"advantages": advantages_BS, "loss_mask": loss_mask_BS, "old_logprobs": old_BS},
        "processing": {"loss_fn": "grpo", "config": {"eps_clip": EPS_CLIP, "loss_agg_mode": "token-mean"}},
    }


def bare_loop(model: torch.nn.Module, batch: dict[str, Any]) -> Callable[[], float]:
    """One training step written out with plain torch: forward, clipped surrogate, backward, clip, AdamW."""
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR)
    kwargs, context = batch["kwargs"], batch["context"]
    targets_BS = kwargs["input_ids"][:, 1:, None]
    mask_BS, advantages_BS, old_BS = (context[k][:, :-1] for k in ("loss_mask", "advantages", "old_logprobs"))
    num_tokens = mask_BS.sum()

    def run() -> float:
        logits_BSV = model(**kwargs, use_cache=False).logits
        logprobs_BS = torch.log_softmax(logits_BSV[:, :-1].float(), dim=-1).gather(-1, targets_BS).squeeze(-1)
        ratio_BS = torch.exp(logprobs_BS - old_BS)
        surrogate_BS = torch.maximum(
            -advantages_BS * ratio_BS, -advantages_BS * ratio_BS.clamp(1 - EPS_CLIP, 1 + EPS_CLIP)
        )
        loss = (surrogate_BS * mask_BS).sum() / num_tokens
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item()) + 0.0 * float(grad_norm.item())

    return run


def engine_loop(engine: TrainingEngine, batch: dict[str, Any]) -> Callable[[], float]:
    def run() -> float:
        result = engine.fwd_bwd(batch)
        engine.step()
        return result["loss"]

    return run


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench engine", description=__doc__)
    parser.add_argument("--preset", default="bench", help="tiny:<preset> model to train")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--width", type=int, default=128, help="sequence width S")
    parser.add_argument("--iterations", type=int, default=1, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    args = parse_args(parser, argv, smoke={"rows": 2, "width": 32, "repeats": 2})
    if args.threads:
        torch.set_num_threads(args.threads)

    config = ClientConfig.build(
        model=f"tiny:{args.preset}", max_seq_len=max(args.width, 8),
        training={"optimizer": {"lr": LR}, "grad_clip": GRAD_CLIP},
    )  # fmt: skip
    model_dir = resolve_model(config.model, seed=config.seed)
    engine = TrainingEngine(config, device=args.device, model_dir=model_dir)
    device = engine.device
    bare_model = load_causal_lm(model_dir, device=device).train()
    batch = make_batch(args.rows, args.width, engine.vocab_size)
    device_batch = {**batch, "kwargs": {k: v.to(device) for k, v in batch["kwargs"].items()},
                    "context": {k: v.to(device) for k, v in batch["context"].items()}}  # fmt: skip
    contenders = {"engine": engine_loop(engine, batch), "bare": bare_loop(bare_model, device_batch)}
    tokens = int(batch["kwargs"]["attention_mask"].sum()) * args.iterations

    for _ in range(args.warmup):
        for run in contenders.values():
            timed(run, device)
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(args.repeats):
        order = list(contenders) if repeat % 2 == 0 else list(reversed(contenders))
        for name in order:
            seconds[name].append(timed(contenders[name], device, args.iterations))
    tok_s = {name: tokens / statistics.median(values) for name, values in seconds.items()}

    table = Table(title=f"fwd_bwd + step, tiny:{args.preset}, {args.rows}×{args.width}, {device}")
    for column in ("contender", "median s/round", "min s/round", "tokens/s"):
        table.add_column(column, justify="right")
    for name, values in seconds.items():
        table.add_row(name, f"{statistics.median(values):.3f}", f"{min(values):.3f}", f"{tok_s[name]:,.0f}")
    Console().print(table)
    ratio = tok_s["engine"] / tok_s["bare"]
    paired = statistics.median(b / e for e, b in zip(seconds["engine"], seconds["bare"], strict=True))
    finish(
        args,
        f"bench=engine ratio={ratio:.3f} engine_tok_s={tok_s['engine']:.0f} bare_tok_s={tok_s['bare']:.0f} "
        f"paired_ratio={paired:.3f}",
    )
