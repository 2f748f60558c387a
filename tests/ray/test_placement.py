"""Placement plans of ``icefloe.engines.ray`` (no Ray session: planning reserves nothing)."""

from __future__ import annotations

import ray  # noqa: F401 (the dev extra installs it: fail, never skip)
import torch  # noqa: F401 (the dev extra installs it: fail, never skip)

import icefloe.engines.ray as engines_ray
from icefloe.config import RayConfig
from icefloe.engines.ray import WorkerSpec, collective_backend, plan_placement


def test_plan_placement_gives_each_worker_a_bundle_of_its_own():
    bundles, workers = plan_placement("job", {"training": 2, "sampling": 1}, RayConfig(num_cpus_per_worker=0.5))
    assert bundles == [{"CPU": 0.5}] * 3
    assert workers == [
        WorkerSpec("training", 0, "job-training-0", 0),
        WorkerSpec("training", 1, "job-training-1", 1),
        WorkerSpec("sampling", 0, "job-sampling-0", 2),
    ]


def test_plan_placement_colocated_sums_worker_i_of_every_role_into_bundle_i():
    config = RayConfig(colocate=True, num_cpus_per_worker=0.25, num_gpus_per_worker=0.5)
    bundles, workers = plan_placement("job", {"training": 2, "sampling": 1, "reference": 1}, config)
    assert bundles == [{"CPU": 0.75, "GPU": 1.5}, {"CPU": 0.25, "GPU": 0.5}]
    assert [(w.name, w.bundle) for w in workers] == [
        ("job-training-0", 0),
        ("job-training-1", 1),
        ("job-sampling-0", 0),
        ("job-reference-0", 0),
    ]


def test_collective_backend_follows_the_device_unless_named():
    assert collective_backend(RayConfig()) == "gloo"
    assert collective_backend(RayConfig(num_gpus_per_worker=1)) == "nccl"
    assert collective_backend(RayConfig(collective_backend="gloo", num_gpus_per_worker=1)) == "gloo"


def test_engines_ray_all_is_sorted_and_every_name_resolves():
    assert engines_ray.__all__ == sorted(engines_ray.__all__)
    for name in engines_ray.__all__:
        assert getattr(engines_ray, name) is not None, name
