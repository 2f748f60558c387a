"""Fixtures for the engine tests: one thread, one tiny model folder per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)

from icefloe.engines.models import resolve_model

MODEL_SEED = 5


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # Two shared CPU cores: more threads only add contention for these tiny shapes.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return resolve_model("tiny:arith", seed=MODEL_SEED, cache_dir=tmp_path_factory.mktemp("models"))
