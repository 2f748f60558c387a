"""The one Ray session of the Ray tests: a local Ray with 2 CPUs, started once for this folder and shut down
after it (each start and stop took ~4 s, and a fresh Ray re-imported torch in every first actor)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="package")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="icefloe-tests")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from icefloe.engines.models import resolve_model

    return resolve_model("tiny:arith", seed=11, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def config(started):
    """The config of the module's two-replica group: its ``started`` fixture yields from :func:`two_replica_group`."""
    return started[0]


@pytest.fixture(scope="module")
def replicas(started):
    """The module's started two-replica group."""
    return started[1]


def two_replica_group(group_class: Any, role: str, model_dir: Path) -> Iterator[tuple[Any, Any]]:
    """``(config, group)``: a started ``group_class`` of two ``role`` replicas on the tiny model, then torn down."""
    import ray

    from icefloe.config import ClientConfig
    from icefloe.engines.ray import create_placement_group, plan_placement

    backend = {"type": "ray", "namespace": "icefloe-tests", "num_cpus_per_worker": 0.25}
    replicas = {f"num_{role}_workers": 2}
    config = ClientConfig.build(model=str(model_dir), max_seq_len=48, backend=backend, **replicas)
    job_name = f"icefloe-test-{role}-group"
    bundles, workers = plan_placement(job_name, {role: 2}, config.backend)
    placement = create_placement_group(job_name, bundles, config.backend, config.job_ready_timeout_s)
    group = group_class.create(job_name, config, workers, placement, model_dir).start()
    try:
        yield config, group
    finally:
        group.kill()
        ray.util.remove_placement_group(placement)
