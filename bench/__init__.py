"""Benchmarks run with ``python -m bench <name>``; see ``bench/__main__.py`` for the convention."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def timed(fn: Callable[[], object], device: Any = None, iterations: int = 1) -> float:
    """Seconds that ``iterations`` calls of ``fn`` take; a CUDA ``device`` is synchronised before and after."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: Any) -> None:
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


@contextlib.contextmanager
def serve(data_dir: Path, *args: str) -> Iterator[str]:
    """``icefloe serve`` in its own process, as a user runs it (``args``: more flags); yields its base URL."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "icefloe.cli", "serve", "--port", str(port), "--data-dir", str(data_dir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread, like the benchmark process: a fair comparison
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"icefloe serve did not come up on {base_url}")
            time.sleep(0.2)
        yield base_url
    finally:
        process.terminate()
        process.wait(timeout=60)


def descendant_pids(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, their children, ...), read from ``/proc`` (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # it exited meanwhile
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def proc_status_kib(pid: int, key: str) -> int:
    """A size from ``/proc/PID/status`` in KiB: ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {key}")


def proc_cpu_seconds(pid: int) -> float:
    """CPU seconds the process has used (user + system, from ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
