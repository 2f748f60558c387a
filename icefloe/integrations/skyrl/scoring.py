"""Score samples with ``skyrl_gym`` environments in a pool of worker processes.

Environments are plain Python (regexes, SQL, code runners) and some hold the GIL or open files,
so they run in processes. Workers are spawned, not forked (SkyRL runs under Ray, where forking is
unsafe), and a spawned worker only knows skyrl_gym's built-in environments: modules that register
custom ones are listed in ``env_modules`` and imported by each worker before it scores anything.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

__all__ = ["Sample", "ScoringPool", "score_one"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    """One rollout to score: the environment, its extras, the prompt it saw and the response text."""

    env_class: str
    extras: dict[str, Any]
    prompt: Any
    text: str
    env_config: dict[str, Any] | None = None


def _import_env_modules(modules: Sequence[str]) -> None:
    for name in modules:
        importlib.import_module(name)


def score_one(sample: Sample) -> float:
    """``make`` the environment, ``init`` it with the prompt, ``step`` the response, ``close``; the reward."""
    import skyrl_gym

    env = skyrl_gym.make(sample.env_class, env_config=sample.env_config or {}, extras=sample.extras)
    try:
        env.init(sample.prompt)
        return float(env.step(sample.text)["reward"])
    finally:
        env.close()


def _score_or_error(sample: Sample) -> tuple[float, str | None]:
    try:
        return score_one(sample), None
    except Exception as exc:  # an environment may raise anything; the caller decides what a failure costs
        return 0.0, f"{type(exc).__name__}: {exc}"


class ScoringPool:
    """A lazily started process pool that scores :class:`Sample` lists; close it when done."""

    def __init__(self, num_workers: int, env_modules: Sequence[str] = ()) -> None:
        if num_workers < 1:
            raise ValueError(f"trainer.icefloe.scoring_workers must be >= 1; got {num_workers}")
        self.num_workers = num_workers
        self.env_modules = tuple(env_modules)
        _import_env_modules(self.env_modules)  # fail here, naming the module, not inside a worker
        self._executor: ProcessPoolExecutor | None = None

    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            self._executor = ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_import_env_modules,
                initargs=(self.env_modules,),
            )
        return self._executor

    def score(self, samples: Sequence[Sample]) -> tuple[list[float], list[str | None]]:
        """Rewards in input order, and per sample ``None`` or the error its environment raised (reward 0.0)."""
        if not samples:
            return [], []
        chunksize = max(1, len(samples) // (4 * self.num_workers))
        results = list(self._pool().map(_score_or_error, samples, chunksize=chunksize))
        return [reward for reward, _ in results], [error for _, error in results]

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
