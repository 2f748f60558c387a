"""Trackers: each writes through its own library, and each library reads the metrics back."""

from __future__ import annotations

import json
import sys
import time

import pytest

from icefloe.protocol import ConfigError
from icefloe.recipes.trackers import open_trackers, require_trackers

ROWS = [{"reward": 0.25, "loss": -0.5}, {"reward": 0.5, "loss": -0.25}, {"reward": 0.75, "loss": 0.125}]
CONFIG = {"seed": 3, "lr": 0.0025, "trackers": ["jsonl"]}


def log_rows(names, run_dir):
    with open_trackers(names, run_dir, run_name="t", config=CONFIG) as tracker:
        for step, row in enumerate(ROWS, start=1):
            tracker.log(row, step)


def test_jsonl_writes_one_row_per_step(tmp_path):
    log_rows(["jsonl"], tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": step, **row} for step, row in enumerate(ROWS, start=1)]


def test_an_unknown_tracker_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"unknown tracker 'tb'; choose from jsonl, tensorboard, wandb, mlflow"):
        require_trackers(["jsonl", "tb"])


def test_a_missing_library_names_the_extra_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    hint = r"tracker 'wandb' needs the wandb package: pip install 'icefloe\[trackers\]'"
    with pytest.raises(ImportError, match=hint):
        open_trackers(["jsonl", "wandb"], tmp_path, run_name="t", config=CONFIG)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_rows(["tensorboard"], tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward", "loss"}
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_wandb_offline_run_holds_the_history(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default: no network, no login
    monkeypatch.setenv("WANDB_SILENT", "true")
    log_rows(["wandb"], tmp_path)
    run_files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    (run_file,) = run_files
    # W&B's own service process writes the run file; under load it may still be writing after finish().
    deadline = time.monotonic() + 30
    while b"0.125" not in (records := run_file.read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b"reward" in records and b"loss" in records and b"0.125" in records  # protobuf keeps them as text


@pytest.mark.slow  # a new MLflow store runs its schema migrations first (~20 s on 2 cores)
def test_mlflow_run_reads_back_through_its_client(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    log_rows(["mlflow"], tmp_path)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("icefloe").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["seed"] == "3"
    history = client.get_metric_history(run.info.run_id, "reward")
    assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_mlflow_records_a_run_that_raised_as_failed_and_an_interrupted_one_as_killed(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store needs no schema migrations
    log_rows(["mlflow"], tmp_path)
    for error in (RuntimeError("step failed"), KeyboardInterrupt()):
        with pytest.raises(type(error)), open_trackers(["mlflow"], tmp_path, run_name=repr(error), config=CONFIG) as t:
            t.log(ROWS[0], 1)
            raise error
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("icefloe").experiment_id])
    statuses = {run.info.run_name: run.info.status for run in runs}
    assert statuses == {"t": "FINISHED", "RuntimeError('step failed')": "FAILED", "KeyboardInterrupt()": "KILLED"}
