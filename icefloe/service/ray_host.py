"""``icefloe serve --engines ray``: a job's engines as Ray actors, one group per sub-job in its own
placement group (a training sub-job with ``n_gpus`` slots is ``n`` data-parallel ranks). The groups
share the engines' method names, so every op but weight sync, a broadcast on a process group made
the first time a pair syncs, is :class:`JobEngines`' own call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from icefloe.config import ClientConfig, RayConfig
from icefloe.service.runtime import JobEngines, stop_check
from icefloe.service.specs import SubJobSpec

__all__ = ["RayEngineHost"]

_ROLE_BY_JOB_TYPE = {"training": "training", "sampling": "sampling", "log_probability": "reference"}


class RayEngineHost(JobEngines):
    """The engines of one service job, one actor group per sub-job."""

    def __init__(self, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path]) -> None:
        super().__init__(specs, devices, checkpoints)
        self._namespace = "icefloe-serve"
        self._placements: list[Any] = []
        self._links: dict[tuple[str, str], str] = {}

    def _config(self, spec: SubJobSpec) -> ClientConfig:
        """The sub-job's engine config on the Ray backend: GPUs when its slot is one, else one CPU per actor."""
        on_gpu = self._devices.get(spec.sub_job_id, "cpu").startswith("cuda")
        gpus = float(spec.num_slots if spec.job_type == "sampling" else 1) if on_gpu else 0.0
        backend = RayConfig(namespace=self._namespace, num_cpus_per_worker=1.0, num_gpus_per_worker=gpus)
        return spec.config.model_copy(update={"backend": backend})

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        import ray

        from icefloe.engines.models import resolve_model
        from icefloe.engines.ray import SamplerGroup, TrainerGroup, create_placement_group, plan_placement

        if not ray.is_initialized():
            ray.init(namespace=self._namespace, include_dashboard=False, log_to_driver=False)
        for sub_job_id, spec in self._specs.items():
            stop_check(stop)  # each group's start blocks until its actors are up: give up between them
            config = self._config(spec)
            role = _ROLE_BY_JOB_TYPE[spec.job_type]
            count = spec.num_slots if role == "training" else 1
            start_from = self._checkpoints.get(sub_job_id)
            model_dir = (
                start_from if role == "sampling" and start_from else resolve_model(config.model, seed=config.seed)
            )
            job_name = "icefloe-serve-" + sub_job_id.replace(":", "-")
            bundles, workers = plan_placement(job_name, {role: count}, config.backend)
            placement = create_placement_group(job_name, bundles, config.backend, config.job_ready_timeout_s)
            self._placements.append(placement)
            on_progress(f"starting {count} Ray actor(s) for {sub_job_id} ({spec.config.model!r})")
            if role == "sampling":
                group = SamplerGroup.create(job_name, config, workers, placement, model_dir).start()
            else:
                group = TrainerGroup.create(job_name, config, workers, placement, model_dir).start()
                if start_from is not None:
                    loaded = group.load_checkpoint(start_from)
                    if spec.is_training and not spec.load_optimizer_states:
                        group.reset_optimizer()
                    on_progress(f"{sub_job_id} starts from {loaded['checkpoint_id']} ({loaded['kind']})")
            self._engines[sub_job_id] = group
        on_progress("engines ready")

    def sync_weights(
        self, source_sub_job_id: str, target_sub_job_id: str, weight_format: str | None = None
    ) -> dict[str, Any]:
        from icefloe.engines.lora import check_weight_format
        from icefloe.engines.ray import collective_backend, link_weight_sync, sync_weights

        trainers, samplers = self._engine(source_sub_job_id), self._engine(target_sub_job_id)
        config = self._config(self._specs[source_sub_job_id])
        check_weight_format(weight_format, config.lora, self._specs[target_sub_job_id].config.lora)
        pair = (source_sub_job_id, target_sub_job_id)
        if pair not in self._links:
            self._links[pair] = link_weight_sync(trainers, samplers, collective_backend(config.backend))
        return sync_weights(trainers, samplers, self._links[pair], config.backend.sync_bucket_mb * 1024 * 1024)

    killable = "its Ray actors"

    def cancel(self, sub_job_id: str, tags: list[str]) -> None:
        """An actor runs one call at a time: a started generate runs to its end (only queued calls are dropped)."""
        del sub_job_id, tags

    def kill(self) -> None:
        self.close()

    def close(self) -> None:
        import ray

        groups, self._engines = self._engines, {}
        for group in groups.values():
            group.kill()
        placements, self._placements = self._placements, []
        for placement in placements:
            ray.util.remove_placement_group(placement)
