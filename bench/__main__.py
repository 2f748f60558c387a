"""Run one benchmark: ``python -m bench <name> [args]`` calls ``bench/bench_<name>.py``'s ``main(argv)``.

Convention for every ``bench_<name>.py``: expose ``main(argv: list[str]) -> None``; run the baseline
and the candidate interleaved in one process (several repeats, report the median) so machine noise
hits both alike; print a table; end with exactly one line
``bench=<name> ratio=<candidate ÷ baseline> key=value ...`` that scripts can grep; parse its flags
with :func:`bench.parse_args`, which adds ``--smoke`` (tiny sizes: ``tests/bench/test_benches.py`` runs
every bench so in CI) and ``--record``, and print that line with :func:`bench.finish`.
``python -m bench`` with no name lists the benchmarks found next to this file.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

_PREFIX = "bench_"


def available() -> list[str]:
    """Names of the benchmarks in this folder, sorted."""
    return sorted(path.stem.removeprefix(_PREFIX) for path in Path(__file__).parent.glob(f"{_PREFIX}*.py"))


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in {"-h", "--help"}:
        print("usage: python -m bench <name> [args]\navailable: " + (", ".join(names) or "(none)"))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"unknown benchmark {name!r}; available: {', '.join(names) or '(none)'}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{_PREFIX}{name}")
    module.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
