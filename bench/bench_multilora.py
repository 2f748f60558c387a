"""Many LoRA runs on one base model: the memory and throughput of a shared host vs a host per run.

Every run is the public client (``AsyncClient``, remote backend) doing the same RL round against an
``icefloe serve`` subprocess on ``tiny:bench``: sample ``--prompts`` prompts x ``--group``, one
forward-backward over the samples, one step, one adapter sync (LoRA rank 8). Side by side:

* shared: ``--slots 1``; one run alone (the baseline) and N = 4, 16 runs at once attach to one host
  (one copy of the base); each N and the one run alone run ``--repeats`` times, interleaved in
  rotating order, each on a fresh service; rounds/s and memory are medians over the repeats;
* separate: 16 runs with ``--max-adapters 1`` and 16 slots, so each has a host of its own (once, one
  round: it sets the memory baseline only, and one round has built every optimizer state).

``ratio`` = ``mem_ratio`` = memory of the service and its engine processes with 16 shared runs / with
16 separate ones (RSS, as the operator's ``top`` shows it; ``pss_ratio`` counts pages shared between
processes once). ``throughput_ratio`` = rounds/s of 16 shared runs together / rounds/s of one run
alone. ``max_jobs`` = LoRA jobs one slot runs at once before the next waits for a slot (of
``--max-jobs-probe`` offered).

    python -m bench multilora [--runs 4 16] [--repeats 3] [--rounds 5] [--prompts 8] [--group 4] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from bench import finish, parse_args, serve
from icefloe.client import AsyncClient, build_batch
from icefloe.config import ClientConfig

_MODEL = "tiny:bench"
_PREFIX = "/api/v2/databases/BENCH/schemas/PUBLIC/cortex-training"


@dataclass
class _Result:
    runs: int
    seconds: float
    rounds: int
    rss_bytes: int
    pss_bytes: int

    @property
    def rounds_per_s(self) -> float:
        return self.rounds / self.seconds


def _memory() -> tuple[int, int]:
    """RSS and PSS of every process this one started (the service, its forkserver and engine processes)."""
    import psutil

    rss = pss = 0
    for process in psutil.Process(os.getpid()).children(recursive=True):
        try:
            info = process.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        pss += getattr(info, "pss", info.rss)
    return rss, pss


async def _run(
    base_url: str, prompts: list[list[int]], args: argparse.Namespace, ready: asyncio.Barrier, measured: asyncio.Event
) -> int:
    """One run: open its job, wait for the others, do ``--rounds`` RL rounds, and hold the job until
    memory has been read."""
    config = ClientConfig.build(
        model=_MODEL, lora={"rank": 8, "alpha": 8}, backend={"type": "remote", "base_url": base_url}
    )
    params = {"n": args.group, "max_tokens": args.max_tokens, "temperature": 1.0, "logprobs": True}
    async with AsyncClient(config) as client:
        await client.open()
        await ready.wait()  # every run is placed before any is timed
        for _ in range(args.rounds):
            samples = await client.generate(prompts, params)
            rewards = [sum(ch.isdigit() for ch in s["text"]) / max(len(s["text"]), 1) for s in samples]
            mean = sum(rewards) / len(rewards)
            batch = build_batch(
                [p for p in prompts for _ in range(args.group)], [s["token_ids"] for s in samples],
                [r - mean for r in rewards], pad_id=0, loss_fn="importance_sampling",
                old_logprobs=[s["logprobs"] for s in samples],
            )  # fmt: skip
            await asyncio.gather(client.fwd_bwd(batch), client.step(1e-4))
            await client.sync_weights()
        await ready.wait()
        await measured.wait()  # memory is read while every run still holds its job
    return args.rounds


async def _measure(base_url: str, runs: int, prompts: list[list[int]], args: argparse.Namespace) -> _Result:
    ready, measured = asyncio.Barrier(runs + 1), asyncio.Event()
    tasks = [asyncio.create_task(_run(base_url, prompts, args, ready, measured)) for _ in range(runs)]
    await _meet(ready, tasks)
    started = time.perf_counter()
    await _meet(ready, tasks)
    seconds = time.perf_counter() - started
    rss, pss = _memory()
    measured.set()
    rounds = sum(await asyncio.gather(*tasks))
    return _Result(runs, seconds, rounds, rss, pss)


async def _meet(ready: asyncio.Barrier, runs: list[asyncio.Task]) -> None:
    """Wait at the barrier; a run that failed instead of arriving raises its error here."""
    meeting = asyncio.ensure_future(ready.wait())
    done, _ = await asyncio.wait({meeting, *runs}, return_when=asyncio.FIRST_COMPLETED)
    for task in done - {meeting}:
        task.result()
    await meeting


def _max_jobs(base_url: str, probe: int) -> int:
    """How many LoRA jobs one slot runs at once: offer ``probe`` and count those running."""
    peft = {"peft_type": "Lora", "r": 8, "lora_alpha": 8}
    body = {"sub_job_configs": [
        {"job_type": "training", "model_name": _MODEL, "training_config": {"peft_config": peft}},
        {"job_type": "sampling", "model_name": _MODEL, "inference_config": {"peft_config": peft, "n_gpus": 0}},
    ]}  # fmt: skip
    with httpx.Client(base_url=base_url + _PREFIX, timeout=60) as http:
        job_ids = [http.post("/", json=body).json()["job_id"] for _ in range(probe)]
        deadline = time.monotonic() + 300
        while True:
            states = [http.get(f"/{job_id}").json()["status"] for job_id in job_ids]
            settled = all(state in ("running", "placing") for state in states)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        for job_id in job_ids:
            http.post(f"/{job_id}:cancel")
    return states.count("running")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench multilora", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[4, 16], help="shared runs at once, besides one alone")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each count, interleaved")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-jobs-probe", type=int, default=40, help="LoRA jobs offered to one slot")
    smoke = {"runs": [2], "repeats": 1, "rounds": 1, "prompts": 2, "group": 2, "max_tokens": 4, "max_jobs_probe": 3}
    args = parse_args(parser, argv, smoke=smoke)
    if min(args.runs) < 1 or args.repeats < 1 or args.max_jobs_probe < 1:
        parser.error("--runs, --repeats and --max-jobs-probe must be >= 1")
    counts = sorted({1, *args.runs})  # one run alone is the throughput baseline
    most = counts[-1]
    prompts = [[ord(ch) - 31 for ch in f"Q: {i} + {i + 3} = ?"] for i in range(args.prompts)]  # printable ids

    def measure(*flags: str, runs: int, rounds: int = args.rounds) -> _Result:
        # Engine processes get torch's default threads: an operator's server uses every core it has.
        with (
            tempfile.TemporaryDirectory(prefix="bench-multilora-") as tmp,
            serve(Path(tmp), *flags, threads=None) as url,
        ):
            return asyncio.run(_measure(url, runs, prompts, argparse.Namespace(**{**vars(args), "rounds": rounds})))

    measured: dict[int, list[_Result]] = {runs: [] for runs in counts}
    for repeat in range(args.repeats):
        for runs in counts[repeat % len(counts) :] + counts[: repeat % len(counts)]:
            measured[runs].append(measure("--slots", "1", runs=runs))
    shared = {runs: _median(results) for runs, results in measured.items()}
    # Hosts of their own only set the memory baseline: one round has built every optimizer state.
    separate = measure("--slots", str(most), "--max-adapters", "1", runs=most, rounds=1)
    with tempfile.TemporaryDirectory(prefix="bench-multilora-") as tmp, serve(Path(tmp), "--slots", "1") as url:
        max_jobs = _max_jobs(url, args.max_jobs_probe)

    table = Table("runs", "hosts", "rounds/s", "s per round per run", "RSS (MB)", "PSS (MB)", title="multilora")
    for label, result in [*(("shared", r) for r in shared.values()), ("separate", separate)]:
        table.add_row(
            str(result.runs), "1" if label == "shared" else str(result.runs), f"{result.rounds_per_s:.2f}",
            f"{result.seconds * result.runs / result.rounds:.3f}", f"{result.rss_bytes / 2**20:.0f}",
            f"{result.pss_bytes / 2**20:.0f}",
        )  # fmt: skip
    Console().print(table)
    top, alone = shared[most], shared[1]
    mem_ratio = top.rss_bytes / separate.rss_bytes
    finish(
        args,
        f"bench=multilora ratio={mem_ratio:.3f} jobs={most} mem_ratio={mem_ratio:.3f} "
        f"pss_ratio={top.pss_bytes / separate.pss_bytes:.3f} "
        f"throughput_ratio={top.rounds_per_s / alone.rounds_per_s:.2f} max_jobs={max_jobs} "
        f"rounds={args.rounds} prompts={args.prompts} group={args.group} max_tokens={args.max_tokens} "
        f"repeats={args.repeats}",
    )


def _median(results: list[_Result]) -> _Result:
    """One result of the median rounds/s, RSS and PSS of ``results`` (each median taken on its own)."""
    rates = [r.rounds_per_s for r in results]
    rounds = results[0].rounds
    return _Result(
        results[0].runs, rounds / statistics.median(rates), rounds,
        round(statistics.median(r.rss_bytes for r in results)), round(statistics.median(r.pss_bytes for r in results)),
    )  # fmt: skip
