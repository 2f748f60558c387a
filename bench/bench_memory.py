"""Memory, padding and speed of a real-sized forward_backward on ``icefloe serve`` (tiny:bench).

One ``icefloe serve`` subprocess; the Tinker SDK sends a LoRA ``forward_backward`` of ``--rows``
datums whose lengths are drawn (``--seed``) between ``--low`` and ``--high`` tokens, as an RL
cookbook recipe does, after one of a single ``--high``-token datum. The engine process's peak
RSS is read per step (Linux: ``VmHWM``, reset before each step through ``/proc/PID/clear_refs``).

    peak_ratio    = peak RSS during the batch step ÷ peak RSS during the one-row step (target ≤ 2)
    padding_ratio = positions computed ÷ real tokens of the batch step (target ≤ 1.1)
    speedup       = one pass over the padded batch (``micro_batch_tokens=0``, the old path) ÷ the
                    default micro-batches, the same step through the training API, interleaved
                    ``--repeats`` times (the side that goes first alternating), medians of the engine
                    process's CPU seconds (one torch thread: its wall time on an idle machine; other
                    load on a shared machine does not inflate it); wall_speedup too. ``ratio`` = speedup.

The two peaks are read once, one row first: an engine process keeps memory it has touched, so a
one-row step after the batch would read the batch's peak again. The speedup runs on a second
``icefloe serve`` with ``--max-adapters 1``, so each side's job has an engine process of its own
(LoRA jobs otherwise share their base model's host) whose CPU seconds are that side's alone.

The one padded pass of all 80 rows needs about 20 GB, more than a 24 GB machine shared with
other work can give, so the speedup runs on ``--speedup-rows`` rows of the batch (every k-th
by length, the longest included, so the padded width is the batch's); ``--speedup-rows 80``
runs the whole batch where memory allows. Each step's cost grows with its rows alike in both
paths, so the ratio carries over.

    python -m bench memory [--rows 80] [--low 100] [--high 1700] [--seed 0] [--speedup-rows 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench import descendant_pids, finish, parse_args, proc_cpu_seconds, proc_status_kib, serve
from icefloe.client import Client, build_batch
from icefloe.config import ClientConfig

API_KEY = "tml-bench"  # the SDK wants a key; the service runs without auth here
LORA_RANK = 32  # the SDK's default rank
_FIRST_TOKEN = 4  # ids below are the tiny tokenizer's special tokens


def _engine_pid(before: set[int]) -> int:
    """The engine process a job started since ``before`` (the largest new process below this one): the
    job must have a host of its own, not one a running job started."""
    started = descendant_pids(os.getpid()) - before
    if not started:
        raise RuntimeError("the job started no engine process: it joined a running host")
    return max(started, key=lambda pid: proc_status_kib(pid, "VmRSS"))


# --- steps and batches ---------------------------------------------------------------------------
def _peak_during(pid: int, run: Any) -> tuple[float, int]:
    """Seconds ``run()`` takes and the process's peak RSS in bytes meanwhile."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
    started = time.perf_counter()
    run()
    return time.perf_counter() - started, proc_status_kib(pid, "VmHWM") * 1024


def _sequences(rows: int, low: int, high: int, seed: int, vocab: int) -> list[list[int]]:
    """Token lists of lengths drawn in ``[low, high]``; the first is ``high`` long, so every draw pads to it."""
    rng = random.Random(seed)
    lengths = [high] + [rng.randint(low, high) for _ in range(rows - 1)]
    return [[rng.randrange(_FIRST_TOKEN, vocab) for _ in range(length + 1)] for length in lengths]


def _datums(types: Any, sequences: list[list[int]], seed: int) -> list[Any]:
    """RL datums of the Tinker cookbook's shape: the sequence, its targets, sampler log-probs, advantages."""
    rng = random.Random(seed)
    data = []
    for tokens in sequences:
        advantage = rng.uniform(-1, 1)
        inputs = {
            "target_tokens": tokens[1:],
            "logprobs": [-4.5 + rng.uniform(-0.1, 0.1) for _ in tokens[1:]],
            "advantages": [advantage] * (len(tokens) - 1),
        }
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    return data


