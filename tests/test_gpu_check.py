"""The GPU check's dry run: the script a GPU machine runs (bench/gpu_check.py) keeps working on CPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK_LINE = re.compile(r"check=(\w+) (ok|skip|FAIL) [\d.]+s")
LAST_LINE = re.compile(
    r"bench=gpu ok=(\d+)/(\d+) skip=(\d+) fail=(\d+) sync_s=\S+ ipc_s=\S+ local_sync_s=\S+ tok_s=\S+ "
    r"train_tok_s=\S+ peak_gib=\S+ sampler=torch device=cpu seconds=\d+"
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dry_run_passes_every_check_that_needs_no_cuda():
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=840
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    summary = lines[lines.index("--- summary") + 1 : -1]
    statuses = dict(CHECK_LINE.match(line).groups() for line in summary)
    found = LAST_LINE.fullmatch(lines[-1])
    assert found, lines[-1]
    ok, total, skipped, failed = map(int, found.groups())
    assert (ok, total, skipped, failed) == (7, 9, 2, 0)
    assert {name for name, status in statuses.items() if status == "skip"} == {"sync_ipc", "pytest_gpu"}
    assert set(statuses) == {
        "train", "sample", "sync_local", "sleep_wake", "lora", "sync_ipc", "sync_broadcast", "ray", "pytest_gpu"
    }  # fmt: skip
