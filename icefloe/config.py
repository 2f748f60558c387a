"""Configuration models for every backend.

``ClientConfig`` is the one object a caller builds; ``backend`` picks where compute runs and is
discriminated by ``type``. Environment variables are read in exactly one place,
:meth:`ClientConfig.from_env`. Validation errors name the dotted field and the fix.
"""

from __future__ import annotations

import array
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import platformdirs
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from icefloe.protocol import ConfigError

__all__ = [
    "BACKEND_ENV_VARS",
    "BackendConfig",
    "ClientConfig",
    "LocalConfig",
    "LoraConfig",
    "OptimizerConfig",
    "RayConfig",
    "RemoteConfig",
    "SamplingConfig",
    "ScheduleConfig",
    "TrainingConfig",
    "format_validation_error",
    "user_data_dir",
    "validated",
    "validation_problems",
]

_Validated = TypeVar("_Validated", bound=BaseModel)

# Env vars that pick the backend when a framework's own config cannot say (first set wins).
BACKEND_ENV_VARS = ("ICEFLOE_BACKEND", "ARCTIC_BACKEND")
_BACKEND_ALIASES = {"local": "local", "ray": "ray", "remote": "remote", "cortex": "remote"}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OptimizerConfig(_Model):
    """AdamW hyper-parameters."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must be in [0, 1); got {list(betas)}")
        return betas


class ScheduleConfig(_Model):
    """Learning-rate schedule: linear warm-up, then constant, linear or cosine decay."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int = Field(0, ge=0)  # 0 = no decay horizon (linear/cosine need one)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)  # floor of decay, as a fraction of optimizer.lr

    def multiplier(self, step: int) -> float:
        """Fraction of ``optimizer.lr`` used by 0-based optimizer step ``step``.

        Linear warm-up over ``warmup_steps`` (step 0 gets 1/warmup_steps), then constant, or a
        linear or cosine decay that reaches ``min_lr_ratio`` at ``total_steps`` and stays there.
        Every backend applies this one formula (the remote one sends the resulting rate per step).
        """
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio
        if self.kind == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    @model_validator(mode="after")
    def _decay_needs_horizon(self) -> ScheduleConfig:
        if self.kind != "constant" and self.total_steps <= 0:
            raise ValueError(
                f"lr_schedule.total_steps must be > 0 for kind={self.kind!r}; set it to the number of "
                "optimizer steps, or use kind='constant'"
            )
        if self.total_steps and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"lr_schedule.warmup_steps ({self.warmup_steps}) must not exceed total_steps ({self.total_steps})"
            )
        return self


class TrainingConfig(_Model):
    """What the training engine needs beyond the model."""

    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    grad_clip: float = Field(1.0, ge=0)  # max global grad norm; 0 = off
    lr_schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    # Positions per forward pass (rows × width, padding included); None = chosen from the model and device
    # (TrainingEngine.token_budget); 0 = one pass over the batch as sent, padding and all (for comparisons).
    micro_batch_tokens: int | None = Field(None, ge=0)
    checkpoint_dir: Path | None = None  # None = <user data dir>/checkpoints/<session>; see checkpoint_root
    gradient_checkpointing: bool = False
    peak_memory_log: bool = False  # each step reports peak_memory {gpu_peak, cpu_peak} in bytes

    def checkpoint_root(self, session: str) -> Path:
        """The absolute folder a session's checkpoints go to: ``checkpoint_dir``, else one per session
        under :func:`user_data_dir`, so a run never litters the working directory."""
        root = self.checkpoint_dir if self.checkpoint_dir is not None else user_data_dir() / "checkpoints" / session
        return root.expanduser().resolve()


