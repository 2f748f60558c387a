"""Every benchmark runs end to end in CI: ``python -m bench <name> --smoke`` for each ``bench/bench_*.py``.

The benches are found the way ``python -m bench`` finds them, so a new file is run without an edit
here. The ones that take seconds run in ``make test``; any other, a new one included until it is
timed and listed in ``FAST``, runs in ``make test-slow``. Each must exit 0 and end with its summary
line, ``bench=<name> ratio=<finite number> key=value ...``.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from bench import summary_fields
from bench.__main__ import available

_REPO = Path(__file__).resolve().parents[2]
# Smoke runs of a few seconds each on the 2-core CI machine; every other bench is slow by default.
FAST = {"engine", "fairness", "lora", "service", "weight_sync", "wire"}
# A bench with another mode runs once per mode.
VARIANTS = {"load": [[], ["--api", "tinker", "--seconds", "3"]]}
_SUMMARY = re.compile(r"bench=(?P<name>\w+) ratio=(?P<ratio>\S+)(?: [\w.-]+=\S+)*")


def bench_cases(names: Iterable[str]) -> Iterator[object]:
    """One pytest case per bench (and mode), marked slow unless the bench is in ``FAST``."""
    for name in names:
        for extra in VARIANTS.get(name, [[]]):
            marks = [] if name in FAST else [pytest.mark.slow]
            yield pytest.param(name, extra, marks=marks, id=" ".join([name, *extra]))


def run_bench(name: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "bench", name, *args]
    return subprocess.run(command, cwd=_REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(660)
@pytest.mark.parametrize(("name", "extra"), list(bench_cases(available())))
def test_bench_smoke_run_ends_with_its_summary_line(name, extra):
    result = run_bench(name, "--smoke", *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    last_line = result.stdout.strip().splitlines()[-1]
    match = _SUMMARY.fullmatch(last_line)
    assert match is not None and match["name"] == name, last_line
    assert math.isfinite(float(match["ratio"])), last_line
    assert summary_fields(last_line)["ratio"] == match["ratio"]


def test_every_bench_file_is_run_and_an_unknown_one_is_slow():
    """Discovery is the runner's: every ``bench_*.py`` has a case; a name not in ``FAST`` is slow."""
    files = {path.stem.removeprefix("bench_") for path in (_REPO / "bench").glob("bench_*.py")}
    assert {case.values[0] for case in bench_cases(available())} == files
    [case] = bench_cases(["not_timed_yet"])
    assert [mark.name for mark in case.marks] == ["slow"]
    [case] = bench_cases(["wire"])
    assert not case.marks


def test_wire_smoke_prints_its_table_and_keys():
    result = run_bench("wire", "--smoke", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "torch.save+load (BytesIO)" in result.stdout
    number = r"[0-9.]+"
    assert re.fullmatch(
        rf"bench=wire ratio={number} raw_ratio={number} ours_gbps={number} torch_gbps={number} raw_gbps={number}",
        result.stdout.strip().splitlines()[-1],
    )


def test_bench_runner_lists_and_rejects_unknown_names():
    listing = run_bench("--help", timeout=60)
    assert listing.returncode == 0 and all(name in listing.stdout for name in available())
    unknown = run_bench("nope", timeout=60)
    assert unknown.returncode == 2
    assert "unknown benchmark 'nope'; available:" in unknown.stderr


def test_record_refuses_a_smoke_run():
    """A recorded artefact is a full run's: ``--record`` with ``--smoke`` is refused before it writes."""
    result = run_bench("wire", "--smoke", "--record", timeout=120)
    assert result.returncode == 2
    assert "--record keeps full runs only" in result.stderr
