"""LoRA (rank ``--rank``, all linear layers) vs full weights: one training step and one weight sync.

Both train the same model (``--preset``, default the ~6M-parameter ``bench``) on the same GRPO
batch, each with its own trainer → sampler pair in this process; the two configurations run
interleaved (alternating which goes first), ``--repeats`` times after one warm-up round. Reported
per configuration: trainable parameters, bytes one weight sync moves, median ``fwd_bwd`` + ``step``
seconds, median sync seconds, the bytes of gradients plus AdamW state (what LoRA saves on any
device: measured, the ``nbytes`` of every gradient after ``fwd_bwd`` and of every tensor in the
optimizer's state after ``step``), and the step results' ``peak_memory`` (the device's peak on CUDA;
on CPU only the process-wide RSS peak exists, which both share). ``ratio`` = LoRA sync bytes ÷ full
sync bytes (target ≤ 0.1 at rank 8); ``step_ratio`` = LoRA step ÷ full step; ``state_ratio`` = LoRA
gradient + AdamW bytes ÷ full.

    python -m bench lora [--preset bench] [--rank 8] [--rows 8] [--width 256] [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, timed
from bench.bench_engine import make_batch
from icefloe.config import ClientConfig
from icefloe.engines.models import resolve_model
from icefloe.engines.sampling import SamplingEngine
from icefloe.engines.training import TrainingEngine
from icefloe.engines.weight_sync import sync_weights_local


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench lora", description=__doc__)
    parser.add_argument("--preset", default="bench", help="tiny:<preset> model to train")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--width", type=int, default=256, help="positions per row")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    args = parse_args(parser, argv, smoke={"rows": 2, "width": 32, "repeats": 1})
    if args.threads:
        torch.set_num_threads(args.threads)

    base = {"model": f"tiny:{args.preset}", "max_seq_len": args.width, "training": {"peak_memory_log": True}}
    configs = {
        "full": ClientConfig.build(base),
        "lora": ClientConfig.build(base, lora={"rank": args.rank, "alpha": 2 * args.rank}),
    }
    model_dir = resolve_model(configs["full"].model, seed=0)
    pairs = {
        name: (
            TrainingEngine(config, device=args.device, model_dir=model_dir),
            SamplingEngine(config, device=args.device, model_dir=model_dir),
        )
        for name, config in configs.items()
    }
    device = pairs["full"][0].device
    batch = make_batch(args.rows, args.width, pairs["full"][0].vocab_size)
    step_s: dict[str, list[float]] = {name: [] for name in pairs}
    sync_s: dict[str, list[float]] = {name: [] for name in pairs}
    last: dict[str, dict[str, Any]] = {}

    def train(name: str) -> None:
        trainer = pairs[name][0]
        trainer.fwd_bwd(batch)
        gradient_bytes = _gradient_bytes(trainer)
        last[name] = {**trainer.step(), "state_bytes": gradient_bytes + _optimizer_state_bytes(trainer)}

    for repeat in range(args.repeats + 1):  # round 0 warms up and is not counted
        names = list(pairs) if repeat % 2 == 0 else list(reversed(pairs))
        for name in names:
            trainer, sampler = pairs[name]
            seconds = timed(lambda name=name: train(name), device)
            synced = sync_weights_local(trainer, sampler)
            if repeat:
                step_s[name].append(seconds)
                sync_s[name].append(synced["seconds"])
            last[name] = {**last[name], "sync_bytes": synced["bytes"]}

    rows = {name: _row(pairs[name][0], last[name], step_s[name], sync_s[name]) for name in pairs}
    shape = f"tiny:{args.preset}, {args.rows}x{args.width}, {device}"
    table = Table(title=f"LoRA rank {args.rank} vs full weights, {shape}")
    for column in ("", *rows["full"]):
        table.add_column(column, justify="right")
    for name, row in rows.items():
        table.add_row(name, *(_format(value) for value in row.values()))
    Console().print(table)
    full, lora = rows["full"], rows["lora"]
    finish(
        args,
        f"bench=lora ratio={lora['sync bytes'] / full['sync bytes']:.4f} "
        f"step_ratio={lora['step s'] / full['step s']:.3f} "
        f"trainable_ratio={lora['trainable params'] / full['trainable params']:.4f} "
        f"state_ratio={lora['grad+adam bytes'] / full['grad+adam bytes']:.4f} "
        f"full_sync_bytes={full['sync bytes']} lora_sync_bytes={lora['sync bytes']} "
        f"full_step_s={full['step s']:.4f} lora_step_s={lora['step s']:.4f} "
        f"full_peak_mib={full['peak MiB']} lora_peak_mib={lora['peak MiB']} rank={args.rank} "
        f"device={device.type}",
    )


def _row(trainer: TrainingEngine, stepped: dict[str, Any], step_s: list[float], sync_s: list[float]) -> dict:
    trainable = [p for _, p in trainer.sync_parameters()]
    num_trainable = sum(p.numel() for p in trainable)
    peak = stepped["peak_memory"]
    return {
        "trainable params": num_trainable,
        "sync bytes": stepped["sync_bytes"],
        "step s": statistics.median(step_s),
        "sync s": statistics.median(sync_s),
        "grad+adam bytes": stepped["state_bytes"],
        "peak MiB": round((peak["gpu_peak"] or peak["cpu_peak"]) / 2**20),
    }


def _gradient_bytes(trainer: TrainingEngine) -> int:
    """Bytes of the gradients ``fwd_bwd`` left on the parameters the optimizer updates."""
    assert trainer.optimizer is not None
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    return sum(p.grad.nbytes for p in params if p.grad is not None)


def _optimizer_state_bytes(trainer: TrainingEngine) -> int:
    """Bytes of every tensor the optimizer keeps between steps (AdamW: two moments and a step count)."""
    assert trainer.optimizer is not None
    state = trainer.optimizer.state.values()
    return sum(value.nbytes for per_param in state for value in per_param.values() if isinstance(value, torch.Tensor))


def _format(value: float | int) -> str:
    return f"{value:,}" if isinstance(value, int) else f"{value:.4f}"