def _subset(sequences: list[list[int]], count: int) -> list[list[int]]:
    """``count`` sequences spread evenly over the length order, the longest first."""
    ordered = sorted(sequences, key=len, reverse=True)
    stride = max(1, len(ordered) // max(count, 1))
    return ordered[::stride][:count]


def _client(base_url: str, model: str, budget: int | None) -> Client:
    """A training-API client whose engine uses ``budget`` (None = the default; 0 = one padded pass)."""
    config = ClientConfig.build(
        model=model, num_sampling_workers=0, max_seq_len=2048, lora={"rank": LORA_RANK, "alpha": LORA_RANK},
        training={"micro_batch_tokens": budget}, backend={"type": "remote", "base_url": base_url},
    )  # fmt: skip
    return Client(config).open()


def _canonical(sequences: list[list[int]], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    responses = [tokens[1:] for tokens in sequences]
    return build_batch(
        [tokens[:1] for tokens in sequences], responses, [rng.uniform(-1, 1) for _ in sequences], pad_id=0,
        loss_fn="importance_sampling", old_logprobs=[[-4.5] * len(r) for r in responses],
        loss_config={"loss_agg_mode": "token-sum"},
    )  # fmt: skip


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=80)
    parser.add_argument("--low", type=int, default=100)
    parser.add_argument("--high", type=int, default=1700)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--speedup-rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the speedup")
    smoke = {"rows": 4, "low": 16, "high": 64, "speedup_rows": 2, "repeats": 1}
    args = parse_args(parser, argv, smoke=smoke)
    if (
        not 1 <= args.low <= args.high <= 2000
        or args.rows < 1
        or not 1 <= args.speedup_rows <= args.rows
        or args.repeats < 1
    ):
        parser.error("need 1 <= --low <= --high <= 2000 (tiny:bench has 2048 positions), --rows >= 1, "
                     "1 <= --speedup-rows <= --rows, --repeats >= 1")  # fmt: skip
    if not Path("/proc/self/clear_refs").exists():
        parser.error("this benchmark reads peak RSS from /proc (Linux)")

    import tinker
    from tinker import types

    from icefloe.cli import _quiet_transformers
    from icefloe.engines.models import load_tokenizer, resolve_model

    _quiet_transformers()
    console = Console()
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        model = str(Path(tmp) / "models" / "tiny-bench")
        shutil.copytree(resolve_model("tiny:bench"), model)
        vocab = len(load_tokenizer(model))
        sequences = _sequences(args.rows, args.low, args.high, args.seed, vocab)
        real_tokens = sum(len(tokens) - 1 for tokens in sequences)
        with serve(Path(tmp) / "serve", "--model-root", str(Path(tmp) / "models")) as base_url:
            # The Tinker SDK: one long row, then the whole batch, on one engine process.
            service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
            before = descendant_pids(os.getpid())
            training = service.create_lora_training_client(base_model=model, rank=LORA_RANK).result()
            training.forward_backward(_datums(types, [sequences[0][:64]], args.seed), "importance_sampling").result()
            engine_pid = _engine_pid(before)

            def step(data: list[Any]) -> Any:
                return lambda: outputs.append(training.forward_backward(data, "importance_sampling").result())

            outputs: list[Any] = []
            console.print(f"one row of {len(sequences[0]) - 1} tokens, then {args.rows} rows ({real_tokens} tokens)")
            one_s, one_peak = _peak_during(engine_pid, step(_datums(types, sequences[:1], args.seed)))
            batch_s, batch_peak = _peak_during(engine_pid, step(_datums(types, sequences, args.seed)))
            padding_ratio = outputs[-1].metrics["padding_ratio:mean"]
            service.close("success").result()

        # The old path against the default, interleaved on the same rows, through the training API.
        subset = _subset(sequences, args.speedup_rows)
        console.print(f"speedup on {len(subset)} rows: one padded pass vs micro-batches, {args.repeats} rounds")
        batch = _canonical(subset, args.seed)
        clients: dict[str, Client] = {}
        pids: dict[str, int] = {}
        wall: dict[str, list[float]] = {"one pass": [], "micro-batches": []}
        cpu: dict[str, list[float]] = {"one pass": [], "micro-batches": []}
        with serve(
            Path(tmp) / "serve-speedup", "--model-root", str(Path(tmp) / "models"), "--max-adapters", "1"
        ) as url:
            try:
                for name, budget in (("micro-batches", None), ("one pass", 0)):
                    before = descendant_pids(os.getpid())
                    clients[name] = _client(url, model, budget)
                    clients[name].fwd_bwd(_canonical(subset[:1], args.seed))  # the engine is up and warm
                    pids[name] = _engine_pid(before)
                for repeat in range(args.repeats):
                    for name in sorted(clients, reverse=repeat % 2 == 1):  # who goes first alternates
                        cpu_before, started = proc_cpu_seconds(pids[name]), time.perf_counter()
                        clients[name].fwd_bwd(batch)
                        wall[name].append(time.perf_counter() - started)
                        cpu[name].append(proc_cpu_seconds(pids[name]) - cpu_before)
            finally:
                for client in clients.values():
                    client.shutdown()
    wall_s = {name: statistics.median(values) for name, values in wall.items()}
    cpu_s = {name: statistics.median(values) for name, values in cpu.items()}

    table = Table("step", "rows", "seconds", "engine CPU seconds", "engine peak RSS (MB)", title="forward_backward")
    table.add_row("one row (SDK)", "1", f"{one_s:.1f}", "", f"{one_peak / 2**20:.0f}")
    table.add_row("batch (SDK)", str(args.rows), f"{batch_s:.1f}", "", f"{batch_peak / 2**20:.0f}")
    for name in ("one pass", "micro-batches"):
        table.add_row(
            f"{name} (training API, median)", str(len(subset)), f"{wall_s[name]:.1f}", f"{cpu_s[name]:.1f}", ""
        )
    console.print(table)
    speedup = cpu_s["one pass"] / cpu_s["micro-batches"]
    finish(
        args,
        f"bench=memory ratio={speedup:.2f} peak_ratio={batch_peak / one_peak:.2f} padding_ratio={padding_ratio:.3f} "
        f"speedup={speedup:.2f} wall_speedup={wall_s['one pass'] / wall_s['micro-batches']:.2f} "
        f"rows={args.rows} real_tokens={real_tokens} batch_peak_mb={batch_peak / 2**20:.0f} "
        f"one_row_peak_mb={one_peak / 2**20:.0f} batch_step_s={batch_s:.1f} speedup_rows={len(subset)} "
        f"one_pass_cpu_s={cpu_s['one pass']:.1f} micro_batches_cpu_s={cpu_s['micro-batches']:.1f} "
        f"repeats={args.repeats}",
    )
