"""The GRPO recipe: advantage arithmetic, and the demo's learning run end to end."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from icefloe.recipes.grpo import GRPOConfig, _split, group_advantages, summarize

VERL_GOLDEN = Path(__file__).parents[1] / "integrations" / "verl" / "golden" / "verl_losses.json"


def test_group_advantages_are_mean_centred_and_std_normalised():
    advantages_G = group_advantages([1.0, 0.0, 0.0, 0.0])
    assert math.isclose(sum(advantages_G), 0.0, abs_tol=1e-9)
    std = math.sqrt(sum(a * a for a in advantages_G) / 3)  # unbiased, as the rewards' std
    assert math.isclose(std, 1.0, rel_tol=1e-5)
    assert advantages_G[0] > 0 > advantages_G[1] == advantages_G[2] == advantages_G[3]


@pytest.mark.parametrize("rewards_G", [[0.0] * 8, [1.0] * 8, [0.5, 0.5]])
def test_group_advantages_of_a_uniform_group_are_zero(rewards_G):
    assert group_advantages(rewards_G) == [0.0] * len(rewards_G)


def test_group_advantages_keep_the_order_of_rewards():
    advantages_G = group_advantages([0.0, 1.0, 0.5])
    assert advantages_G[1] > advantages_G[2] > advantages_G[0]


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_group_advantages_equal_verls_grpo_advantages(norm_by_std):
    """verl 0.9.1's compute_grpo_outcome_advantage on the same rewards (golden values, see the generator)."""
    golden = json.loads(VERL_GOLDEN.read_text(encoding="utf-8"))["grpo_advantages"]
    (case,) = [c for c in golden if c["norm_adv_by_std_in_grpo"] is norm_by_std]
    ours = [a for rewards_G in case["rewards"] for a in group_advantages(rewards_G, norm_by_std=norm_by_std)]
    assert ours == pytest.approx(case["advantages"], abs=1e-5)


def test_dr_grpo_advantages_are_only_mean_centred():
    assert group_advantages([1.0, 0.0, 0.0, 0.0], norm_by_std=False) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert group_advantages([2.0, 2.0], norm_by_std=False) == [0.0, 0.0]


def test_split_covers_every_item_once_in_at_most_parts_slices():
    items = list(range(10))
    chunks = _split(items, 4)
    assert [len(c) for c in chunks] == [2, 3, 2, 3]
    assert [i for c in chunks for i in c] == items
    assert _split([1, 2], 4) == [[1], [2]]
    assert _split([], 4) == []


def test_summarize_averages_the_first_and_last_window():
    history = [{"reward": r} for r in [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]]
    assert summarize(history, window=2) == pytest.approx((0.1, 0.9))
    assert summarize(history[:1], window=10) == (0.0, 0.0)


def test_grpo_config_rejects_a_group_of_one():
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=1)


CURVES = Path(__file__).parent / "golden" / "demo_curves.json"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_every_seed_tracks_its_known_curve(tmp_path, seed):
    """Every seed of the demo learns at least as fast as its recorded curve (golden/make_demo_curves.py records
    it beside the end of the seed's full run). Ten full runs are beyond CI's time; a short run per seed catches
    a recipe change that slows one (seeds 5 and 7 stalled near 0.5 while the warm-up's rate was 1e-2)."""
    from icefloe.cli import run_demo

    golden = json.loads(CURVES.read_text(encoding="utf-8"))
    rewards = [row["reward"] for row in run_demo(seed=seed, steps=golden["steps"], name="short", out_dir=tmp_path)]
    known = golden["curves"][str(seed)]
    for start in range(0, len(known), 10):  # 10-step means; float noise moves a mean by a few hundredths
        ours, theirs = _mean(rewards[start : start + 10]), _mean(known[start : start + 10])
        assert ours >= theirs - 0.06, f"steps {start + 1}-{start + 10}: {ours:.3f} < the known {theirs:.3f}"


