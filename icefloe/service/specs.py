"""Turn a create-job body into one engine configuration per sub-job.

The training API names things its own way (``model_name``, ``training_config.gradient_clipping``,
``inference_config.max_seq_len``); engines take a :class:`ClientConfig`. This is the one mapping
between the two, so a field the API adds later is wired in one place.

``model_name`` is a ``tiny:<preset>`` or a model folder under ``ServeSettings.model_root``, named
relative to it (``org/name`` for a hub-style layout) or by its full path. Anything else gets one
fixed refusal that says nothing about the file system: not whether a path exists, nor why it
was refused.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icefloe.config import ClientConfig
from icefloe.protocol import ConfigError, InvalidRequestError
from icefloe.service.models import InferenceConfig, JobCreate, SubJobConfig, TrainingConfigSpec

__all__ = ["SEGMENT_BY_JOB_TYPE", "TYPED_CONFIG_KEYS", "SubJobSpec", "sub_job_specs"]

SEGMENT_BY_JOB_TYPE = {"training": "training", "sampling": "sampling", "log_probability": "log_prob"}
# Keys of training_config / inference_config this service reads; the rest are recorded passthrough.
TYPED_CONFIG_KEYS = frozenset(TrainingConfigSpec.model_fields) | frozenset(InferenceConfig.model_fields)
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_PRESET_PREFIX = "tiny:"  # models built in code (icefloe.engines.models.TINY_PRESETS)


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
    public_config: dict[str, Any]  # the config as sent, passthrough keys included

    @property
    def is_training(self) -> bool:
        return self.job_type == "training"


def _model(name: str, model_root: Path | None, where: str) -> str:
    """What the engines load for ``model_name``: the preset itself, or the folder it names under the root."""
    if name.startswith(_PRESET_PREFIX):
        return name
    if model_root is not None:
        root = model_root.resolve()
        named = Path(os.path.normpath(root / name))  # lexical first: ".." or a path outside is refused unread
        if named.is_relative_to(root):
            real = named.resolve()  # a link inside the root may lead out of it
            if real.is_relative_to(root) and (real / "config.json").is_file():
                return str(real)
    raise InvalidRequestError(
        f"{where}.model_name {name!r} is not a model this service offers; send tiny:<preset> or the name of a "
        "model folder under the service's model root (icefloe serve --model-root), such as org/name"
    )


def _client_config(sub: SubJobConfig, model_root: Path | None, where: str) -> ClientConfig:
    model = _model(sub.model_name.strip(), model_root, where)
    data: dict[str, Any] = {"model": model, "seed": sub.seed or 0}
    if sub.dtype:
        data["dtype"] = _DTYPES.get(sub.dtype, sub.dtype)
    if sub.job_type == "training":
        tc = sub.training_config or TrainingConfigSpec()
        opt = tc.optimizer
        data["max_seq_len"] = tc.max_seq_len
        data["training"] = {
            "optimizer": {"lr": opt.lr, "betas": opt.betas, "weight_decay": opt.weight_decay, "eps": opt.eps}
        }
        if tc.gradient_clipping is not None:
            data["training"]["grad_clip"] = tc.gradient_clipping
        if tc.step_peak_memory_log:
            data["training"]["peak_memory_log"] = True
    else:
        data["max_seq_len"] = (sub.inference_config or InferenceConfig()).max_seq_len
    try:
        return ClientConfig.build(data)
    except ConfigError as exc:
        raise InvalidRequestError(f"{where}: {exc}") from None


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
        where = f"sub_job_configs.{position}"
        section = sub.training_config if sub.job_type == "training" else sub.inference_config
        num_gpus = section.n_gpus if section is not None else 1
        load_optimizer = True
        if isinstance(section, TrainingConfigSpec) and section.load_optimizer_states is False:
            load_optimizer = False
        specs.append(
            SubJobSpec(
                sub_job_id=f"{job_id}:{SEGMENT_BY_JOB_TYPE[sub.job_type]}:{index}",
                job_type=sub.job_type,
                model_name=sub.model_name.strip(),
                config=_client_config(sub, model_root, where),
                num_slots=num_gpus,
                source_checkpoint=(
                    sub.source_checkpoint_info.model_dump(exclude_none=True) if sub.source_checkpoint_info else None
                ),
                load_optimizer_states=load_optimizer,
                public_config=section.model_dump(mode="json") if section is not None else {},
            )
        )
    return specs
