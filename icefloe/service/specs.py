"""Turn a create-job body into one engine configuration (:class:`ClientConfig`) per sub-job: the one
mapping between the training API's names and the engines'.

``model_name`` is a ``tiny:<preset>`` or a model folder under ``ServeSettings.model_root``, named
relative to it or by its full path. Anything else gets one fixed refusal that says nothing about
the file system. Each passthrough key (DeepSpeed, PrimeRL, vLLM knobs) is honoured, refused with
the fix when it would change what is trained, or recorded and reported in the job's ``warnings``
when it only tunes machinery these engines do not have.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icefloe.config import ClientConfig, LoraConfig
from icefloe.engines.models import cached_hub_model
from icefloe.protocol import SEGMENT_BY_JOB_TYPE, ConfigError, InvalidRequestError
from icefloe.service.limits import MAX_LISTED_ERRORS, MAX_LORA_RANK
from icefloe.service.schemas import InferenceConfig, JobCreate, SubJobConfig, TrainingConfigSpec

__all__ = ["SubJobSpec", "body_warnings", "sub_job_specs"]

_log = logging.getLogger("icefloe.service")

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_PRESET_PREFIX = "tiny:"  # models built in code (icefloe.engines.models.TINY_PRESETS)
_MAX_MODEL_NAME = 1024
_PRIME_RL_DTYPES = ("optimization_dtype", "reduce_dtype")
# Passthrough keys that tune machinery these engines do not have: accepted, reported as unused.
_NO_COUNTERPART = {
    "cuda_allocator_conf": "the CUDA allocator is not configured per job",
    "nccl_debug": "NCCL logging is not configured per job",
    "training_memory_telemetry": "use step_peak_memory_log for per-step peak memory",
    "model_provider": "models load through Hugging Face transformers",
    "attn_implementation": "attention runs in transformers' default implementation",
    "attn_impl": "attention runs in transformers' default implementation",
    "ep_size": "there is no expert parallelism: every rank holds the whole model",
    "sp_size": "there is no sequence parallelism: every rank holds whole sequences",
    "ac_config": "activation checkpointing is on or off (activation_checkpointing), with no frequency or offload",
    "ds_config": "training runs PyTorch AdamW, not DeepSpeed (ZeRO stages and DeepSpeed batch sizes do not apply)",
    "prime_rl": "the PrimeRL model provider and its kernels are not used",
    "seq_len": "the PrimeRL model provider is not used",
    "ep_comm_backend": "there is no expert parallelism",
    "moe_use_grouped_mm": "the PrimeRL model provider and its kernels are not used",
    "fused_lm_head_token_chunk_size": "the PrimeRL model provider and its kernels are not used",
    "fp32_lm_head": "the PrimeRL model provider and its kernels are not used",
    "fused_cross_entropy": "the PrimeRL model provider and its kernels are not used",
    "optimization_dtype": "training runs in the sub-job's dtype",
    "reduce_dtype": "training runs in the sub-job's dtype",
    "multiplex_job_id": "sub-jobs are not multiplexed: this one gets slots of its own",
    "global_batch_size": "each forward-backward's batch is its own; put global_batch_size in the loss config",
}
# The passthrough keys a section reads or answers: sent on the sub-job itself they would do nothing.
_SECTION_KEYS = {
    *_NO_COUNTERPART,
    *TrainingConfigSpec.model_fields,
    *InferenceConfig.model_fields,
    *("peft_config", "activation_checkpointing", "mb_spec", "router_replay", "vllm_config", "gpu_memory_utilization"),
} - set(SubJobConfig.model_fields)


@dataclass(frozen=True, slots=True)
class SubJobSpec:
    """What one sub-job runs: its id, role, engine config and how many slots it occupies."""

    sub_job_id: str
    job_type: str  # training | sampling | log_probability
    model_name: str  # as the caller sent it; config.model holds the folder it names
    config: ClientConfig
    num_slots: int
    source_checkpoint: dict[str, Any] | None  # {checkpoint_id, source_job_id?} to start from
    load_optimizer_states: bool
    public_config: dict[str, Any]  # the config as sent, passthrough keys included, peft_config as applied
    warnings: tuple[str, ...] = ()  # passthrough keys accepted but not used, each with the reason

    @property
    def is_training(self) -> bool:
        return self.job_type == "training"


def _model(name: str, model_root: Path | None, where: str) -> str:
    """What the engines load for ``model_name``: the preset itself, the folder it names under the root, or a
    hub id's snapshot in the service's Hugging Face cache. The caller's refusal never says why (it would map
    the host's folders); the service log does. A name the file system cannot take (too long, a NUL, a link
    loop) is refused like any unknown one."""
    if name.startswith(_PRESET_PREFIX):
        return name
    why = "no --model-root"
    if len(name) > _MAX_MODEL_NAME or not name.isprintable():
        why = "a name the file system cannot take"
    elif model_root is not None:
        root = model_root.resolve()
        named = Path(os.path.normpath(root / name))  # lexical first: ".." or a path outside is refused unread
        try:
            real = named.resolve()  # a link inside the root may lead out of it
            if not named.is_relative_to(root):
                why = f"{named} is outside the model root {root}"
            elif not real.is_relative_to(root):
                why = f"{named} is a link to {real}, outside the model root {root}: move the model under the root"
            elif not (real / "config.json").is_file():
                why = f"{real} holds no config.json" if real.is_dir() else f"there is no folder {named}"
            else:
                return str(real)
        except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a link loop
            why = f"{named} cannot be read ({type(exc).__name__})"
    cached = cached_hub_model(name) if why != "a name the file system cannot take" else None
    if cached is not None:
        return str(cached)
    shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name)} characters)"
    _log.warning("%s.model_name %r refused: %s; not a hub id in the Hugging Face cache either", where, shown, why)
    raise InvalidRequestError(
        f"{where}.model_name {shown!r} is not a model this service offers; send tiny:<preset>, the name of a "
        "model folder under the service's model root (icefloe serve --model-root), such as org/name, or the hub "
        "id of a model in the service's Hugging Face cache"
    )


def _lora(raw: Any, where: str) -> LoraConfig:
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{where}.peft_config must be an object like {{'peft_type': 'Lora', 'r': 8}}")
    try:
        lora = LoraConfig.from_peft_config(raw)
    except ConfigError as exc:
        raise InvalidRequestError(f"{where}.{exc}") from None
    if lora.rank > MAX_LORA_RANK:
        raise InvalidRequestError(
            f"{where}.peft_config.r is {lora.rank}; a LoRA rank is at most {MAX_LORA_RANK} here (its adapter shares "
            "a host with other runs): send a smaller r, or train full weights (no peft_config)"
        )
    return lora


def _refuse_training_changes(sub: SubJobConfig, extra: dict[str, Any], dtype: str, where: str) -> None:
    """Passthrough settings that would change what is trained and that these engines cannot honour."""
    if sub.post_init_hooks:
        raise InvalidRequestError(
            f"{where}.model_post_init={sub.post_init_hooks!r}: model post-init hooks "
            "are not supported here; remove model_post_init"
        )
    where = f"{where}.{sub.section_name}"
    if extra.get("router_replay"):
        raise InvalidRequestError(
            f"{where}.router_replay={extra['router_replay']!r}: MoE router replay is not supported; remove it"
        )
    ds = extra.get("ds_config") if isinstance(extra.get("ds_config"), dict) else {}
    steps = ds.get("gradient_accumulation_steps")
    if steps not in (None, 1, "auto"):
        raise InvalidRequestError(
            f"{where}.ds_config.gradient_accumulation_steps={steps!r}: every step applies the gradients of all "
            "forward-backward calls since the last one; send several forward-backward calls per step instead"
        )
    for flag, wanted in (("bf16", "bfloat16"), ("fp16", "float16")):
        if isinstance(ds.get(flag), dict) and ds[flag].get("enabled") is True and dtype != wanted:
            raise InvalidRequestError(
                f"{where}.ds_config.{flag}.enabled=true trains in {wanted}, but the sub-job's dtype is {dtype}; "
                f"set the sub-job's dtype to {wanted!r}, or drop {flag}.enabled"
            )
    prime = extra.get("prime_rl") if isinstance(extra.get("prime_rl"), dict) else {}
    for key in _PRIME_RL_DTYPES:
        for name, value in ((key, extra.get(key)), (f"prime_rl.{key}", prime.get(key))):
            if value is not None and _DTYPES.get(value, value) != dtype:
                raise InvalidRequestError(
                    f"{where}.{name}={value!r}: training runs in the sub-job's dtype ({dtype}); set the sub-job's "
                    f"dtype to {value!r} or drop {name}"
                )
    if sub.training_config is not None and sub.training_config.optimizer.model_extra:
        keys = sorted(sub.training_config.optimizer.model_extra)
        raise InvalidRequestError(
            f"{where}.optimizer has settings AdamW here does not take: {keys}; "
            "remove them (supported: name, lr, betas, weight_decay, eps)"
        )


def _client_config(sub: SubJobConfig, model_root: Path | None, where: str) -> tuple[ClientConfig, list[str]]:
    """The sub-job's engine config and the warnings for passthrough keys it accepts but does not use."""
    model = _model(sub.model_name.strip(), model_root, where)
    data: dict[str, Any] = {"model": model, "seed": sub.seed or 0}
    if sub.dtype:
        data["dtype"] = _DTYPES.get(sub.dtype, sub.dtype)
    misplaced = sorted(set(sub.model_extra or {}) & _SECTION_KEYS)
    if misplaced:
        raise InvalidRequestError(
            f"{where} has {misplaced} on the sub-job itself, where they do nothing; "
            f"move them into {where}.{sub.section_name}"
        )
    section = sub.section
    extra = dict(section.model_extra or {}) if section is not None else {}
    if section is not None and section.multiplex_job_id is not None:
        extra["multiplex_job_id"] = section.multiplex_job_id
    _refuse_training_changes(sub, extra, data.get("dtype", "float32"), where)
    if extra.get("peft_config") is not None:
        data["lora"] = _lora(extra.pop("peft_config"), f"{where}.{sub.section_name}")
    if sub.job_type == "training":
        tc = sub.training_config or TrainingConfigSpec()
        opt = tc.optimizer
        data["max_seq_len"] = tc.max_seq_len
        training = data["training"] = {
            "optimizer": {"lr": opt.lr, "betas": opt.betas, "weight_decay": opt.weight_decay, "eps": opt.eps}
        }
        if tc.gradient_clipping is not None:
            training["grad_clip"] = tc.gradient_clipping
        if tc.step_peak_memory_log:
            training["peak_memory_log"] = True
        if "activation_checkpointing" in extra:
            training["gradient_checkpointing"] = extra.pop("activation_checkpointing")
        mb_spec = extra.pop("mb_spec", None) or {}
        if not isinstance(mb_spec, dict):
            raise InvalidRequestError(
                f"{where}.training_config.mb_spec must be an object like {{'max_tokens_per_mb': 4096}}"
            )
        if "max_tokens_per_mb" in mb_spec:
            training["micro_batch_tokens"] = mb_spec["max_tokens_per_mb"]
        extra.update({f"mb_spec.{key}": value for key, value in mb_spec.items() if key != "max_tokens_per_mb"})
    else:
        data["max_seq_len"] = (sub.inference_config or InferenceConfig()).max_seq_len
        if sub.job_type == "sampling":  # vLLM's engine kwargs (a torch sampler has none to tune)
            engine_kwargs = extra.pop("vllm_config", None) or {}
            if "gpu_memory_utilization" in extra:
                engine_kwargs = {**engine_kwargs, "gpu_memory_utilization": extra.pop("gpu_memory_utilization")}
            data["sampling"] = {"engine_kwargs": engine_kwargs}
    try:
        config = ClientConfig.build(data)
    except ConfigError as exc:
        raise InvalidRequestError(f"{where}: {exc}") from None
    warnings = [
        f"{where}.{sub.section_name}.{key} is recorded but not used: "
        f"{_NO_COUNTERPART.get(key, 'icefloe does not know this key')}"
        for key in sorted(extra)
    ]
    warnings += [
        f"{where}.{key} is recorded but not used: the sub-job has no such field"
        for key in sorted(set(sub.model_extra or {}) - _SECTION_KEYS)
    ]
    if sub.global_batch_size is not None:
        why = _NO_COUNTERPART["global_batch_size"]
        warnings.append(f"{where}.global_batch_size is recorded but not used: {why}")
    return config, warnings


