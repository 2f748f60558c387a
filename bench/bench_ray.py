"""The Ray backend on CPU: DP=2 vs DP=1 training throughput, and weight sync vs a raw broadcast.

Training: two Ray clients of the compute-bound ``tiny:bench`` model, one with one training rank and
one with two (one torch thread per rank), run ``fwd_bwd`` + ``step`` on the same global batch,
interleaved ``--repeats`` times; medians in tokens/s (non-pad tokens). ``dp_speedup`` = DP=2 ÷ DP=1.

Weight sync: a client with one trainer and one sampler of a model holding ``--sync-mb`` of float32
weights (a preset registered here, ~0.5 GB by default) runs the ``sync_weights`` op (bucketed
broadcast + in-place copy, end-to-end wall time seen by the client), interleaved with a single raw
broadcast of the same number of bytes on the same process group. ``ratio`` = sync GB/s ÷ raw GB/s.

Everything runs on a local Ray with 2 CPUs; on a machine shared with other work the numbers are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray
import torch
from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, timed
from icefloe.client import Client
from icefloe.client.batch import build_batch
from icefloe.config import ClientConfig
from icefloe.engines.models import TINY_PRESETS, TinyPreset

_SYNC_PRESET = "bench-sync"


def _register_sync_preset(megabytes: int) -> None:
    """A preset whose float32 weights take about ``megabytes`` (layers of ~12.6 M parameters each)."""
    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 2816  # attention q/k/v/o + gated MLP, hidden 1024
    layers = max(1, round(megabytes * 1024 * 1024 / 4 / per_layer))
    TINY_PRESETS[_SYNC_PRESET] = TinyPreset(
        alphabet=TINY_PRESETS["bench"].alphabet,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=256,
    )


def _config(model: str, workers: int, samplers: int, cpus: float) -> ClientConfig:
    return ClientConfig.build(
        model=model,
        max_seq_len=256,
        num_training_workers=workers,
        num_sampling_workers=samplers,
        backend={"type": "ray", "num_cpus_per_worker": cpus},
    )


def _batch(rows: int, width: int, vocab: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(4, vocab, (width // 4,), generator=generator)] for _ in range(rows)]
    responses = [
        [int(t) for t in torch.randint(4, vocab, (width - width // 4 - (i % 8),), generator=generator)]
        for i in range(rows)
    ]
    advantages = [float(a) for a in torch.randn(rows, generator=generator)]
    return build_batch(prompts, responses, advantages, pad_id=0)


def _raw_broadcast(actor: Any, link: str, num_bytes: int) -> float:
    """Inside a trainer or sampler actor: seconds of one flat broadcast of ``num_bytes`` on the sync's own group."""
    group = actor.links[link]
    flat = torch.empty(num_bytes // 4, dtype=torch.float32, device=group.device)
    group.broadcast(flat)  # warm-up: the first collective on a group pays its connection set-up
    start = time.perf_counter()
    group.broadcast(flat)
    return time.perf_counter() - start


def raw_broadcast_seconds(handle: dict[str, Any], num_bytes: int) -> float:
    """One raw broadcast on the weight-sync group of the client ``handle`` names (every member takes part)."""
    names = handle["actors"]
    actors = [ray.get_actor(n, namespace=handle["namespace"]) for n in [names["training"][0], *names["sampling"]]]
    calls = [actor.__ray_call__.remote(_raw_broadcast, handle["weight_link"], num_bytes) for actor in actors]
    return float(ray.get(calls)[0])


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench ray", description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16, help="rows of the global training batch")
    parser.add_argument("--width", type=int, default=128, help="tokens per row")
    parser.add_argument("--sync-mb", type=int, default=512, help="size of the synced float32 state")
    args = parse_args(parser, argv, smoke={"repeats": 1, "rows": 4, "width": 32, "sync_mb": 8})

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    _register_sync_preset(args.sync_mb)
    console = Console()
    clients: list[Client] = []
    try:
        dp1 = Client(_config("tiny:bench", 1, 0, 0.5)).open()
        dp2 = Client(_config("tiny:bench", 2, 0, 0.5)).open()
        syncer = Client(_config(f"tiny:{_SYNC_PRESET}", 1, 1, 0.25)).open()
        clients += [dp1, dp2, syncer]

        batch = _batch(args.rows, args.width, len(TINY_PRESETS["bench"].alphabet) + 4)
        tokens = int(batch["kwargs"]["attention_mask"].sum())
        train_s: dict[str, list[float]] = {"DP=1": [], "DP=2": []}
        for client in (dp1, dp2):  # warm-up: first allocations, AdamW state
            client.fwd_bwd(batch)
            client.step()
        for round_index in range(args.repeats):
            order = [("DP=1", dp1), ("DP=2", dp2)]
            for name, client in order if round_index % 2 == 0 else order[::-1]:
                train_s[name].append(timed(lambda c=client: (c.fwd_bwd(batch), c.step())))

        handle = syncer.handle()["transport"]
        num_bytes = syncer.sync_weights()["bytes"]  # warm-up: staging buffers
        sync_s, raw_s = [], []
        for _ in range(args.repeats):
            sync_s.append(timed(syncer.sync_weights))
            raw_s.append(raw_broadcast_seconds(handle, num_bytes))
    finally:
        for client in clients:
            client.shutdown()
        ray.shutdown()

    tok_s = {name: tokens / statistics.median(times) for name, times in train_s.items()}
    gigabytes = num_bytes / 1e9
    sync_gbs, raw_gbs = gigabytes / statistics.median(sync_s), gigabytes / statistics.median(raw_s)
    table = Table(title=f"Ray backend on CPU ({args.repeats} interleaved repeats, medians)")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row(f"DP=1 train tokens/s ({tokens} tokens/step)", f"{tok_s['DP=1']:.0f}")
    table.add_row("DP=2 train tokens/s", f"{tok_s['DP=2']:.0f}")
    table.add_row(f"weight sync GB/s ({gigabytes:.2f} GB, sync_weights op end to end)", f"{sync_gbs:.2f}")
    table.add_row("raw torch.distributed broadcast GB/s (same bytes, same group)", f"{raw_gbs:.2f}")
    console.print(table)
    ratio = sync_gbs / raw_gbs
    speedup = tok_s["DP=2"] / tok_s["DP=1"]
    finish(
        args,
        f"bench=ray ratio={ratio:.3f} dp_speedup={speedup:.3f} sync_gbs={sync_gbs:.2f} raw_gbs={raw_gbs:.2f} "
        f"sync_bytes={num_bytes} repeats={args.repeats}",
    )