def test_every_recorded_full_run_ends_above_the_readmes_floor():
    """Each seed's full run, as golden/make_demo_curves.py recorded it, ends at or above 0.9 (the issue's floor),
    and the README's range is the recorded one."""
    ends = json.loads(CURVES.read_text(encoding="utf-8"))["full_run_ends"]
    assert sorted(ends, key=int) == [str(seed) for seed in range(10)]
    assert min(ends.values()) >= 0.9, f"a seed's full run ends below 0.9: {ends}"
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    stated = re.search(r"Seeds 0-9 end between (\d\.\d\d) and (\d\.\d\d)", readme)
    assert stated is not None, "the README no longer states the seeds' range"
    assert stated.groups() == (f"{min(ends.values()):.2f}", f"{max(ends.values()):.2f}")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_demo_run_learns_addition(tmp_path, capsys):
    """The demo's own run: the reward of the RL steps rises from <= 0.7 to >= 0.9 (10-step means), by at least 0.3.

    The first step, straight after the warm-up, scores about 0.5; RL already lifts the rest of the first ten.
    """
    from icefloe.cli import run_demo

    history = run_demo(seed=0, name="ci", out_dir=tmp_path)

    start, end = summarize(history, window=10)
    assert start <= 0.7, f"the first RL steps already score {start:.2f}; the warm-up taught too much"
    assert end >= 0.9 and end - start >= 0.3, f"the last 10 steps score {end:.2f}; GRPO did not learn the task"
    summary = [line for line in capsys.readouterr().out.splitlines() if line.startswith("demo: reward")]
    assert len(summary) == 1
    assert re.fullmatch(
        rf"demo: reward {start:.2f} → {end:.2f} over {len(history)} steps in [0-9.]+ s \(.+\)", summary[0]
    )
    lines = (tmp_path / "ci" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [row["step"] for row in rows] == list(range(1, len(history) + 1))
    expected = {"step", "reward", "loss", "grad_norm", "lr", "policy_version", "response_len", "seconds"}
    assert expected <= set(rows[0])
    assert rows[-1]["policy_version"] > rows[0]["policy_version"]
    assert 1.0 < rows[-1]["response_len"] < 3.0  # answers of one and two digits, each followed by EOS
    assert (tmp_path / "ci" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_demo_run_with_lora_learns_addition(tmp_path, capsys):
    """``icefloe demo --lora-rank 8``: RL trains adapters only; the first RL step scores <= 0.7, the last ten >= 0.95
    (docs/lora.md: 0.56 and 0.99)."""
    from icefloe.cli import run_demo

    history = run_demo(seed=0, name="lora", out_dir=tmp_path, lora_rank=8)

    _, end = summarize(history, window=10)
    assert history[0]["reward"] <= 0.7, f"the first RL step already scores {history[0]['reward']:.2f}"
    assert end >= 0.95, f"the last 10 steps score {end:.2f}; GRPO with LoRA did not learn the task"
    out = capsys.readouterr().out
    assert "RL trains LoRA adapters only (rank 8" in out and "full-weight supervised warm-up" in out
    checkpoints = tmp_path / "lora" / "warm-up"
    assert any(checkpoints.glob("global_step*/model.safetensors"))  # the warm-up's full weights, RL's base


def test_cli_demo_refuses_an_unknown_tracker_before_starting(tmp_path):
    from typer.testing import CliRunner

    from icefloe.cli import app

    result = CliRunner().invoke(app, ["demo", "--tracker", "jsonl,tb", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown tracker 'tb'; choose from jsonl, tensorboard, wandb, mlflow" in _unboxed(result.output)
    assert not (tmp_path / "demo").exists()


def test_cli_demo_names_the_extra_when_a_tracker_library_is_missing(tmp_path, monkeypatch):
    import sys

    from typer.testing import CliRunner

    from icefloe.cli import app

    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    result = CliRunner().invoke(app, ["demo", "--tracker", "jsonl", "--tracker", "mlflow", "--out-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert "tracker 'mlflow' needs the mlflow package: pip install 'icefloe[trackers]'" in _unboxed(result.output)
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_demo_on_ray_logs_every_step_to_tensorboard(tmp_path, capsys, monkeypatch):
    """``icefloe demo --backend ray --tracker jsonl,tensorboard``: engines in Ray actors, metrics in both places,
    on a Ray of its own beside another program's (it joined any Ray on the machine, and lost its actors when
    that one stopped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from icefloe.cli import run_demo

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    script = "import ray, sys, time; ray.init(num_cpus=1); print('up', flush=True); sys.stdin.read()"
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as other:
        try:
            assert other.stdout is not None and other.stdout.readline().strip() == "up"
            history = run_demo(steps=4, name="ray", out_dir=tmp_path, backend="ray", trackers=["jsonl", "tensorboard"])
        finally:
            other.communicate("", timeout=60)  # closing its stdin ends it
    assert "started a local Ray with 2 CPUs" in capsys.readouterr().out
    assert [row["step"] for row in history] == [1, 2, 3, 4]
    assert history[-1]["policy_version"] > history[0]["policy_version"]
    rows = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert [row["reward"] for row in rows] == [row["reward"] for row in history]
    events = EventAccumulator(str(tmp_path / "ray" / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("reward")] == [
        (row["step"], round(row["reward"], 5)) for row in history
    ]


def _unboxed(output: str) -> str:
    """Typer's error box as one line: borders dropped, wrapped lines joined."""
    return " ".join(output.replace("│", " ").split())
