"""Where a job's engines live: the one seam between the service and the compute behind it.

A :class:`JobEngines` builds and owns the engines of ONE job and runs one op at a time on a named
sub-job, called from that sub-job's ordered worker, so a host need not lock. ``local`` keeps the
engines in this process, ``process`` in a child process, ``ray`` in actors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from icefloe.protocol import ClientClosedError, ConfigError, InvalidRequestError, SamplingParams
from icefloe.service.results import encode_json
from icefloe.service.specs import SubJobSpec

__all__ = ["JobEngines", "LocalEngineHost", "make_engine_host"]

# Engines of two jobs are never built at the same time in one process: transformers' lazy imports
# and the tiny-model cache (resolve_model) are not safe to enter from two threads at once.
_BUILD_LOCK = threading.Lock()


def _op(method: str) -> Callable[..., Any]:
    def call(self: JobEngines, sub_job_id: str, *args: Any) -> Any:
        return self._call(sub_job_id, method, *args)

    call.__name__ = method
    return call


# The service's name for an op -> the engine method it calls and that method's keyword arguments,
# where the two differ.
_ENGINE_METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "save": ("save_checkpoint", {}),
    "load": ("load_checkpoint", {}),
    "forward_reference": ("forward", {"reference": True}),  # a LoRA trainer with its adapters disabled
}


class JobEngines:
    """The engines of one job, addressed by sub-job id; each op is one :meth:`_call`, by default the
    engine method of that name on ``self._engines[sid]``.

    A subclass fills ``_engines`` in ``start`` (slow; raise with the cause when an engine cannot be
    built, and give up soon once the ``stop`` event is set) and releases them in ``close``
    (idempotent), also after a start that failed or gave up.
    """

    def __init__(self, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path]) -> None:
        self._specs = {s.sub_job_id: s for s in specs}
        self._devices = devices
        self._checkpoints = checkpoints  # sub-job id -> checkpoint folder to start from
        self._engines: dict[str, Any] = {}

    fwd_bwd = _op("fwd_bwd")
    forward = _op("forward")
    forward_reference = _op("forward_reference")
    step = _op("step")
    save = _op("save")
    load = _op("load")
    generate = _op("generate")
    reset_prefix_cache = _op("reset_prefix_cache")
    sync_weights = _op("sync_weights")

    def generate_json(self, sub_job_id: str, prompts: list[list[int] | str], params: list[SamplingParams]) -> list[str]:
        """:meth:`generate` with each sample encoded as JSON, so the answer splices the text in as it is."""
        return [encode_json(sample) for sample in self.generate(sub_job_id, prompts, params)]

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        raise NotImplementedError

    def cancel(self, sub_job_id: str, tags: list[str]) -> None:
        """Stop the calls tagged so (``SamplingParams.tag``) of the sampler's generate at their next decode
        step, or as soon as it starts; returns at once, while that generate may still run."""
        self._engine(sub_job_id).cancel(tags)

    def interrupt(self) -> None:
        """Fail the calls waiting on the engines now (engines in this process have none to fail)."""

    #: What :meth:`kill` ends, in words; None = engines in this process, which nothing can stop.
    killable: str | None = None

    def kill(self) -> None:
        """End the engines now, whatever they are running (an op past its deadline)."""

    def close(self) -> None:
        raise NotImplementedError

    def _call(self, sub_job_id: str, method: str, *args: Any) -> Any:
        name, kwargs = _ENGINE_METHODS.get(method, (method, {}))
        return getattr(self._engine(sub_job_id), name)(*args, **kwargs)

    def _engine(self, sub_job_id: str) -> Any:
        try:
            return self._engines[sub_job_id]
        except KeyError:
            raise InvalidRequestError(f"sub-job {sub_job_id!r} has no engine in this job") from None


class LocalEngineHost(JobEngines):
    """Engines in this process: one TrainingEngine or SamplingEngine per sub-job, on its slot's device."""

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        with _BUILD_LOCK:
            self._build_all(on_progress, stop)
        on_progress("engines ready")

    def _build_all(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        from icefloe.engines.sampling import build_sampling_engine
        from icefloe.engines.training import TrainingEngine

        for sub_job_id, spec in self._specs.items():
            stop_check(stop)  # an engine loading in this process cannot be cut short: give up between them
            device = self._devices[sub_job_id]
            start_from = self._checkpoints.get(sub_job_id)
            on_progress(f"loading {spec.config.model!r} for {sub_job_id} on {device}")
            if spec.job_type == "sampling":  # a weights-only LoRA checkpoint: the base model with its adapter
                engine = build_sampling_engine(spec.config, device, model_dir=start_from)
            else:
                role = "training" if spec.is_training else "reference"
                engine = TrainingEngine(spec.config, device=device, role=role)
                if start_from is not None:
                    loaded = engine.load_checkpoint(start_from)
                    if spec.is_training and not spec.load_optimizer_states and engine.optimizer is not None:
                        engine.optimizer.state.clear()  # load_optimizer_states=false: weights only, fresh AdamW
                    on_progress(f"{sub_job_id} starts from {loaded['checkpoint_id']} ({loaded['kind']})")
            self._engines[sub_job_id] = engine

    def sync_weights(
        self, source_sub_job_id: str, target_sub_job_id: str, weight_format: str | None = None
    ) -> dict[str, Any]:
        from icefloe.engines.weight_sync import sync_weights_local

        source, target = self._engine(source_sub_job_id), self._engine(target_sub_job_id)
        return sync_weights_local(source, target, weight_format)

    def close(self) -> None:
        import torch

        engines, self._engines = self._engines, {}
        for engine in engines.values():
            if callable(getattr(engine, "close", None)):
                engine.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def stop_check(stop: threading.Event) -> None:
    """Give up an engine start once the job is stopping."""
    if stop.is_set():
        raise ClientClosedError("the job stopped while its engines were starting")


def make_engine_host(
    engines: str, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path], log_dir: Path
) -> JobEngines:
    """Build the host ``--engines`` names for one job's sub-jobs (``log_dir``: the job's log folder)."""
    if engines == "local":
        return LocalEngineHost(specs, devices, checkpoints)
    if engines == "process":
        from icefloe.service.process_host import ProcessEngineHost

        return ProcessEngineHost(specs, devices, checkpoints, log_dir)
    if engines == "ray":
        from icefloe.service.ray_host import RayEngineHost

        return RayEngineHost(specs, devices, checkpoints)
    raise ConfigError(f"serve.engines must be 'process', 'local' or 'ray'; got {engines!r}")