class LoraConfig(_Model):
    """LoRA adapters trained (through ``peft``) instead of the full weights.

    The training API spells the same settings as a ``peft_config`` dict; :meth:`from_peft_config`
    and :meth:`to_peft_config` translate both ways.
    """

    rank: int = Field(8, ge=1)  # r: width of the low-rank update
    alpha: int = Field(8, gt=0)  # lora_alpha: the update is scaled by alpha / rank
    dropout: float = Field(0.0, ge=0, lt=1)  # on the adapter's input, in training only
    # Names (or suffixes) of the Linear modules that get an adapter, or "all-linear" (every one but the output layer).
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    bias: Literal["none", "all", "lora_only"] = "none"  # which biases train alongside the adapters
    # Narrow or widen "all-linear" (the Tinker API's flags): attention and MLP projections, and the
    # output layer (unembedding), which "all-linear" leaves out. Ignored with a list of modules.
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False

    @field_validator("target_modules", mode="before")
    @classmethod
    def _modules_named(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"must be a list of module names or 'all-linear' (write [{value!r}] for one module)")
        if isinstance(value, list | tuple):
            if not value or not all(isinstance(name, str) and name.strip() for name in value):
                raise ValueError(
                    f"must be a non-empty list of module names (e.g. ['q_proj', 'v_proj']) or 'all-linear'; "
                    f"got {list(value)!r}"
                )
            return list(value)
        return value

    @classmethod
    def from_peft_config(cls, peft_config: Mapping[str, Any]) -> LoraConfig:
        """Read the training API's ``peft_config`` (``peft_type: "Lora"``, ``r``, ``lora_alpha``, ...).

        Missing keys take the API's defaults (r = alpha = 8). Unknown keys and other ``peft_type``
        values raise :class:`ConfigError`: each would change what is trained. ``train_attn``,
        ``train_mlp`` and ``train_unembed`` (icefloe's, as the Tinker API names them) narrow or
        widen ``"all-linear"``.
        """
        layers = ("train_attn", "train_mlp", "train_unembed")
        known = {"peft_type", "r", "lora_alpha", "lora_dropout", "bias", "target_modules", *layers}
        unknown = sorted(set(peft_config) - known)
        if unknown:
            raise ConfigError(
                f"peft_config has keys icefloe does not train with: {unknown}; remove them (supported: {sorted(known)})"
            )
        kind = peft_config.get("peft_type", "Lora")
        if str(kind).lower() != "lora":
            raise ConfigError(f"peft_config.peft_type must be 'Lora'; got {kind!r} (LoRA is the only adapter type)")
        fields = {"r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout", "bias": "bias"}
        data = {ours: peft_config[theirs] for theirs, ours in fields.items() if peft_config.get(theirs) is not None}
        if peft_config.get("target_modules") is not None:
            data["target_modules"] = peft_config["target_modules"]
        data.update({key: peft_config[key] for key in layers if peft_config.get(key) is not None})
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            message = format_validation_error(exc, prefix="peft_config.")
            for ours, theirs in {**{v: k for k, v in fields.items()}, "target_modules": "target_modules"}.items():
                message = message.replace(f"peft_config.{ours}:", f"peft_config.{theirs}:")
            raise ConfigError(message) from None

    def to_peft_config(self) -> dict[str, Any]:
        """The training API's ``peft_config`` for these settings (the layer flags only where they narrow
        or widen ``"all-linear"``)."""
        layers = {
            key: value
            for key, value, default in zip(
                ("train_attn", "train_mlp", "train_unembed"), self.layers, (True, True, False), strict=True
            )
            if value != default
        }
        return {
            "peft_type": "Lora",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "bias": self.bias,
            "target_modules": self.target_modules,
            **layers,
        }

    @model_validator(mode="after")
    def _trains_something(self) -> LoraConfig:
        if self.target_modules == "all-linear" and not any(self.layers):
            raise ValueError("train_attn, train_mlp and train_unembed are all false: no layer would be trained")
        return self

    @property
    def layers(self) -> tuple[bool, bool, bool]:
        """Which layer kinds ``"all-linear"`` adapts: (attention, MLP, output layer)."""
        return (self.train_attn, self.train_mlp, self.train_unembed)

    def mismatch(self, other: LoraConfig | None) -> list[str]:
        """What differs from ``other`` in ways a weight sync cannot bridge (rank, alpha, target modules).

        Each entry reads ``"r: 8 vs 16"``; empty when the two adapters have the same shape and scale.
        """
        if other is None:
            return ["peft_config: LoRA vs none"]
        pairs = {
            "r": (self.rank, other.rank),
            "lora_alpha": (self.alpha, other.alpha),
            "target_modules": (_module_set(self.target_modules), _module_set(other.target_modules)),
            "layers (attn, mlp, unembed)": (self.layers, other.layers),
        }
        return [f"{name}: {mine!r} vs {theirs!r}" for name, (mine, theirs) in pairs.items() if mine != theirs]


