"""The older flat client config that SkyRL integrations build, and its promotion to ``ClientConfig``.

SkyRL integrations construct this flat model with ``backend="local"`` baked in, because SkyRL's own
config has no notion of where compute runs. The one way to route such a run elsewhere without
patching SkyRL is the environment: ``ICEFLOE_BACKEND`` (alias ``ARCTIC_BACKEND``) promotes the
baked-in default inside this model's before-validator. An explicit non-default backend always wins.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from icefloe.config import BACKEND_ENV_VARS, ClientConfig, validated

__all__ = ["LegacyClientConfig"]

logger = logging.getLogger(__name__)

# Backend names the flat config accepts → icefloe backend types ("cortex" is the managed endpoint).
_BACKENDS = {"local": "local", "ray": "ray", "remote": "remote", "cortex": "remote"}
# Flat fields of the older client that icefloe has no use for: accepted so old recipes parse, then warned about.
_INERT_FIELDS = (
    "arctic_inference_config",
    "ds_worker_config",
    "full_determinism",
    "health_check_interval",
    "log_prob_ds_config",
    "log_prob_engine",
    "ray_auto_attach",
    "server_logs",
    "startup_timeout",
)


class LegacyClientConfig(BaseModel):
    """Flat fields of the older RL client (``backend``, ``comm_protocol``, GPU counts, ...).

    ``backend="local"`` with ``comm_protocol="ray"`` means engines on Ray actors; with
    ``comm_protocol="http"`` and a ``host`` it means a service at ``http://host:port``; otherwise
    the engines run in this process.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    backend: Literal["local", "ray", "remote", "cortex"] = "local"
    comm_protocol: Literal["http", "ray"] = "http"
    host: str | None = None
    port: int | None = Field(None, gt=0, lt=65536)
    model_name: str = "tiny:arith"
    checkpoint_path: str | None = None
    seed: int = 0
    training_gpus: int = Field(1, ge=0)
    sampling_gpus: int = Field(1, ge=0)
    log_prob_gpus: int = Field(0, ge=0)
    colocate: bool = False
    cuda_ipc: bool = False
    low_memory: bool = False
    job_ready_timeout: float = Field(1800.0, gt=0)
    ds_config: dict[str, Any] = Field(default_factory=dict)  # optimizer + gradient_clipping are read
    training_config: dict[str, Any] = Field(default_factory=dict)  # optimizer / lr_scheduler are read
    vllm_config: dict[str, Any] = Field(default_factory=dict)  # passed to the sampling engine
    training_job_id: str | None = Field(None, exclude=True)
    sampling_job_id: str | None = Field(None, exclude=True)
    log_prob_job_id: str | None = Field(None, exclude=True)
    arctic_inference_config: dict[str, Any] | None = None
    ds_worker_config: dict[str, Any] | None = None
    full_determinism: bool = False
    health_check_interval: float | None = None
    log_prob_ds_config: dict[str, Any] | None = None
    log_prob_engine: str | None = None
    ray_auto_attach: bool | None = None
    server_logs: bool | None = None
    startup_timeout: float | None = None

    @model_validator(mode="before")
    @classmethod
    def _backend_from_env(cls, data: Any) -> Any:
        """Promote the baked-in ``backend="local"`` (or no backend) to the one the environment names."""
        if not isinstance(data, dict):
            return data
        given = data.get("backend")
        if given is not None and str(given).strip().lower() != "local":
            return data  # an explicit non-default choice is never overridden
        name, chosen = next(((n, os.environ[n]) for n in BACKEND_ENV_VARS if os.environ.get(n)), (None, None))
        if chosen is None:
            return data
        kind = chosen.strip().lower()
        if kind not in _BACKENDS:
            raise ValueError(f"{name} must be one of {sorted(_BACKENDS)}; got {chosen!r}")
        return {**data, "backend": kind}

    @classmethod
    def build(cls, **fields: Any) -> LegacyClientConfig:
        """Validate, raising :class:`ConfigError` that names every bad field."""
        return validated(cls, fields)

    @property
    def backend_type(self) -> str:
        """The icefloe backend this flat config resolves to."""
        kind = _BACKENDS[self.backend]
        if kind == "local" and self.comm_protocol == "ray":
            return "ray"
        if kind == "local" and self.host:
            return "remote"
        return kind

    def to_client_config(self, **sections: Any) -> ClientConfig:
        """Translate to :class:`ClientConfig`; ``sections`` (``training``, ``sampling``, ...) merge over it.

        Remote fields left unset here fill from ``ICEFLOE_REMOTE_*`` / ``ARCTIC_CORTEX_*`` through
        :meth:`ClientConfig.from_env`, the one place the environment is read for them.
        """
        for name in _INERT_FIELDS:
            if name in self.model_fields_set:
                logger.warning("legacy client config field %r has no effect on icefloe; remove it", name)
        kind = self.backend_type
        backend: dict[str, Any] = {"type": kind}
        if kind == "ray":
            backend["colocate"] = self.colocate
        elif kind == "remote" and self.host:
            backend["base_url"] = f"http://{self.host}:{self.port or 7000}"
        data: dict[str, Any] = {
            "model": self.model_name,
            "seed": self.seed,
            "num_training_workers": max(self.training_gpus, 1),
            "num_sampling_workers": self.sampling_gpus,
            "num_log_prob_workers": self.log_prob_gpus,
            "job_ready_timeout_s": self.job_ready_timeout,
            "training": self._training_section(),
            "sampling": {"engine_kwargs": dict(self.vllm_config)} if self.vllm_config else {},
            "backend": backend,
        }
        for name, section in sections.items():
            current = data.get(name)
            data[name] = {**current, **section} if isinstance(current, dict) and isinstance(section, dict) else section
        return ClientConfig.from_env(data)

    def _training_section(self) -> dict[str, Any]:
        """Optimizer and clipping from ``ds_config`` (DeepSpeed layout) or ``training_config``."""
        training: dict[str, Any] = {}
        optimizer = self.ds_config.get("optimizer") or self.training_config.get("optimizer") or {}
        params = optimizer.get("params", optimizer) if isinstance(optimizer, dict) else {}
        picked = {key: params[key] for key in ("lr", "betas", "eps", "weight_decay") if key in params}
        if picked:
            training["optimizer"] = picked
        if self.ds_config.get("gradient_clipping") is not None:
            training["grad_clip"] = self.ds_config["gradient_clipping"]
        if self.checkpoint_path:
            training["checkpoint_dir"] = self.checkpoint_path
        return training
