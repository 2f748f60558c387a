"""Where a job's engines live: the one seam between the service and the compute behind it.

A :class:`JobEngines` builds and owns the engines of ONE job and runs one op at a time on a named
sub-job. The job manager calls it from that sub-job's ordered worker (``icefloe.engines.host.Roles``,
one role per sub-job), so a host need not lock. ``local`` keeps the engines in this process,
``process`` in a child process, ``ray`` in actors; :func:`make_engine_host` is the only map from
``ServeSettings.engines`` to a class.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from icefloe.protocol import ConfigError, InvalidRequestError, SamplingParams
from icefloe.service.results import encode_json
from icefloe.service.specs import SubJobSpec

__all__ = ["JobEngines", "LocalEngineHost", "SubJobHost", "make_engine_host"]

# Engines of two jobs are never built at the same time in one process: transformers' lazy imports
# and the tiny-model cache (resolve_model) are not safe to enter from two threads at once.
_BUILD_LOCK = threading.Lock()


class JobEngines(Protocol):
    """The engines of one job, addressed by sub-job id."""

    def start(self, on_progress: Callable[[str], None]) -> None:
        """Load every sub-job's model (slow); raise with the cause when one cannot be built."""

    def fwd_bwd(self, sub_job_id: str, batch: dict[str, Any]) -> dict[str, Any]: ...

    def forward(self, sub_job_id: str, batch: dict[str, Any]) -> dict[str, Any]: ...

    def step(self, sub_job_id: str, learning_rate: float | None) -> dict[str, Any]: ...

    def save(self, sub_job_id: str, root: Path, kind: str) -> dict[str, Any]: ...

    def load(self, sub_job_id: str, path: Path) -> dict[str, Any]: ...

    def generate(
        self, sub_job_id: str, prompts: list[list[int] | str], params: list[SamplingParams]
    ) -> list[dict[str, Any]]: ...

    def sync_weights(self, source_sub_job_id: str, target_sub_job_id: str) -> dict[str, Any]: ...

    def reset_prefix_cache(self, sub_job_id: str) -> dict[str, Any]: ...

    def max_seq_len(self, sub_job_id: str) -> int: ...

    def close(self) -> None:
        """Release every engine (memory, devices); idempotent."""


def _op(method: str) -> Callable[..., Any]:
    """A :class:`SubJobHost` method: ``self._call(sub_job_id, method, *args)``."""

    def call(self: SubJobHost, sub_job_id: str, *args: Any) -> Any:
        return self._call(sub_job_id, method, *args)

    call.__name__ = method
    return call


class SubJobHost:
    """What the local and process hosts share: the sub-job specs, and each op as one ``_call``."""

    def __init__(self, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path]) -> None:
        self._specs = {s.sub_job_id: s for s in specs}
        self._devices = devices
        self._checkpoints = checkpoints  # sub-job id -> checkpoint folder to start from

    fwd_bwd = _op("fwd_bwd")
    forward = _op("forward")
    step = _op("step")
    save = _op("save")
    load = _op("load")
    generate = _op("generate")
    reset_prefix_cache = _op("reset_prefix_cache")
    generate_json = _op("generate_json")
    sync_weights = _op("sync_weights")

    def max_seq_len(self, sub_job_id: str) -> int:
        return self._specs[sub_job_id].config.max_seq_len

    def _call(self, sub_job_id: str, method: str, *args: Any) -> Any:
        raise NotImplementedError


_ENGINE_METHODS = {"save": "save_checkpoint", "load": "load_checkpoint"}  # the other ops share the engine's names


class LocalEngineHost(SubJobHost):
    """Engines in this process: one TrainingEngine or SamplingEngine per sub-job, on its slot's device."""

    def __init__(self, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path]) -> None:
        super().__init__(specs, devices, checkpoints)
        self._engines: dict[str, Any] = {}

    def start(self, on_progress: Callable[[str], None]) -> None:
        with _BUILD_LOCK:
            self._build_all(on_progress)
        on_progress("engines ready")

    def _build_all(self, on_progress: Callable[[str], None]) -> None:
        from icefloe.engines.sampling import build_sampling_engine
        from icefloe.engines.training import TrainingEngine

        for sub_job_id, spec in self._specs.items():
            device = self._devices[sub_job_id]
            start_from = self._checkpoints.get(sub_job_id)
            on_progress(f"loading {spec.config.model!r} for {sub_job_id} on {device}")
            if spec.job_type == "sampling":
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

    def _engine(self, sub_job_id: str) -> Any:
        try:
            return self._engines[sub_job_id]
        except KeyError:
            raise InvalidRequestError(f"sub-job {sub_job_id!r} has no engine in this job") from None

    def _call(self, sub_job_id: str, method: str, *args: Any) -> Any:
        return getattr(self._engine(sub_job_id), _ENGINE_METHODS.get(method, method))(*args)

    def generate_json(self, sub_job_id: str, prompts: list[list[int] | str], params: list[SamplingParams]) -> list[str]:
        """:meth:`generate` with each sample encoded as JSON where it was made (an engine process):
        the service then answers with the text as it is, instead of unpickling and re-encoding
        thousands of samples."""
        return [encode_json(sample) for sample in self.generate(sub_job_id, prompts, params)]

    def sync_weights(self, source_sub_job_id: str, target_sub_job_id: str) -> dict[str, Any]:
        from icefloe.engines.weight_sync import sync_weights_local

        return sync_weights_local(self._engine(source_sub_job_id), self._engine(target_sub_job_id))

    def close(self) -> None:
        engines, self._engines = self._engines, {}
        for engine in engines.values():
            close = getattr(engine, "close", None)
            if callable(close):
                close()
        engines.clear()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - the service always runs with torch
            pass


def make_engine_host(
    engines: str, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path]
) -> JobEngines:
    """Build the host ``--engines`` names for one job's sub-jobs."""
    if engines == "local":
        return LocalEngineHost(specs, devices, checkpoints)
    if engines == "process":
        from icefloe.service.process_host import ProcessEngineHost

        return ProcessEngineHost(specs, devices, checkpoints)
    if engines == "ray":
        from icefloe.service.ray_host import RayEngineHost

        return RayEngineHost(specs, devices, checkpoints)
    raise ConfigError(f"serve.engines must be 'process', 'local' or 'ray'; got {engines!r}")
