"""Benchmarks run with ``python -m bench <name>``; see ``bench/__main__.py`` for the convention."""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"  # the summary line of each bench's last full run with --record


def parse_args(parser: argparse.ArgumentParser, argv: list[str], smoke: dict[str, Any]) -> argparse.Namespace:
    """``parser``'s arguments, plus ``--smoke``: the whole benchmark on the tiny sizes ``smoke`` names
    (flags given explicitly still win), so CI runs every path of it in a minute or so. Its figures
    are not the benchmark's: only those that do not depend on the sizes (byte counts) carry over;
    and ``--record``, which :func:`finish` reads."""
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: every path once, quickly (CI)")
    parser.add_argument("--record", action="store_true", help="also write the summary line to bench/results/")
    if "--smoke" in argv:
        parser.set_defaults(**smoke)
    args = parser.parse_args(argv)
    if args.smoke and args.record:
        parser.error("--record keeps full runs only; drop --smoke")
    return args


def finish(args: argparse.Namespace, summary: str, record_as: str | None = None) -> None:
    """Print the summary line ``bench=<name> ratio=... key=value ...``; with ``--record`` also write it
    to ``bench/results/<record_as or name>.txt``, the artefact ``tests/test_docs.py`` checks the docs'
    numbers against."""
    print(summary)
    if args.record:
        name = record_as or summary.split()[0].removeprefix("bench=")
        RESULTS.mkdir(exist_ok=True)
        command = " ".join(["python -m bench", *sys.argv[1:]])
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        header = f"# {command}, {when}, {os.cpu_count()} CPUs\n"
        (RESULTS / f"{name}.txt").write_text(header + summary + "\n", encoding="utf-8")


def summary_fields(line: str) -> dict[str, str]:
    """The ``key=value`` pairs of a summary line."""
    return dict(field.split("=", 1) for field in line.split() if "=" in field)


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
def serve(data_dir: Path, *args: str, threads: int | None = 1) -> Iterator[str]:
    """``icefloe serve`` in its own process, as a user runs it (``args``: more flags); yields its base URL.

    ``threads``: torch threads of its engine processes; one (the default) matches a benchmark process
    that computes the same work itself, None leaves torch its default (every core).
    """
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "icefloe.cli", "serve", "--port", str(port), "--data-dir", str(data_dir), *args]
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
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
