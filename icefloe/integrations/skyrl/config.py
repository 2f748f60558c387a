"""``trainer.icefloe.*``: the SkyRL config section for icefloe, and its translation to ``ClientConfig``.

The section is a plain dataclass so SkyRL's dataclass config parser accepts it as a nested field
(``trainer.icefloe.colocate=true`` on the command line). Everything SkyRL already says (model path,
seed, optimizer, GPU placement, sampling lengths) is read from SkyRL's own fields; the section only
holds what SkyRL has no field for. The translation goes through :class:`LegacyClientConfig`, so the
``ICEFLOE_BACKEND`` / ``ARCTIC_BACKEND`` promotion applies exactly as it does for older recipes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from icefloe.config import ClientConfig
from icefloe.integrations.skyrl.legacy import LegacyClientConfig
from icefloe.protocol import ConfigError

__all__ = ["IcefloeSection", "client_config_from_skyrl", "lora_from_skyrl", "loss_config_from_skyrl", "section_of"]

# SkyRL trainer.algorithm.loss_reduction → icefloe loss_agg_mode.
_LOSS_REDUCTIONS = {
    "token_mean": "token-mean",
    "sequence_mean": "seq-mean-token-mean",
    "seq_mean_token_sum_norm": "seq-mean-token-sum-norm",
}
# SkyRL kl_estimator_type → icefloe kl_type.
_KL_ESTIMATORS = {"k1": "k1", "k2": "k2", "k3": "low_var_kl"}
# SkyRL policy losses the canonical clipped surrogate reproduces (dual clip is always on in SkyRL's "dual_clip").
_POLICY_LOSSES = ("regular", "dual_clip")


@dataclasses.dataclass
class IcefloeSection:
    """Knobs under ``trainer.icefloe``; every other setting comes from SkyRL's own config."""

    backend: str = "local"  # local | ray | remote (alias cortex); "local" yields to ICEFLOE_BACKEND / ARCTIC_BACKEND
    base_url: str | None = None  # remote: a service URL (icefloe serve); None = ICEFLOE_REMOTE_* / ARCTIC_CORTEX_*
    ray_address: str | None = None  # ray: None = start a local Ray, "auto" = join the running cluster
    num_training_workers: int = 0  # 0 = trainer.placement.policy_num_gpus_per_node * policy_num_nodes
    num_sampling_workers: int = 0  # 0 = inference_engine.num_engines * tensor_parallel_size
    num_log_prob_workers: int = 0  # reference-policy workers; needed for use_kl_loss / use_kl_in_reward
    colocate: bool = False  # training and sampling share GPUs on the backend (not trainer.placement.colocate_all)
    cuda_ipc_weight_sync: bool = False  # colocated weight sync over CUDA IPC
    low_memory_weight_sync: bool = False  # sync weights bucket by bucket
    device: str = "auto"  # local backend: auto | cpu | cuda
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    micro_batch_tokens: int | None = None  # positions per training pass; None = from the model and device
    gradient_checkpointing: bool = False
    sampling_engine: str = "auto"  # auto | torch | vllm
    sampling_max_batch_size: int = 256
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # passed to the sampling engine
    scoring_workers: int = 8  # processes scoring samples with skyrl_gym environments
    env_modules: list[str] = dataclasses.field(default_factory=list)  # imported in scoring workers to register envs


def section_of(cfg: Any) -> IcefloeSection:
    """The ``trainer.icefloe`` section of a SkyRL config, defaults when absent."""
    section = getattr(cfg.trainer, "icefloe", None)
    return section if section is not None else IcefloeSection()


def client_config_from_skyrl(cfg: Any) -> ClientConfig:
    """Build the client config a SkyRL run needs from SkyRL's config and its ``trainer.icefloe`` section.

    Raises:
        ConfigError: a value is invalid; the message names the SkyRL field and the fix.
    """
    section = section_of(cfg)
    trainer, generator = cfg.trainer, cfg.generator
    placement, engines = trainer.placement, generator.inference_engine
    optimizer = trainer.policy.optimizer_config
    training_gpus = section.num_training_workers or placement.policy_num_gpus_per_node * placement.policy_num_nodes
    sampling_gpus = section.num_sampling_workers or engines.num_engines * engines.tensor_parallel_size
    legacy = LegacyClientConfig.build(
        backend=section.backend,
        model_name=trainer.policy.model.path,
        checkpoint_path=trainer.ckpt_path,
        seed=trainer.seed,
        training_gpus=training_gpus,
        sampling_gpus=sampling_gpus,
        log_prob_gpus=section.num_log_prob_workers,
        colocate=section.colocate,
        cuda_ipc=section.cuda_ipc_weight_sync,
        low_memory=section.low_memory_weight_sync,
    )
    backend: dict[str, Any] = {}
    kind = legacy.backend_type
    if kind == "local":
        backend = {"device": section.device}
    elif kind == "ray" and section.ray_address:
        backend = {"address": section.ray_address}
    elif kind == "remote" and section.base_url:
        backend = {"base_url": section.base_url}
    max_seq_len = trainer.max_prompt_length + generator.sampling_params.max_generate_length
    return legacy.to_client_config(
        dtype=section.dtype,
        max_seq_len=max_seq_len,
        lora=lora_from_skyrl(getattr(trainer.policy.model, "lora", None)),
        backend={"type": kind, **backend},
        training={
            "optimizer": {
                "lr": optimizer.lr,
                "betas": tuple(optimizer.adam_betas),
                "weight_decay": optimizer.weight_decay,
            },
            "grad_clip": optimizer.max_grad_norm,
            "micro_batch_tokens": section.micro_batch_tokens,
            "gradient_checkpointing": section.gradient_checkpointing,
            "checkpoint_dir": trainer.ckpt_path,
        },
        sampling={
            "engine": section.sampling_engine,
            "max_batch_size": section.sampling_max_batch_size,
            "engine_kwargs": dict(section.engine_kwargs),
        },
    )