def _module_set(target_modules: list[str] | str) -> list[str] | str:
    """Target modules compared without regard to order or repeats."""
    return target_modules if isinstance(target_modules, str) else sorted(set(target_modules))


class SamplingConfig(_Model):
    """What the sampling engine needs beyond the model."""

    engine: Literal["auto", "torch", "vllm"] = "auto"  # auto = vLLM on GPU when installed, else torch
    max_batch_size: int = Field(256, gt=0)  # rows generated together; larger requests are split
    # Positions (prompt + new tokens, padding included) decoded together; None = chosen from the model and
    # device (SamplingEngine.token_budget). Requests beyond either bound run in several batches.
    max_batch_tokens: int | None = Field(None, gt=0)
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)  # passed to the engine (vLLM kwargs)


class LocalConfig(_Model):
    """Run every engine inside the calling process."""

    type: Literal["local"] = "local"
    device: Literal["auto", "cpu", "cuda"] = "auto"


class RayConfig(_Model):
    """Run engines as Ray actors on a cluster (or a local Ray started on demand)."""

    type: Literal["ray"] = "ray"
    address: str | None = None  # None = start a local Ray; "auto" = join the running cluster
    namespace: str = "icefloe"
    num_cpus_per_worker: float = Field(1.0, gt=0)
    num_gpus_per_worker: float = Field(0.0, ge=0)  # fractional values allow colocation on one GPU
    colocate: bool = False  # training and sampling workers share a placement group bundle
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    fsdp: bool = False  # shard parameters with FSDP2 instead of replicating them (DDP)
    collective_backend: Literal["auto", "gloo", "nccl"] = "auto"
    job_name: str | None = None  # named actors for re-attach; None = a fresh unique name
    detached: bool = False  # actors outlive the process that created them (re-attach after it exits)
    sync_bucket_mb: int = Field(64, gt=0)  # weight sync packs parameters into flat buckets of this size


class RemoteConfig(_Model):
    """Talk to a service that speaks the training API (``icefloe serve`` or the managed endpoint).

    Holds only what it is given: :meth:`ClientConfig.from_env` fills unset fields from
    ``ICEFLOE_REMOTE_<FIELD>`` and the ``ARCTIC_CORTEX_*`` names existing recipes use.
    """

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["remote"] = "remote"
    base_url: str | None = None  # e.g. http://127.0.0.1:8321; no auth, replaces https://{host}
    host: str | None = None
    database: str | None = None
    schema_: str | None = Field(None, validation_alias=AliasChoices("schema", "schema_"), serialization_alias="schema")
    endpoint: str = "cortex-training"
    pat: SecretStr | None = Field(None, repr=False)
    pat_env_var: str = "CORTEX_PAT"
    verify_ssl: bool = True
    max_retries: int = Field(10, ge=0)
    retry_initial_s: float = Field(0.5, gt=0)  # first retry wait; doubles per attempt, plus jitter
    retry_max_s: float = Field(10.0, gt=0)  # cap on one retry wait
    request_timeout_s: float = Field(1800.0, gt=0)  # one HTTP call
    poll_interval_s: float = Field(0.5, gt=0)
    poll_multiplier: float = Field(1.25, ge=1.0)
    poll_max_interval_s: float = Field(6.0, gt=0)
    long_poll_s: float = Field(20.0, ge=0)  # ?wait= used when the service advertises it; 0 = off
    max_post_bytes: int = Field(62_914_560, gt=8192)  # per-POST cap of the training API (60 MiB)
    # Ops called together travel as one POST where the service offers it (batch_requests); False = one each.
    batch_requests: bool = True
    experiment_name: str | None = None
    cancel_on_shutdown: bool = True
    # The service has no forward op: answer forward() with zero logprobs/entropy instead of raising.
    # Sound only for on-policy, single-epoch GRPO without KL; integrations set it after their preflight.
    allow_zero_logprobs: bool = False

    @model_validator(mode="after")
    def _where(self) -> RemoteConfig:
        if self.base_url is None and self.host is None:
            return self  # checked when a client is built, so an empty config can be filled from env
        if self.host is not None and self.base_url is None and not (self.database and self.schema_):
            raise ValueError(
                "backend.database and backend.schema are required with backend.host; set them (from the "
                "environment: ICEFLOE_REMOTE_DATABASE and ICEFLOE_REMOTE_SCHEMA) or use backend.base_url for a "
                "service without auth"
            )
        return self


