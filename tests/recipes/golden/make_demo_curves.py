"""Write ``demo_curves.json``: for every demo seed 0-9, the reward curve of a short run of the recipe,
recorded only once the seed's full run (200 steps) ends at or above 0.9.

CI cannot afford ten full runs; it runs the short ones and holds each seed to its recorded curve
(``test_every_seed_tracks_its_known_curve``), so a recipe change that slows any seed's learning
fails there. After changing the recipe on purpose, run this again from the repository root (about
10 minutes on 2 cores; it refuses to write while a full run ends below 0.9); seeds given as arguments
are run alone and merged into the file, so two processes can share the work::

    .venv/bin/python tests/recipes/golden/make_demo_curves.py        # every seed
    .venv/bin/python tests/recipes/golden/make_demo_curves.py 5 7    # only these
"""

from __future__ import annotations

import fcntl
import json
import sys
import tempfile
from pathlib import Path

import torch

from icefloe.cli import run_demo
from icefloe.recipes.grpo import summarize

SEEDS = range(10)
SHORT_STEPS = 30
GOAL = 0.9  # the last ten RL steps of a full run, every seed


def main(seeds: list[int]) -> None:
    curves, ends = {}, {}
    with tempfile.TemporaryDirectory() as out:
        for seed in seeds:
            _, ends[str(seed)] = summarize(run_demo(seed=seed, name=f"full-{seed}", out_dir=Path(out)), window=10)
            short = run_demo(seed=seed, steps=SHORT_STEPS, name=f"short-{seed}", out_dir=Path(out))
            curves[str(seed)] = [round(row["reward"], 4) for row in short]
    print("full runs, last ten steps:", {seed: round(end, 3) for seed, end in ends.items()})
    target = Path(__file__).with_name("demo_curves.json")
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be merging its seeds
        record = json.loads(target.read_text(encoding="utf-8")) if target.exists() else {}
        if record.get("steps") != SHORT_STEPS or record.get("torch") != torch.__version__:
            record = {"steps": SHORT_STEPS, "torch": torch.__version__}  # the demo runs on one thread (run_demo)
        record["full_run_ends"] = {**record.get("full_run_ends", {}), **{k: round(v, 4) for k, v in ends.items()}}
        record["curves"] = {**record.get("curves", {}), **curves}
        target.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    target.with_suffix(".lock").unlink(missing_ok=True)
    print(f"wrote seeds {sorted(curves)} to {target}")
    low = {seed: end for seed, end in ends.items() if end < GOAL}
    if low:
        sys.exit(f"seeds {sorted(low)} end below {GOAL} ({low}): the recipe falls short of the README")


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or list(SEEDS))