def _public_config(section: TrainingConfigSpec | InferenceConfig | None, config: ClientConfig) -> dict[str, Any]:
    public = section.model_dump(mode="json") if section is not None else {}
    if config.lora is not None:
        public["peft_config"] = config.lora.to_peft_config()  # as applied: defaults filled in
    return public


def _check_adapters_match(specs: list[SubJobSpec]) -> None:
    """Training and sampling sub-jobs need the same LoRA shape (or none) for a weight sync to work."""
    trained = [s for s in specs if s.job_type in ("training", "sampling") or s.config.lora is not None]
    if not any(s.is_training for s in trained):
        return  # samplers alone may each serve their own adapter
    first = next(s for s in trained if s.is_training)
    for other in trained:
        mine, theirs = first.config.lora, other.config.lora
        if mine is None and theirs is None:
            continue
        differences = mine.mismatch(theirs) if mine is not None else ["peft_config: none vs LoRA"]
        if differences:
            raise InvalidRequestError(
                f"peft_config of {first.sub_job_id} and {other.sub_job_id} differ ({first.sub_job_id} vs "
                f"{other.sub_job_id}): {'; '.join(differences)}; give the training and sampling sub-jobs the same "
                "peft_config (r, lora_alpha, target_modules), or none to train full weights"
            )


