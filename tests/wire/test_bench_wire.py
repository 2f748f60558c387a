"""`python -m bench wire` runs end to end on a tiny frame and ends with its one summary line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]


def test_bench_wire_prints_table_and_summary_line():
    command = [sys.executable, "-m", "bench", "wire", "--mib", "1", "--rows", "4", "--repeats", "1"]
    result = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.save+load (BytesIO)" in result.stdout
    last_line = result.stdout.strip().splitlines()[-1]
    number = r"[0-9.]+"
    assert re.fullmatch(
        rf"bench=wire ratio={number} raw_ratio={number} ours_gbps={number} torch_gbps={number} raw_gbps={number}",
        last_line,
    ), last_line


def test_bench_runner_lists_and_rejects_unknown_names():
    listing = subprocess.run([sys.executable, "-m", "bench"], cwd=_REPO, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0 and "wire" in listing.stdout
    unknown = subprocess.run(
        [sys.executable, "-m", "bench", "nope"], cwd=_REPO, capture_output=True, text=True, timeout=60
    )
    assert unknown.returncode == 2
    assert "unknown benchmark 'nope'; available:" in unknown.stderr
