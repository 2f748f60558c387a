"""The one Ray session of the Ray tests: a local Ray with 2 CPUs, started once for this folder and shut down
after it (each start and stop took ~4 s, and a fresh Ray re-imported torch in every first actor)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="package")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="icefloe-tests")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from icefloe.engines.models import resolve_model

    return resolve_model("tiny:arith", seed=11, cache_dir=tmp_path_factory.mktemp("models"))
