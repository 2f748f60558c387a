"""Local weight sync (trainer → sampler, in place) vs one flat tensor copy of the same bytes.

``sync_weights_local`` copies every parameter of a TrainingEngine into a SamplingEngine of the
same tiny model; the baseline copies one flat buffer holding the same number of bytes, the
fastest a copy of those bytes can go. A third row copies parameter by parameter with a bare
``copy_`` loop, which separates per-tensor cost from the sync's own bookkeeping. Interleaved in
one process (rotating order), ``--repeats`` times; medians in GB/s. ``ratio`` = sync ÷ flat copy.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, timed
from icefloe.config import ClientConfig
from icefloe.engines.models import resolve_model
from icefloe.engines.sampling import SamplingEngine
from icefloe.engines.training import TrainingEngine
from icefloe.engines.weight_sync import sync_weights_local


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench weight_sync", description=__doc__)
    parser.add_argument("--preset", default="bench", help="tiny:<preset> model whose weights are synced")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 = torch's default")
    args = parse_args(parser, argv, smoke={"repeats": 3})
    if args.threads:
        torch.set_num_threads(args.threads)

    config = ClientConfig.build(model=f"tiny:{args.preset}")
    model_dir = resolve_model(config.model, seed=config.seed)
    trainer = TrainingEngine(config, device=args.device, model_dir=model_dir)
    sampler = SamplingEngine(config, device=args.device, model_dir=model_dir)
    device = trainer.device
    num_bytes = sum(t.numel() * t.element_size() for _, t in trainer.named_weights())
    source = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    target = torch.empty_like(source)
    pairs = [(dict(sampler.model.named_parameters())[name], t) for name, t in trainer.named_weights()]

    @torch.no_grad()
    def copy_loop() -> None:
        for destination, tensor in pairs:
            destination.copy_(tensor)

    contenders: dict[str, Callable[[], object]] = {
        "sync_weights_local": lambda: sync_weights_local(trainer, sampler),
        "flat copy": lambda: target.copy_(source),
        "param copy_ loop": copy_loop,
    }
    for run in contenders.values():  # warm-up: first touches of the pages
        timed(run, device)
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for repeat in range(args.repeats):
        names = list(contenders)
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            seconds[name].append(timed(contenders[name], device))
    gbps = {name: num_bytes / statistics.median(values) / 1e9 for name, values in seconds.items()}

    table = Table(title=f"weight sync, tiny:{args.preset}, {num_bytes / 2**20:.1f} MiB, {device}")
    for column in ("contender", "median ms", "GB/s"):
        table.add_column(column, justify="right")
    for name, values in seconds.items():
        table.add_row(name, f"{statistics.median(values) * 1e3:.2f}", f"{gbps[name]:.2f}")
    Console().print(table)
    ratio = gbps["sync_weights_local"] / gbps["flat copy"]
    finish(
        args,
        f"bench=weight_sync ratio={ratio:.3f} sync_gbps={gbps['sync_weights_local']:.2f} "
        f"copy_gbps={gbps['flat copy']:.2f} loop_gbps={gbps['param copy_ loop']:.2f} bytes={num_bytes}",
    )
