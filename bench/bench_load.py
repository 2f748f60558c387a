"""Many clients on one job: throughput, latency and exactly-once under load.

N clients (``--clients``, default 16 then 64) share one training job on an ``icefloe serve``
subprocess, spread over four client processes, and each runs cheap ops back to back for
``--seconds``: a ``forward`` of a one-row batch, posted with ``?wait=`` and polled until it ends.
Every accepted request is read back at the end; ``lost`` counts those not in a final state (it
must be 0). Each N runs ``--repeats`` times, the Ns interleaved (rotating order) so machine noise
hits them alike; ops/s is the median over the repeats, p50/p99 over every op of that N. ``ratio`` =
ops/s at the largest N ÷ ops/s at the smallest: how throughput holds up as clients multiply.

``--api tinker``: the Tinker SDK's clients instead, then a kill -9 of the service and a restart
(:mod:`bench.tinker_load`; defaults 16 clients for 60 s; ``ratio`` = saves that load ÷ saves).

    python -m bench load [--clients 16 64] [--seconds 8] [--repeats 3]
    python -m bench load --api tinker [--clients 16] [--seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench import finish, parse_args, serve
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
    parser.add_argument("--repeats", type=int, default=3, help="runs of each client count, interleaved")
    args = parse_args(parser, argv, smoke={"clients": [2, 4], "seconds": 1.0, "repeats": 1})
    if args.api == "tinker":
        from bench.tinker_load import run

        args.clients, args.seconds = args.clients or [16], args.seconds or 60.0
        run(args)
        return
    args.clients, args.seconds = sorted(set(args.clients or [16, 64])), args.seconds or 8.0
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1; got {args.repeats}")

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
            runs: dict[int, list[_Run]] = {n: [] for n in args.clients}
            for repeat in range(args.repeats):
                order = args.clients[repeat % len(args.clients) :] + args.clients[: repeat % len(args.clients)]
                for n in order:
                    runs[n].append(_measure(pool, base_url, job_id, n, args.seconds))
        http.post(f"/{job_id}:cancel")

    ops_s = {n: statistics.median(run.ops_per_s for run in done) for n, done in runs.items()}
    latencies = {n: [ms for run in done for ms in run.latencies_ms] for n, done in runs.items()}
    header = f"{'clients':>8}{'ops':>8}{'ops/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'errors':>8}{'lost':>6}"
    print(f"{header}   ops/s: median of {args.repeats}")
    for n, done in runs.items():
        p50, p99 = _percentile(latencies[n], 50), _percentile(latencies[n], 99)
        print(
            f"{n:>8}{len(latencies[n]):>8}{ops_s[n]:>10.1f}{p50:>10.1f}{p99:>10.1f}"
            f"{sum(r.errors for r in done):>8}{sum(r.lost for r in done):>6}"
        )
    least, most = args.clients[0], args.clients[-1]
    every = [run for done in runs.values() for run in done]
    finish(
        args,
        f"bench=load ratio={ops_s[most] / ops_s[least]:.2f} lost={sum(r.lost for r in every)} "
        f"errors={sum(r.errors for r in every)} ops_s_{least}={ops_s[least]:.1f} ops_s_{most}={ops_s[most]:.1f} "
        f"p50_ms_{most}={_percentile(latencies[most], 50):.1f} p99_ms_{most}={_percentile(latencies[most], 99):.1f} "
        f"clients={','.join(map(str, args.clients))} seconds={args.seconds:g} repeats={args.repeats}",
    )
