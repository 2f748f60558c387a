"""Where a job's actors run: one placement group, its bundles, and which bundle each actor takes.

Separate placement gives every worker a bundle of its own; colocated placement puts worker ``i`` of
every role into bundle ``i``, whose resources are the sum of theirs, so fractional GPUs (0.5 each)
share one device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from icefloe.config import RayConfig
from icefloe.protocol import IcefloeTimeoutError

__all__ = [
    "ROLES",
    "WorkerSpec",
    "actor_options",
    "collective_backend",
    "create_placement_group",
    "plan_placement",
    "worker_device",
]

ROLES = ("training", "sampling", "reference")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One actor to create: its role, index within the role, actor name and placement bundle."""

    role: str
    index: int
    name: str
    bundle: int


def collective_backend(ray_config: RayConfig) -> str:
    """``gloo`` on CPU workers, ``nccl`` on GPU workers, unless the config names one."""
    if ray_config.collective_backend != "auto":
        return ray_config.collective_backend
    return "nccl" if ray_config.num_gpus_per_worker > 0 else "gloo"


def worker_device(ray_config: RayConfig) -> str:
    """The torch device an actor's engine runs on."""
    return "cuda" if ray_config.num_gpus_per_worker > 0 else "cpu"


def plan_placement(job_name: str, counts: dict[str, int], ray_config: RayConfig) -> tuple[list[dict], list[WorkerSpec]]:
    """Bundles of one placement group and which bundle each worker (named ``{job}-{role}-{index}``) uses."""
    per_worker = {"CPU": ray_config.num_cpus_per_worker}
    if ray_config.num_gpus_per_worker > 0:
        per_worker["GPU"] = ray_config.num_gpus_per_worker
    workers: list[WorkerSpec] = []
    bundles: list[dict[str, float]] = []
    for role in ROLES:
        for index in range(counts.get(role, 0)):
            if ray_config.colocate:
                bundle = index
                while len(bundles) <= bundle:
                    bundles.append(dict.fromkeys(per_worker, 0.0))
                for key, value in per_worker.items():
                    bundles[bundle][key] += value
            else:
                bundle = len(bundles)
                bundles.append(dict(per_worker))
            workers.append(WorkerSpec(role, index, f"{job_name}-{role}-{index}", bundle))
    return bundles, workers


def create_placement_group(
    job_name: str, bundles: list[dict], ray_config: RayConfig, timeout_s: float
) -> PlacementGroup:
    """Reserve the bundles; an unsatisfiable request fails with what was asked instead of waiting forever."""
    lifetime = "detached" if ray_config.detached else None
    group = placement_group(bundles, strategy=ray_config.placement_strategy, name=f"{job_name}-pg", lifetime=lifetime)
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise IcefloeTimeoutError(
            f"job {job_name}: the Ray cluster could not reserve {bundles} ({ray_config.placement_strategy}) within "
            f"{timeout_s:.0f}s; lower backend.num_cpus_per_worker / num_gpus_per_worker, use fewer workers, or add "
            f"nodes (cluster has {ray.cluster_resources()})"
        ) from None
    return group


def actor_options(spec: WorkerSpec, ray_config: RayConfig, group: PlacementGroup | None) -> dict[str, Any]:
    """``.options(...)`` of one worker's actor: its name, resources, lifetime and bundle."""
    options: dict[str, Any] = {
        "name": spec.name,
        "namespace": ray_config.namespace,
        "num_cpus": ray_config.num_cpus_per_worker,
        "num_gpus": ray_config.num_gpus_per_worker,
        "max_restarts": 0,
    }
    if ray_config.detached:
        options["lifetime"] = "detached"
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=spec.bundle
        )
    return options
