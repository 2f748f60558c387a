"""``icefloe serve --engines ray``: a job's engines as Ray actors, one group per sub-job in its own
placement group (a training sub-job with ``n_gpus`` slots is ``n`` data-parallel ranks). The groups
share the engines' method names, so every op but weight sync, a broadcast on a process group made
the first time a pair syncs, is :class:`JobEngines`' own call.

A shared base (LoRA runs of one model) is one actor holding what an engine process holds on
``--engines process``: a :class:`LocalEngineHost` with the base and every run's adapters
(:class:`RaySharedHost`), called the same way, one call at a time; what its engines log in a call
comes back with the answer, for the logs of the jobs whose op it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from icefloe.config import ClientConfig, RayConfig
from icefloe.protocol import InvalidRequestError
from icefloe.service.hosts.process import EngineProcessDied, portable
from icefloe.service.hosts.seam import BaseModel, ForwardedEngines, JobEngines, stop_check
from icefloe.service.joblog import ENGINE_LOGGER, JobLogRouter, Recorder, relay
from icefloe.service.specs import SubJobSpec

__all__ = ["RayEngineHost", "RaySharedHost"]

_NAMESPACE = "icefloe-serve"

_ROLE_BY_JOB_TYPE = {"training": "training", "sampling": "sampling", "log_probability": "reference"}


class RayEngineHost(JobEngines):
    """The engines of one service job, one actor group per sub-job."""

    def __init__(self, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path]) -> None:
        super().__init__(specs, devices, checkpoints)
        self._namespace = _NAMESPACE
        self._placements: list[Any] = []
        self._links: dict[tuple[str, str], str] = {}

    def _config(self, spec: SubJobSpec) -> ClientConfig:
        """The sub-job's engine config on the Ray backend: GPUs when its slot is one, else one CPU per actor."""
        on_gpu = self._devices.get(spec.sub_job_id, "cpu").startswith("cuda")
        gpus = float(spec.num_slots if spec.job_type == "sampling" else 1) if on_gpu else 0.0
        backend = RayConfig(namespace=self._namespace, num_cpus_per_worker=1.0, num_gpus_per_worker=gpus)
        return spec.config.model_copy(update={"backend": backend})

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        from icefloe.engines.models import resolve_model
        from icefloe.engines.ray import SamplerGroup, TrainerGroup, create_placement_group, plan_placement

        _init_ray()
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


class RaySharedHost(ForwardedEngines):
    """A shared base in one Ray actor (on a GPU when the host's slot is one); runs attach and detach as
    they do on an engine process, and a dead actor fails every job on it as a dead process does."""

    killable = "its Ray actor"

    def __init__(self, devices: dict[str, str], *, base: BaseModel) -> None:
        super().__init__([], devices, {}, base=base)
        self._actor: Any = None

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        import ray

        assert self._base is not None
        _init_ray()
        on_gpu = self._base.device.startswith("cuda")
        base = dataclasses.replace(self._base, device="cuda:0" if on_gpu else "cpu")  # Ray picks the GPU
        actor_class = ray.remote(_SharedBaseActor).options(
            name=f"icefloe-shared-base-{uuid.uuid4().hex[:12]}",  # listed beside the dedicated jobs' actors
            namespace=_NAMESPACE,
            num_cpus=1,
            num_gpus=1 if on_gpu else 0,
            max_concurrency=2,
        )
        on_progress(f"starting a Ray actor for the shared base {base.model!r} on {base.device}")
        self._actor = actor_class.remote(base)
        ready = self._actor.ready.remote()
        while not ray.wait([ready], timeout=0.05)[0]:
            stop_check(stop)  # a stopping job gives up; its close kills the actor
        _answer(ray.get(ready))  # raises what the base's load raised
        on_progress("engines ready")

    def _forward(self, sub_job_id: str | None, method: str, *args: Any, what: str | None = None) -> Any:
        import ray

        if self._actor is None:
            raise EngineProcessDied(f"the shared base's Ray actor is gone; {what or method} did not run")
        try:
            return _answer(ray.get(self._actor.run.remote(method, *args)))
        except ray.exceptions.RayActorError as exc:
            raise EngineProcessDied(f"the shared base's Ray actor died during {what or method}: {exc}") from None

    def cancel(self, sub_job_id: str, tags: list[str]) -> None:
        """Beside the call the actor runs (it takes two at once), so a started generate stops at its next step."""
        if self._actor is not None:
            self._actor.cancel.remote(sub_job_id, tags)

    def kill(self) -> None:
        self.close()

    def close(self) -> None:
        import ray

        actor, self._actor = self._actor, None
        if actor is not None:
            with contextlib.suppress(Exception):  # gone already
                ray.kill(actor)


class _SharedBaseActor:
    """Inside the actor: the shared base and its runs' engines, called one at a time (as over an engine
    process's pipe); an error comes back as a value, without Ray's traceback around its message."""

    def __init__(self, base: BaseModel) -> None:
        from icefloe.service.hosts.seam import LocalEngineHost

        self._lock = threading.Lock()
        self._host = LocalEngineHost([], {}, {}, base=base)
        self._router = JobLogRouter()
        self._router.attach(logging.getLogger(ENGINE_LOGGER))
        self._loaded: tuple[str, Any, list] = ("ok", None, [])
        try:
            self._host.start(lambda message: None, threading.Event())
        except Exception as exc:  # answered by ready(), not as a dead actor
            self._loaded = ("error", portable(exc), [])

    def ready(self) -> tuple[str, Any, list]:
        return self._loaded

    def run(self, method: str, *args: Any) -> tuple[str, Any, list]:
        """``(kind, value, what the engines logged meanwhile)``, as an engine process answers."""
        recorder = Recorder()
        with self._lock, self._router.serving([(recorder, None)]):
            try:
                return "ok", getattr(self._host, method)(*args), recorder.entries
            except Exception as exc:  # the caller decides whether this is a user error or a crash
                return "error", portable(exc), recorder.entries

    def cancel(self, sub_job_id: str, tags: list[str]) -> None:
        with contextlib.suppress(InvalidRequestError):  # a sub-job detached meanwhile: nothing of it runs
            self._host.cancel(sub_job_id, tags)


def _answer(reply: tuple[str, Any, list]) -> Any:
    kind, value, logged = reply
    relay(logged)
    if kind == "error":
        raise value
    return value


def _init_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(namespace=_NAMESPACE, include_dashboard=False, log_to_driver=False)