BackendConfig = Annotated[LocalConfig | RayConfig | RemoteConfig, Field(discriminator="type")]


class ClientConfig(_Model):
    """Everything a client needs: the model, the roles' sizes, engine settings and the backend."""

    model: str = "tiny:arith"  # a local Hugging Face causal-LM directory, or tiny:<preset> built in code
    seed: int = 0
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_seq_len: int = Field(512, gt=0)
    num_training_workers: int = Field(1, gt=0)  # data-parallel ranks (GPUs on a GPU backend)
    num_sampling_workers: int = Field(1, ge=0)  # 0 = no sampling role
    num_log_prob_workers: int = Field(0, ge=0)  # reference-policy role; 0 = none
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    backend: BackendConfig = Field(default_factory=LocalConfig)
    lora: LoraConfig | None = None  # None = train the full weights; set = train LoRA adapters only
    job_ready_timeout_s: float = Field(1800.0, gt=0)  # managed endpoints cold-start in 7-9 minutes

    @field_validator("model")
    @classmethod
    def _model_named(cls, model: str) -> str:
        if not model.strip():
            raise ValueError("model must name a local Hugging Face directory or tiny:<preset>; got ''")
        return model

    @model_validator(mode="after")
    def _lora_fits_backend(self) -> ClientConfig:
        if self.lora is not None and isinstance(self.backend, RayConfig) and self.backend.fsdp:
            raise ValueError(
                "lora with backend.fsdp=true is not supported: set backend.fsdp=false (the frozen base is "
                "replicated and only the small adapters are all-reduced) or train full weights (lora=None)"
            )
        return self

    @classmethod
    def build(cls, data: Mapping[str, Any] | None = None, **overrides: Any) -> ClientConfig:
        """Validate ``data`` (plus overrides) and raise :class:`ConfigError` naming every bad field."""
        return validated(cls, {**(data or {}), **overrides})

    @classmethod
    def from_env(
        cls, data: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None, **overrides: Any
    ) -> ClientConfig:
        """Build a config, letting the environment fill what the caller left unset.

        ``ICEFLOE_BACKEND`` (alias ``ARCTIC_BACKEND``: local | ray | remote | cortex) picks the
        backend when neither ``data`` nor ``overrides`` names one. Each remote field fills from
        ``ICEFLOE_REMOTE_<FIELD>`` (``ICEFLOE_REMOTE_HOST``, ``ICEFLOE_REMOTE_VERIFY_SSL``, ...), then its
        ``ARCTIC_CORTEX_*`` name; the PAT from the variable ``ICEFLOE_REMOTE_PAT_ENV_VAR`` (or its
        ``ARCTIC_CORTEX_*`` name) names, else ``ICEFLOE_REMOTE_PAT``, ``ARCTIC_CORTEX_PAT``, ``CORTEX_PAT``. Only
        ``environ`` is read (default ``os.environ``); explicit values always win.
        """
        env = dict(os.environ if environ is None else environ)
        merged: dict[str, Any] = {**(data or {}), **overrides}
        backend = merged.get("backend")
        if isinstance(backend, BaseModel):
            backend = backend.model_dump(by_alias=True, exclude_unset=True) | {"type": backend.type}
        backend = dict(backend or {})
        if "type" not in backend:
            chosen = next((env[name] for name in BACKEND_ENV_VARS if env.get(name)), None)
            if chosen is not None:
                kind = _BACKEND_ALIASES.get(chosen.strip().lower())
                if kind is None:
                    raise ConfigError(
                        f"ICEFLOE_BACKEND / ARCTIC_BACKEND must be one of {sorted(_BACKEND_ALIASES)}; got {chosen!r}"
                    )
                backend["type"] = kind
        if backend.get("type") == "remote":
            backend = _remote_from_env(backend, env)
        if backend:
            merged["backend"] = backend
        return cls.build(merged)