def lora_from_skyrl(lora: Any) -> dict[str, Any] | None:
    """``trainer.policy.model.lora`` (rank 0 = full weights) → icefloe's ``lora`` section.

    Settings that would change what is trained and that icefloe cannot honour are refused, never dropped.

    Raises:
        ConfigError: names each such SkyRL field and the fix.
    """
    if lora is None or int(lora.rank) <= 0:
        return None
    prefix = "trainer.policy.model.lora"
    problems = []
    if getattr(lora, "exclude_modules", None) is not None:
        problems.append(f"{prefix}.exclude_modules={lora.exclude_modules!r} (list the modules to adapt instead)")
    if getattr(lora, "init_method", "kaiming") != "kaiming":
        problems.append(f"{prefix}.init_method={lora.init_method!r} (peft's default initialisation is 'kaiming')")
    target_modules = lora.target_modules
    if isinstance(target_modules, str) and target_modules != "all-linear":
        problems.append(f"{prefix}.target_modules={target_modules!r} (a pattern; give a list of names or 'all-linear')")
    if problems:
        raise ConfigError("these SkyRL LoRA settings have no icefloe equivalent:\n  " + "\n  ".join(sorted(problems)))
    modules = target_modules if isinstance(target_modules, str) else [str(m) for m in target_modules]
    return {"rank": int(lora.rank), "alpha": int(lora.alpha), "dropout": float(lora.dropout), "target_modules": modules}


def loss_config_from_skyrl(cfg: Any) -> dict[str, Any]:
    """``processing.config`` for the canonical ``grpo`` loss from ``trainer.algorithm``.

    Raises:
        ConfigError: a SkyRL loss setting has no icefloe equivalent; the message names it and the fix.
    """
    algorithm = cfg.trainer.algorithm
    problems = []
    if algorithm.policy_loss_type not in _POLICY_LOSSES:
        problems.append(
            f"trainer.algorithm.policy_loss_type={algorithm.policy_loss_type!r} (use one of {list(_POLICY_LOSSES)})"
        )
    if algorithm.loss_reduction not in _LOSS_REDUCTIONS:
        problems.append(
            f"trainer.algorithm.loss_reduction={algorithm.loss_reduction!r} (use one of {sorted(_LOSS_REDUCTIONS)})"
        )
    max_seq_len = getattr(algorithm, "max_seq_len", None)
    if algorithm.loss_reduction == "seq_mean_token_sum_norm" and max_seq_len is None:
        problems.append(
            "trainer.algorithm.max_seq_len=None (seq_mean_token_sum_norm divides by it; set it, as SkyRL requires)"
        )
    if algorithm.use_kl_loss and algorithm.kl_estimator_type not in _KL_ESTIMATORS:
        problems.append(
            f"trainer.algorithm.kl_estimator_type={algorithm.kl_estimator_type!r} (use one of {sorted(_KL_ESTIMATORS)})"
        )
    if problems:
        raise ConfigError("these SkyRL settings have no icefloe equivalent:\n  " + "\n  ".join(sorted(problems)))
    config: dict[str, Any] = {
        "eps_clip": algorithm.eps_clip_low,
        "eps_clip_higher": algorithm.eps_clip_high,
        # Always sent: None overrides the verl-style lowering's default c=3.0 (SkyRL's "regular" has no dual clip).
        "c_clip": algorithm.clip_ratio_c if algorithm.policy_loss_type == "dual_clip" else None,
        "loss_agg_mode": _LOSS_REDUCTIONS[algorithm.loss_reduction],
        "entropy_coeff": algorithm.entropy_loss_coef if algorithm.use_entropy_loss else 0.0,
        "entropy_agg_mode": "token-mean",  # SkyRL: the entropy's token mean, whatever loss_reduction says
        "use_kl_loss": bool(algorithm.use_kl_loss),
    }
    if algorithm.loss_reduction == "seq_mean_token_sum_norm":
        config["loss_scale_factor"] = max_seq_len
    if algorithm.use_kl_loss:
        config["kl_coef"] = algorithm.kl_loss_coef
        config["kl_type"] = _KL_ESTIMATORS[algorithm.kl_estimator_type]
        config["kl_agg_mode"] = "seq-mean-token-mean"  # SkyRL: each row's token mean, averaged over rows
    return config
