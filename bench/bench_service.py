"""Latency of a trivial op over ``icefloe serve`` versus the same op called on the engine in-process.

Baseline: ``TrainingEngine.step()`` on a tiny model, called directly. Candidate: the same step
submitted over HTTP (``POST {job}/step``) to a real uvicorn on loopback and awaited with one
long-poll (``GET {job}/requests/{id}?wait=30``), through one keep-alive httpx client. The two run
interleaved, one call each per round, so machine noise hits both alike. The difference of the
medians is what the service adds: HTTP, JSON, SQLite records, the FIFO worker hop, the wake-up.
A step needs gradients, so each round first runs an untimed ``fwd_bwd`` on both sides.

    python -m bench service [--iters 300] [--warmup 30] [--model tiny:arith]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench import finish, parse_args

_PREFIX = "/api/v2/databases/BENCH/schemas/PUBLIC/cortex-training"


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _http_step(client, job_id: str) -> None:
    accepted = client.post(f"{_PREFIX}/{job_id}/step", json={})
    accepted.raise_for_status()
    request_id = accepted.json()["request_id"]
    while True:
        polled = client.get(f"{_PREFIX}/{job_id}/requests/{request_id}", params={"wait": 30})
        polled.raise_for_status()
        status = polled.json()["status"]
        if status == "done":
            return
        if status in ("failed", "cancelled"):
            raise RuntimeError(f"step {request_id} {status}: {polled.json()['error']}")


def _http_fwd_bwd(client, job_id: str, frame: bytes) -> None:
    headers = {"Content-Type": "application/octet-stream"}
    accepted = client.post(f"{_PREFIX}/{job_id}/forward-backward", content=frame, params={"wait": 30}, headers=headers)
    accepted.raise_for_status()
    if accepted.json().get("status") != "done":
        raise RuntimeError(f"forward-backward did not finish: {accepted.json()}")


def _wait_running(client, job_id: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        job = client.get(f"{_PREFIX}/{job_id}").json()
        if job["status"] == "running":
            return
        if job["status"] in ("failed", "cancelled", "terminated") or time.monotonic() > deadline:
            raise RuntimeError(f"benchmark job is {job['status']}: {job['reason']}")
        time.sleep(0.05)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench service", description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300, help="measured rounds (one call of each per round)")
    parser.add_argument("--warmup", type=int, default=30, help="unmeasured rounds first")
    parser.add_argument("--model", default="tiny:arith")
    args = parse_args(parser, argv, smoke={"iters": 10, "warmup": 2})

    import httpx
    import torch

    from icefloe import wire
    from icefloe.client.batch import build_batch
    from icefloe.config import ClientConfig
    from icefloe.engines.training import TrainingEngine
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.hosts.slots import SlotPool
    from icefloe.service.settings import ServeSettings

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the service's engine process too: both sides step on one thread
    engine = TrainingEngine(ClientConfig(model=args.model), device="cpu")
    batch = build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0)
    frame = wire.encode(batch)
    with tempfile.TemporaryDirectory(prefix="icefloe-bench-") as tmp:
        app = create_app(ServeSettings(data_dir=Path(tmp)), pool=SlotPool("cpu", 2))
        with ServerThread(app) as base_url, httpx.Client(base_url=base_url, timeout=60) as client:
            sub_job = {"job_type": "training", "model_name": args.model}
            job_id = client.post(f"{_PREFIX}/", json={"sub_job_configs": [sub_job]}).json()["job_id"]
            _wait_running(client, job_id)
            in_process_ms: list[float] = []
            http_ms: list[float] = []
            for round_index in range(args.warmup + args.iters):
                engine.fwd_bwd(batch)
                _http_fwd_bwd(client, job_id, frame)
                started = time.perf_counter()
                engine.step()
                local = (time.perf_counter() - started) * 1000
                started = time.perf_counter()
                _http_step(client, job_id)
                remote = (time.perf_counter() - started) * 1000
                if round_index >= args.warmup:
                    in_process_ms.append(local)
                    http_ms.append(remote)
            client.post(f"{_PREFIX}/{job_id}:cancel")

    rows = [("in-process engine.step()", in_process_ms), ("HTTP step + long-poll", http_ms)]
    print(f"{'variant':<28}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}   n={args.iters}")
    for name, samples in rows:
        p50, p99 = _percentile(samples, 50), _percentile(samples, 99)
        print(f"{name:<28}{p50:>10.3f}{p99:>10.3f}{statistics.fmean(samples):>10.3f}")
    base_p50, http_p50 = _percentile(in_process_ms, 50), _percentile(http_ms, 50)
    overhead = http_p50 - base_p50
    p99_overhead = _percentile(http_ms, 99) - _percentile(in_process_ms, 99)
    finish(
        args,
        f"bench=service ratio={http_p50 / base_p50:.2f} overhead_ms={overhead:.3f} p99_overhead_ms={p99_overhead:.3f}",
    )
