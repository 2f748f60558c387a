"""Many clients on one job: throughput, latency and exactly-once under load.

N clients (``--clients``, default 16 then 64) share one training job on an ``icefloe serve``
subprocess, spread over four client processes, and each runs cheap ops back to back for
``--seconds``: a ``forward`` of a one-row batch, posted with ``?wait=`` and polled until it ends.
Every accepted request is read back at the end; ``lost`` counts those not in a final state (it
must be 0). ``ratio`` = ops/s at the
largest N ÷ ops/s at the smallest: how throughput holds up as clients multiply.

``--api tinker``: the Tinker SDK's clients instead, then a kill -9 of the service and a restart
(:mod:`bench.tinker_load`; defaults 16 clients for 60 s).

    python -m bench load [--clients 16 64] [--seconds 8]
    python -m bench load --api tinker [--clients 16] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import serve
from icefloe import wire
from icefloe.client import build_batch

_PREFIX = "/api/v2/databases/BENCH/schemas/PUBLIC/cortex-training"
_FINAL = ("done", "failed", "cancelled")
_OCTET = {"Content-Type": "application/octet-stream"}
_PROCESSES = 4  # client processes the clients are spread over


@dataclass
class _Run:
    clients: int
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    accepted: list[str] = field(default_factory=list)
    errors: int = 0
    lost: int = 0

    @property
    def ops_per_s(self) -> float:
        return len(self.latencies_ms) / self.seconds


async def _client(http: httpx.AsyncClient, job_id: str, frame: bytes, stop_at: float, run: _Run) -> None:
    while time.monotonic() < stop_at:
        started = time.perf_counter()
        try:
            answer = await http.post(f"/{job_id}/forward", content=frame, params={"wait": 30}, headers=_OCTET)
            answer.raise_for_status()
            body = answer.json()
            run.accepted.append(body["request_id"])
            while body["status"] not in _FINAL:
                polled = await http.get(f"/{job_id}/requests/{body['request_id']}", params={"wait": 30})
                polled.raise_for_status()
                body = polled.json()
        except httpx.HTTPError:
            run.errors += 1
            continue
        if body["status"] != "done":
            run.errors += 1
            continue
        run.latencies_ms.append((time.perf_counter() - started) * 1000)


async def _load(base_url: str, job_id: str, clients: int, seconds: float) -> _Run:
    frame = wire.encode(build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0))
    run = _Run(clients)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base_url + _PREFIX, timeout=60, limits=limits) as http:
        started = time.monotonic()
        await asyncio.gather(*(_client(http, job_id, frame, started + seconds, run) for _ in range(clients)))
        run.seconds = time.monotonic() - started
    return run


def _load_in_process(base_url: str, job_id: str, clients: int, seconds: float) -> _Run:
    return asyncio.run(_load(base_url, job_id, clients, seconds))


def _measure(pool: ProcessPoolExecutor, base_url: str, job_id: str, clients: int, seconds: float) -> _Run:
    """``clients`` clients spread over the pool's processes (one Python process cannot keep 64 busy),
    then every accepted request read back: ``lost`` counts those not in a final state."""
    shares = [clients // _PROCESSES + (i < clients % _PROCESSES) for i in range(_PROCESSES)]
    parts = [pool.submit(_load_in_process, base_url, job_id, n, seconds) for n in shares if n]
    run = _Run(clients)
    for part in (future.result() for future in parts):
        run.seconds = max(run.seconds, part.seconds)
        run.latencies_ms += part.latencies_ms
        run.accepted += part.accepted
        run.errors += part.errors
    with httpx.Client(base_url=base_url + _PREFIX, timeout=60) as http:
        for request_id in run.accepted:
            run.lost += http.get(f"/{job_id}/requests/{request_id}").json()["status"] not in _FINAL
    return run


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples) or [float("nan")]
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench load", description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("training", "tinker"), default="training", help="which API the clients use")
    parser.add_argument("--clients", type=int, nargs="+", default=None, help="concurrent clients, one run each")
    parser.add_argument("--seconds", type=float, default=None, help="how long each run keeps its clients busy")
    args = parser.parse_args(argv)
    if args.api == "tinker":
        from bench.tinker_load import run

        args.clients, args.seconds = args.clients or [16], args.seconds or 60.0
        run(args)
        return
    args.clients, args.seconds = args.clients or [16, 64], args.seconds or 8.0

    with (
        tempfile.TemporaryDirectory(prefix="icefloe-bench-") as tmp,
        serve(Path(tmp)) as base_url,
        httpx.Client(base_url=base_url + _PREFIX, timeout=60) as http,
    ):
        sub_job = {"job_type": "training", "model_name": "tiny:arith"}
        job_id = http.post("/", json={"sub_job_configs": [sub_job]}).json()["job_id"]
        deadline = time.monotonic() + 300
        while (status := http.get(f"/{job_id}").json()["status"]) != "running":
            if status in ("failed", "cancelled", "terminated") or time.monotonic() > deadline:
                raise RuntimeError(f"benchmark job is {status}")
            time.sleep(0.1)
        with ProcessPoolExecutor(_PROCESSES) as pool:
            _measure(pool, base_url, job_id, _PROCESSES, 1.0)  # warm up: the processes, the engine's first calls
            runs = [_measure(pool, base_url, job_id, n, args.seconds) for n in args.clients]
        http.post(f"/{job_id}:cancel")

    print(f"{'clients':>8}{'ops':>8}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'lost':>6}")
    for run in runs:
        p50, p99 = _percentile(run.latencies_ms, 50), _percentile(run.latencies_ms, 99)
        print(
            f"{run.clients:>8}{len(run.latencies_ms):>8}{run.ops_per_s:>10.1f}{p50:>10.1f}{p99:>10.1f}"
            f"{run.errors:>8}{run.lost:>6}"
        )
    first, last = runs[0], runs[-1]
    p50, p99 = _percentile(last.latencies_ms, 50), _percentile(last.latencies_ms, 99)
    print(
        f"bench=load ratio={last.ops_per_s / first.ops_per_s:.2f} lost={sum(r.lost for r in runs)} "
        f"errors={sum(r.errors for r in runs)} ops_s_{first.clients}={first.ops_per_s:.1f} "
        f"ops_s_{last.clients}={last.ops_per_s:.1f} p50_ms_{last.clients}={p50:.1f} p99_ms_{last.clients}={p99:.1f}"
    )
