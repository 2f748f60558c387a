"""The remote backend against the local one, and what concurrency and pipelining buy over HTTP.

1. Demo loop: the GRPO recipe (``icefloe demo``'s loop) for ``--steps`` steps on ``local`` and on
   ``remote`` (an ``icefloe serve`` subprocess on loopback), interleaved ``--repeats`` times. Both
   backends run the same seed, so step k does the same work on both (its length varies from
   70 to 130 ms with how many groups carry signal): each step's time is its median over the
   repeats, and ``ratio`` = remote ÷ local of their sums (the first step dropped).
2. Concurrency: ``--concurrency`` single-prompt ``generate`` calls gathered on one AsyncClient vs
   one call holding all the prompts, interleaved. ``concurrency_ratio`` = gathered ÷ batched.
3. Pipelining: ``fwd_bwd`` + ``step`` submitted back to back (gathered) vs each awaited before the
   next is sent, per pair, interleaved. ``pipeline_ratio`` = pipelined ÷ awaited.

Both sides use one torch thread. On a machine shared with other work the numbers are noisy; the
interleaving spreads the noise over both sides alike.

    python -m bench remote [--steps 12] [--warmup 3] [--repeats 3] [--concurrency 64] [--pairs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, serve
from icefloe.client import AsyncClient, build_batch
from icefloe.config import ClientConfig
from icefloe.recipes.grpo import GRPOConfig, run


def _demo_step_s(backend: str, base_url: str, out_dir: Path, steps: int, warmup: int, repeat: int) -> list[float]:
    config = GRPOConfig(
        name=f"bench-{backend}-{repeat}",  # a folder per run: run() refuses one that already holds a run
        out_dir=out_dir,
        steps=steps,
        warmup_steps=warmup,
        backend=backend,
        base_url=base_url if backend == "remote" else None,
    )
    rows = asyncio.run(run(config))
    return [row["seconds"] for row in rows[1:]]


def _loop_s(runs: list[list[float]]) -> float:
    """Seconds of the loop: each step's median over the runs, summed (robust to a stray slow step)."""
    return sum(statistics.median(times) for times in zip(*runs, strict=True))


async def _concurrency(config: ClientConfig, width: int, rounds: int) -> tuple[list[float], list[float]]:
    prompts = [[1 + (i % 12), 2 + (i % 11), 3] for i in range(width)]
    params = {"max_tokens": 4, "seed": 3}
    gathered, batched = [], []
    async with AsyncClient(config) as client:
        await client.generate(prompts, params)  # warm the sampler and the connection pool
        await asyncio.gather(*(client.generate([p], params) for p in prompts))
        for _ in range(rounds):
            started = time.perf_counter()
            await asyncio.gather(*(client.generate([p], params) for p in prompts))
            gathered.append(time.perf_counter() - started)
            started = time.perf_counter()
            await client.generate(prompts, params)
            batched.append(time.perf_counter() - started)
    return gathered, batched


async def _pipelining(config: ClientConfig, pairs: int) -> tuple[list[float], list[float]]:
    batch = build_batch([[3, 4, 5]] * 8, [[6, 7, 8, 9]] * 8, [1.0, -1.0] * 4, pad_id=0)
    pipelined, awaited = [], []
    async with AsyncClient(config) as client:
        await asyncio.gather(client.fwd_bwd(batch), client.step())
        for _ in range(pairs):
            started = time.perf_counter()
            await asyncio.gather(client.fwd_bwd(batch), client.step())
            pipelined.append(time.perf_counter() - started)
            started = time.perf_counter()
            await client.fwd_bwd(batch)
            await client.step()
            awaited.append(time.perf_counter() - started)
    return pipelined, awaited


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench remote", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="supervised warm-up steps of the recipe")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=20)
    smoke = {"steps": 3, "warmup": 1, "repeats": 1, "concurrency": 4, "rounds": 1, "pairs": 2}
    args = parse_args(parser, argv, smoke=smoke)

    import torch

    from icefloe.cli import _quiet_transformers

    torch.set_num_threads(1)
    _quiet_transformers()
    with (
        tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp,
        serve(Path(tmp) / "serve") as base_url,
    ):
        step_s: dict[str, list[list[float]]] = {"local": [], "remote": []}
        for repeat in range(args.repeats):
            for backend in ("local", "remote"):
                runs = Path(tmp) / "runs"
                step_s[backend].append(_demo_step_s(backend, base_url, runs, args.steps, args.warmup, repeat))
        remote = ClientConfig.build(model="tiny:arith", backend={"type": "remote", "base_url": base_url})
        gathered, batched = asyncio.run(_concurrency(remote, args.concurrency, args.rounds))
        pipelined, awaited = asyncio.run(_pipelining(remote, args.pairs))

    steps_timed = args.steps - 1
    local_s, remote_s = _loop_s(step_s["local"]) / steps_timed, _loop_s(step_s["remote"]) / steps_timed
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Remote keeps three processes busy (client, service, engines) where local keeps one: on few
    # cores they queue for a CPU, which is most of what the ratio measures there.
    table = Table(title=f"remote backend (torch {torch.__version__}, CPU, {cores} cores; shared machine: noisy)")
    for column in ("measure", "baseline", "candidate", "ratio"):
        table.add_column(column, justify="right" if column != "measure" else "left")
    rows = [
        ("demo step s, mean (local → remote)", local_s, remote_s),
        (
            f"generate s ({args.concurrency} prompts: 1 call → {args.concurrency} calls)",
            statistics.median(batched),
            statistics.median(gathered),
        ),
        ("fwd_bwd+step s (awaited → pipelined)", statistics.median(awaited), statistics.median(pipelined)),
    ]
    for name, base, cand in rows:
        table.add_row(name, f"{base:.4f}", f"{cand:.4f}", f"{cand / base:.3f}")
    Console().print(table)
    recipe = GRPOConfig()  # the demo's step, as the runs above did it
    finish(
        args,
        f"bench=remote ratio={remote_s / local_s:.3f} concurrency_ratio={rows[1][2] / rows[1][1]:.3f} "
        f"pipeline_ratio={rows[2][2] / rows[2][1]:.3f} local_step_s={local_s:.4f} remote_step_s={remote_s:.4f} "
        f"samples_per_step={recipe.problems_per_step * recipe.group_size} "
        f"fwd_bwd_per_step={recipe.num_minibatches} steps={args.steps} repeats={args.repeats}",
    )
