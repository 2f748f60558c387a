"""``/health`` latency of ``icefloe serve`` while hostile bodies arrive, against the same service idle.

Baseline: ``GET /health`` in a loop while a process that only sleeps runs. Candidate: the same loop
while another process POSTs one hostile body after another (a create-job of 650,000 sub-jobs, a
``requests:batch`` head of 54 MiB, a deeply nested head, a DSSST1 frame whose header declares 53 MiB
of plain values, a far-ahead ``Icefloe-Sequence``). Idle and hostile windows alternate, so machine
noise hits both alike. Every body must be refused with a 4xx; ratio = hostile median / idle median.

    python -m bench hostile [--rounds 3] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_PREFIX = "/api/v2/databases/BENCH/schemas/PUBLIC/cortex-training"
_SENDER = """
import httpx, json, sys
statuses = []
with httpx.Client(timeout=120) as http:
    for line in open(sys.argv[2]):
        case = json.loads(line)
        body = open(case["file"], "rb").read()
        answer = http.post(sys.argv[1] + case["path"], content=body, headers=case["headers"])
        statuses.append([case["name"], answer.status_code, len(answer.content)])
print(json.dumps(statuses))
"""


def _bodies(folder: Path, scale: float, job_id: str) -> list[dict]:
    """The hostile cases as files; ``scale`` shrinks the large ones (--smoke)."""
    head = b"[" + b",".join([b'{"size":0,"method":"POST","path":"/x"}'] * int(1_500_000 * scale)) + b"]"
    values = b",".join([b"0"] * int(28_000_000 * scale))
    header = b'{"__metadata__":{"dss":"{\\"v\\":\\"DSSST1\\",\\"tree\\":[\\"j\\",[' + values + b']]}"}}'
    deep = b"[" * 5000 + b"]" * 5000
    octet, batch = {"Content-Type": "application/octet-stream"}, {"Content-Type": "application/x-icefloe-batch"}
    cases = {
        "sub_jobs": (f"{_PREFIX}/", b'{"sub_job_configs": [' + b",".join([b"{}"] * 650_000) + b"]}",
                     {"Content-Type": "application/json"}),
        "batch_head": (f"{_PREFIX}/requests:batch", struct.pack(">I", len(head)) + head, batch),
        "deep_head": (f"{_PREFIX}/requests:batch", struct.pack(">I", len(deep)) + deep, batch),
        "plain_values": (f"{_PREFIX}/{job_id}/forward-backward", struct.pack("<Q", len(header)) + header, octet),
        # The header orders the training API's POSTs (the Tinker API's order is its own seq_id).
        "sequence": (f"{_PREFIX}/", b"{}", {"Content-Type": "application/json", "Icefloe-Sequence": "x:30000000"}),
    }  # fmt: skip
    described = []
    for name, (path, body, headers) in cases.items():
        file = folder / f"{name}.bin"
        file.write_bytes(body)
        described.append({"name": name, "path": path, "file": str(file), "headers": headers})
    return described


def _latencies_while(process: subprocess.Popen, base_url: str) -> list[float]:
    latencies = []
    with httpx.Client(timeout=60) as http:
        while process.poll() is None:
            started = time.perf_counter()
            http.get(f"{base_url}/health").raise_for_status()
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)
    return latencies


def _running_job(base_url: str) -> str:
    """A tiny training job, once it runs: the frame case needs a job that would take the frame."""
    config = {"job_type": "training", "model_name": "tiny:arith", "training_config": {"max_seq_len": 64}}
    created = httpx.post(f"{base_url}{_PREFIX}/", json={"sub_job_configs": [config]}, timeout=60)
    created.raise_for_status()
    job_id, deadline = created.json()["job_id"], time.monotonic() + 300
    while (status := httpx.get(f"{base_url}{_PREFIX}/{job_id}", timeout=60).json()["status"]) != "running":
        if status in ("failed", "cancelled", "terminated") or time.monotonic() > deadline:
            raise RuntimeError(f"benchmark job is {status}")
        time.sleep(0.1)
    return job_id


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench hostile", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="idle / hostile window pairs")
    parser.add_argument("--smoke", action="store_true", help="one round of smaller bodies (a quick check)")
    args = parser.parse_args(argv)
    rounds, scale = (1, 0.1) if args.smoke else (args.rounds, 1.0)
    with tempfile.TemporaryDirectory() as tmp:
        folder, port = Path(tmp), _free_port()
        command = [
            sys.executable,
            "-m",
            "icefloe.cli",
            "serve",
            "--data-dir",
            str(folder / "serve"),
            "--port",
            str(port),
        ]
        with (folder / "serve.log").open("w") as log:
            serve = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline or serve.poll() is not None:
                    raise RuntimeError(f"icefloe serve did not start: {(folder / 'serve.log').read_text()[-2000:]}")
                time.sleep(0.1)
            plan = folder / "plan.jsonl"
            job_id = _running_job(base_url)
            plan.write_text("".join(json.dumps(case) + "\n" for case in _bodies(folder, scale, job_id)))
            idle, hostile, statuses = [], [], []
            for _ in range(rounds):
                idle += _latencies_while(
                    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"]), base_url
                )
                sender = subprocess.Popen([sys.executable, "-c", _SENDER, base_url, str(plan)], stdout=subprocess.PIPE)
                hostile += _latencies_while(sender, base_url)
                statuses += json.loads(sender.communicate()[0])
        finally:
            os.killpg(serve.pid, signal.SIGTERM)
            serve.wait(30)
    print(f"{'case':<14}{'status':>8}{'answer B':>10}")
    for name, status, size in statuses[: len(statuses) // rounds]:
        print(f"{name:<14}{status:>8}{size:>10}")
    refused = all(400 <= status < 500 for _, status, _ in statuses)
    idle_p50, hostile_p50 = statistics.median(idle), statistics.median(hostile)
    print(
        f"bench=hostile ratio={hostile_p50 / idle_p50:.2f} idle_p50_ms={idle_p50 * 1e3:.2f} "
        f"hostile_p50_ms={hostile_p50 * 1e3:.2f} hostile_max_ms={max(hostile) * 1e3:.1f} "
        f"idle_max_ms={max(idle) * 1e3:.1f} all_4xx={str(refused).lower()}"
    )
    if not refused:  # a hostile body that is not refused is a failure, not a measurement
        sys.exit(f"bench hostile: a hostile body was not refused: {[s for s in statuses if not 400 <= s[1] < 500]}")
