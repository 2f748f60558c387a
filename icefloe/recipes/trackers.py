"""Per-step metrics to the experiment trackers RL users already read: jsonl, TensorBoard, W&B, MLflow.

A tracker has two methods, ``log(metrics, step)`` and ``close(error)``, where ``error`` is what ended
the run (None = it finished); :func:`open_trackers` opens the named ones under a run folder and
returns one tracker that writes to all of them. Each writes
through its own library, imported only when chosen (``pip install 'icefloe[trackers]'``):

- ``jsonl``: ``<run_dir>/metrics.jsonl``, one JSON object per step, written as each step ends.
- ``tensorboard``: event files in ``<run_dir>/tensorboard`` (``tensorboard --logdir <run_dir>``).
- ``wandb``: a run in ``<run_dir>/wandb``; offline unless ``WANDB_MODE`` says otherwise, so it
  never needs the network (``wandb sync <run_dir>/wandb/offline-run-*`` uploads it later).
- ``mlflow``: a run in the experiment ``icefloe``, stored in ``<run_dir>/mlflow.db`` (SQLite; MLflow 3
  refuses new file stores) unless ``MLFLOW_TRACKING_URI`` names another store
  (``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, Self, get_args

from icefloe.protocol import ConfigError

__all__ = ["TRACKERS", "Tracker", "TrackerName", "Trackers", "open_trackers", "require_trackers"]

TrackerName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
TRACKERS: tuple[TrackerName, ...] = get_args(TrackerName)
# The packages each tracker imports (MLflow's SQLite store needs sqlalchemy, which mlflow-skinny leaves out).
_MODULES = {"jsonl": (), "tensorboard": ("tensorboard",), "wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy")}


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, error: BaseException | None = None) -> None: ...


def require_trackers(names: Sequence[str]) -> None:
    """Raise before anything starts when a name is unknown or its library is not installed.

    Raises:
        ConfigError: an unknown tracker name.
        ImportError: the tracker's library is missing; the message names the extra to install.
    """
    import importlib.util

    for name in names:
        if name not in _MODULES:
            raise ConfigError(f"trackers: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        for module in _MODULES[name]:
            if importlib.util.find_spec(module) is None:
                raise ImportError(f"tracker {name!r} needs the {module} package: pip install 'icefloe[trackers]'")


def open_trackers(names: Sequence[str], run_dir: Path, *, run_name: str, config: Mapping[str, Any]) -> Trackers:
    """One tracker that logs to every named one; ``config`` is recorded as the run's parameters."""
    require_trackers(names)
    opened = Trackers([])
    try:
        for name in dict.fromkeys(names):  # each once, in the order given
            opened.trackers.append(_OPENERS[name](run_dir, run_name, config))
    except BaseException as exc:
        opened.close(exc)
        raise
    return opened


class Trackers:
    """Logs to each of ``trackers`` in turn; a context manager that closes them all, telling each
    whether the run failed (an exception) or was interrupted (``KeyboardInterrupt``)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self.close(exc)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self, error: BaseException | None = None) -> None:
        for tracker in self.trackers:
            tracker.close(error)


class _Jsonl:
    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        self._file = (run_dir / "metrics.jsonl").open("w", encoding="utf-8")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()  # a crash keeps every finished step

    def close(self, error: BaseException | None = None) -> None:
        self._file.close()


class _TensorBoard:
    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._writer.add_text("config", f"```\n{json.dumps(config, indent=2, default=str)}\n```")

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self, error: BaseException | None = None) -> None:
        self._writer.close()


class _Wandb:
    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        import wandb

        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "icefloe"),
            name=run_name,
            dir=str(run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            config=dict(config),
        )

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self, error: BaseException | None = None) -> None:
        self._run.finish(exit_code=0 if error is None else 1)


class _Mlflow:
    def __init__(self, run_dir: Path, run_name: str, config: Mapping[str, Any]) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name("icefloe")
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment("icefloe")
        self._run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        self._client.log_batch(self._run_id, params=[Param(key, str(value)) for key, value in config.items()])

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        at = int(time.time() * 1000)
        entries = [self._metric(key, float(value), at, step) for key, value in metrics.items()]
        self._client.log_batch(self._run_id, metrics=entries)

    def close(self, error: BaseException | None = None) -> None:
        status = "FINISHED" if error is None else "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED"
        self._client.set_terminated(self._run_id, status)


_OPENERS = {"jsonl": _Jsonl, "tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _Mlflow}