def body_warnings(body: JobCreate) -> list[str]:
    """A warning for each top-level key of a create-job body that nothing reads (a misplaced sub-job field
    among them would otherwise vanish in silence): the first :data:`MAX_LISTED_ERRORS`, then a count."""
    sub_job_fields = {info.alias or name for name, info in SubJobConfig.model_fields.items()}
    unknown = sorted(body.model_extra or {})
    warnings = [
        f"{key if len(key) <= 80 else key[:77] + '...'} is recorded but not used: "
        + ("it is a sub-job field; put it in each entry of sub_job_configs" if key in sub_job_fields else
           "the create-job body has no such field")
        for key in unknown[:MAX_LISTED_ERRORS]
    ]  # fmt: skip
    if len(unknown) > MAX_LISTED_ERRORS:
        warnings.append(f"... and {len(unknown) - MAX_LISTED_ERRORS} more top-level keys are recorded but not used")
    return warnings


def sub_job_specs(job_id: str, body: JobCreate, *, model_root: Path | None = None) -> list[SubJobSpec]:
    """One spec per entry of ``sub_job_configs``; ids count occurrences of each type from zero.

    Raises:
        InvalidRequestError: a bad field, or a ``model_name`` that is not a preset nor a model folder
            under ``model_root`` (None: presets only).
    """
    counts: dict[str, int] = {}
    specs = []
    for position, sub in enumerate(body.sub_job_configs):
        index = counts.get(sub.job_type, 0)
        counts[sub.job_type] = index + 1
        section = sub.section
        config, warnings = _client_config(sub, model_root, f"sub_job_configs.{position}")
        specs.append(
            SubJobSpec(
                sub_job_id=f"{job_id}:{SEGMENT_BY_JOB_TYPE[sub.job_type]}:{index}",
                job_type=sub.job_type,
                model_name=sub.model_name.strip(),
                config=config,
                num_slots=section.n_gpus if section is not None else 1,
                source_checkpoint=(
                    sub.source_checkpoint_info.model_dump(exclude_none=True) if sub.source_checkpoint_info else None
                ),
                load_optimizer_states=getattr(section, "load_optimizer_states", None) is not False,
                public_config=_public_config(section, config),
                warnings=tuple(warnings),
            )
        )
    _check_adapters_match(specs)
    if not any(s.is_training for s in specs):
        for position, spec in enumerate(specs):
            if spec.num_slots == 0:
                raise InvalidRequestError(
                    f"sub_job_configs.{position}.inference_config.n_gpus is 0, which shares the training "
                    "sub-job's device, but this job has no training sub-job; give n_gpus >= 1"
                )
    return specs