# The names existing recipes use, read after ICEFLOE_REMOTE_<FIELD>.
_CORTEX_ENV_NAMES = {
    "base_url": "ARCTIC_CORTEX_BASE_URL",
    "host": "ARCTIC_CORTEX_HOST",
    "database": "ARCTIC_CORTEX_DATABASE",
    "schema": "ARCTIC_CORTEX_SCHEMA",
    "endpoint": "ARCTIC_CORTEX_ENDPOINT",
    "pat_env_var": "ARCTIC_CORTEX_PAT_ENV_VAR",
}


def _remote_from_env(explicit: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Fill unset remote fields from ``env``; explicit keys are never overwritten."""
    filled = dict(explicit)
    if "schema_" in filled:
        filled["schema"] = filled.pop("schema_")
    for field in RemoteConfig.model_fields:
        name = field.rstrip("_")
        if name in ("type", "pat") or filled.get(name) is not None:
            continue
        env_names = (f"ICEFLOE_REMOTE_{name.upper()}", _CORTEX_ENV_NAMES.get(name, ""))
        value = next((env[n] for n in env_names if env.get(n)), None)
        if value is not None:
            filled[name] = value
    if filled.get("pat") is None:
        # a variable the caller named first, then icefloe's own name before the managed API's generic one
        named = [filled["pat_env_var"]] if filled.get("pat_env_var") else []
        names = (*named, "ICEFLOE_REMOTE_PAT", "ARCTIC_CORTEX_PAT", "CORTEX_PAT")
        pat = next((env[n] for n in names if env.get(n)), None)
        if pat:
            filled["pat"] = pat
    return filled


def user_data_dir() -> Path:
    """Where icefloe keeps what it writes when no folder is given (checkpoints, ``icefloe serve`` data):
    the platform's user data directory, e.g. ``~/.local/share/icefloe`` (``$XDG_DATA_HOME/icefloe``)."""
    return platformdirs.user_data_path("icefloe")


def validation_problems(exc: ValidationError, prefix: str = "", whole: str = "config") -> list[str]:
    """One ``field: problem; got value`` clause per bad field, dotted from ``prefix`` (``whole`` when the
    error is about the value as a whole); no secret values."""
    problems = []
    for err in exc.errors():
        parts = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
        if parts[:1] == ["backend"] and parts[1:2] and parts[1] in _BACKEND_ALIASES.values():
            del parts[1]  # the union's tag: the field is backend.<name>, whatever the type
        loc = ".".join(parts)
        loc = f"{prefix}{loc}" if loc else prefix.rstrip(".") or whole
        msg = err["msg"].removeprefix("Value error, ")
        given = err.get("input")
        if isinstance(given, Mapping | list | array.array) or loc.endswith("pat"):  # not repeated: it may be long
            problems.append(f"{loc}: {msg}")
        else:
            problems.append(f"{loc}: {msg}; got {given!r}")
    return problems


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per bad field: dotted path, what was wrong, the value given."""
    return "invalid icefloe config:\n  " + "\n  ".join(validation_problems(exc, prefix))


def validated(model: type[_Validated], data: Mapping[str, Any], prefix: str = "") -> _Validated:
    """``data`` validated as ``model``, or :class:`ConfigError` naming every bad field (dotted from ``prefix``)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, prefix=prefix)) from None
