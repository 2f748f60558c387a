"""Fair share on a shared host: run B's small ops alone vs while run A floods the same host.

Two LoRA runs (training + sampling sub-jobs, ``tiny:bench``) attach to one host of an ``icefloe
serve`` subprocess (``--slots 1``), each through the public client (``AsyncClient``, remote backend).
Side by side in one run, B's latency is measured ``--repeats`` times alone, then as many times while A
keeps the host busy:

* sample: B samples one prompt for 4 tokens while A keeps ``--flood-samples`` generates of
  ``--flood-rows`` prompts x ``--flood-tokens`` tokens in flight;
* forward_backward: B runs an 8-token forward_backward while A keeps three forward_backwards of
  ``--flood-fwd-tokens`` tokens each in flight.

``sample_ratio`` and ``fwd_bwd_ratio`` = B's median latency under A's flood / alone (1 = A costs B
nothing; before the host ran ops in slices, a small op waited for whole decode batches and passes).
``ratio`` is the larger of the two.

    python -m bench fairness [--repeats 5] [--flood-samples 8] [--flood-rows 64] [--flood-tokens 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, serve
from icefloe.client import AsyncClient, build_batch
from icefloe.config import ClientConfig

_MODEL = "tiny:bench"
_MAX_SEQ_LEN = 512
_PROMPT = [ord(ch) - 31 for ch in "Q: 2 + 5 = ?"]  # printable ids


def _client(base_url: str) -> AsyncClient:
    config = ClientConfig.build(
        model=_MODEL, max_seq_len=_MAX_SEQ_LEN, lora={"rank": 8, "alpha": 8},
        backend={"type": "remote", "base_url": base_url},
    )  # fmt: skip
    return AsyncClient(config)


def _batch(num_rows: int, num_tokens: int) -> dict[str, Any]:
    """``num_rows`` rows of ``num_tokens`` tokens each (half prompt, half response)."""
    half = max(1, num_tokens // 2)
    prompts = [[(row + i) % 60 + 1 for i in range(half)] for row in range(num_rows)]
    responses = [[(row * 7 + i) % 60 + 1 for i in range(num_tokens - half)] for row in range(num_rows)]
    return build_batch(prompts, responses, [1.0 if row % 2 else -1.0 for row in range(num_rows)], pad_id=0)


async def _latencies(op: Callable[[], Awaitable[Any]], repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        await op()
        seconds.append(time.perf_counter() - started)
    return seconds


@contextlib.asynccontextmanager
async def _flood(num_tasks: int, op: Callable[[], Awaitable[Any]]):
    """``num_tasks`` copies of ``op`` kept in flight until the block ends (then the ones running finish)."""
    stop = asyncio.Event()
    started = asyncio.Event()

    async def keep_going() -> None:
        while not stop.is_set():
            started.set()
            await op()

    tasks = [asyncio.create_task(keep_going()) for _ in range(num_tasks)]
    await started.wait()
    await asyncio.sleep(0.5)  # the flood's first ops reach the host before B's
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def _measure(base_url: str, args: argparse.Namespace) -> dict[str, tuple[list[float], list[float]]]:
    async with _client(base_url) as flood, _client(base_url) as small:
        await asyncio.gather(flood.open(), small.open())
        sample_params = {"max_tokens": 4, "temperature": 1.0, "ignore_eos": True}
        flood_params = {"max_tokens": args.flood_tokens, "temperature": 1.0, "ignore_eos": True}
        tiny_batch = _batch(1, 8)
        rows = max(1, args.flood_fwd_tokens // args.flood_row_tokens)
        flood_batch = _batch(rows, args.flood_row_tokens)

        def sample() -> Awaitable[Any]:
            return small.generate([_PROMPT], sample_params)

        def fwd_bwd() -> Awaitable[Any]:
            return small.fwd_bwd(tiny_batch)

        await sample()  # warm both paths up
        await fwd_bwd()
        measured: dict[str, tuple[list[float], list[float]]] = {}
        alone = await _latencies(sample, args.repeats)
        async with _flood(args.flood_samples, lambda: flood.generate([_PROMPT] * args.flood_rows, flood_params)):
            loaded = await _latencies(sample, args.repeats)
        measured["sample"] = (alone, loaded)
        alone = await _latencies(fwd_bwd, args.repeats)
        async with _flood(3, lambda: flood.fwd_bwd(flood_batch)):
            loaded = await _latencies(fwd_bwd, args.repeats)
        measured["fwd_bwd"] = (alone, loaded)
        return measured


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench fairness", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="B's ops timed alone, and as many under the flood")
    parser.add_argument("--flood-samples", type=int, default=8, help="A's generates kept in flight")
    parser.add_argument("--flood-rows", type=int, default=64, help="prompts per generate of A")
    parser.add_argument("--flood-tokens", type=int, default=200, help="max_tokens of A's generates")
    parser.add_argument("--flood-fwd-tokens", type=int, default=16384, help="tokens per forward_backward of A")
    parser.add_argument("--flood-row-tokens", type=int, default=256, help="tokens per row of A's forward_backwards")
    smoke = {"repeats": 2, "flood_samples": 2, "flood_rows": 4, "flood_tokens": 16, "flood_fwd_tokens": 512,
             "flood_row_tokens": 64}  # fmt: skip
    args = parse_args(parser, argv, smoke=smoke)
    if min(args.repeats, args.flood_samples, args.flood_rows, args.flood_tokens, args.flood_row_tokens) < 1:
        parser.error("--repeats and every --flood-* size must be >= 1")
    if args.flood_row_tokens > _MAX_SEQ_LEN or args.flood_tokens + len(_PROMPT) > _MAX_SEQ_LEN:
        parser.error(f"--flood-row-tokens and --flood-tokens must fit max_seq_len={_MAX_SEQ_LEN}")
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp, serve(Path(tmp), "--slots", "1") as url:
        measured = asyncio.run(_measure(url, args))

    table = Table("B's op", "alone (s, median)", "under A's flood (s, median)", "ratio", title="fairness")
    ratios = {}
    for name, (alone, loaded) in measured.items():
        alone_s, loaded_s = statistics.median(alone), statistics.median(loaded)
        ratios[name] = loaded_s / alone_s
        table.add_row(name, f"{alone_s:.3f}", f"{loaded_s:.3f}", f"{ratios[name]:.2f}")
    Console().print(table)
    finish(
        args,
        f"bench=fairness ratio={max(ratios.values()):.2f} sample_ratio={ratios['sample']:.2f} "
        f"fwd_bwd_ratio={ratios['fwd_bwd']:.2f} repeats={args.repeats} flood_samples={args.flood_samples} "
        f"flood_rows={args.flood_rows} flood_tokens={args.flood_tokens} flood_fwd_tokens={args.flood_fwd_tokens}",
    )
