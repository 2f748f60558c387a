"""verl's config tree → icefloe's ``ClientConfig`` and the settings the worker and replica share.

verl's YAML has no notion of an icefloe backend, so everything icefloe-specific lives under
``remote_backend`` (``config/remote_backend/icefloe.yaml``); the rest is read from verl's own
fields (optimizer, lengths, mini-batch size, rollout.n). Works on an OmegaConf ``DictConfig`` or a
plain mapping; imports neither torch nor omegaconf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from icefloe.client.batch import VERL_POLICY_LOSSES
from icefloe.config import ClientConfig
from icefloe.integrations._guards import PolicyRegime
from icefloe.protocol import ConfigError

__all__ = ["VerlSettings", "client_config", "policy_regime", "select"]

_MISSING = object()

# The verl spelling of each preflight knob, for error messages.
_KNOB_LABELS = {
    "use_kl_loss": "actor_rollout_ref.actor.use_kl_loss",
    "use_kl_in_reward": "algorithm.use_kl_in_reward",
    "epochs": "actor_rollout_ref.actor.ppo_epochs",
    "advantage_estimator": "algorithm.adv_estimator",
    "policy_loss": "actor_rollout_ref.actor.policy_loss.loss_mode",
    "multi_turn": "actor_rollout_ref.rollout.multi_turn.enable",
}
# verl actor fields the loss reads (the lowering maps them to the grpo config).
_ACTOR_LOSS_FIELDS = (
    "clip_ratio",
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "loss_agg_mode",
    "loss_scale_factor",
    "entropy_coeff",
    "use_kl_loss",
    "kl_loss_coef",
    "kl_loss_type",
)
_BACKEND_TYPES = ("local", "ray", "remote")


def select(tree: Any, path: str, default: Any = None) -> Any:
    """``tree.a.b.c`` for a DictConfig or nested mappings; ``default`` when any part is missing or None."""
    node = tree
    for part in path.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(part, _MISSING) if callable(getter) else getattr(node, part, _MISSING)
        if node is _MISSING:
            return default
    return default if node is None else node


def _plain(value: Any) -> Any:
    """DictConfig / ListConfig → dicts and lists (without importing omegaconf)."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple) or hasattr(value, "__iter__"):
        return [_plain(v) for v in value]
    return value


class VerlSettings(BaseModel):
    """What the forwarder worker and the rollout server need from verl's config, JSON-safe.

    It travels inside the reconnect handle, so Ray children never re-read the full config.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_prompt_length: int = Field(gt=0)
    max_response_length: int = Field(gt=0)
    mini_batch_size: int = Field(gt=0)  # rows per optimizer step: ppo_mini_batch_size × rollout.n
    ppo_epochs: int = Field(1, gt=0)
    rollout_n: int = Field(1, gt=0)
    temperature: float = Field(1.0, gt=0)
    policy_loss: str = "vanilla"
    actor_loss_config: dict[str, Any] = Field(default_factory=dict)
    use_kl_loss: bool = False
    cuda_ipc: bool = False
    low_memory: bool = False
    pad_token_id: int | None = None  # filled on the driver from the model's tokenizer

    @classmethod
    def from_verl(cls, main_config: Any) -> VerlSettings:
        actor = select(main_config, "actor_rollout_ref.actor", {})
        rollout_n = int(select(main_config, "actor_rollout_ref.rollout.n", 1))
        mini = select(actor, "ppo_mini_batch_size")
        if mini is None or int(mini) <= 0:
            raise ConfigError("actor_rollout_ref.actor.ppo_mini_batch_size must be > 0; set it in the verl config")
        policy_loss = str(select(actor, "policy_loss.loss_mode", "vanilla"))
        if policy_loss not in VERL_POLICY_LOSSES:
            raise ConfigError(
                f"{_KNOB_LABELS['policy_loss']}={policy_loss!r} is not a loss icefloe reproduces; use one of "
                f"{sorted(VERL_POLICY_LOSSES)} (verl's vanilla clipped surrogate)"
            )
        loss_config = {name: _plain(select(actor, name)) for name in _ACTOR_LOSS_FIELDS}
        return cls(
            max_prompt_length=int(_required(main_config, "data.max_prompt_length")),
            max_response_length=int(_required(main_config, "data.max_response_length")),
            mini_batch_size=int(mini) * rollout_n,
            ppo_epochs=int(select(actor, "ppo_epochs", 1)),
            rollout_n=rollout_n,
            temperature=float(select(main_config, "actor_rollout_ref.rollout.temperature", 1.0)),
            policy_loss=policy_loss,
            actor_loss_config={k: v for k, v in loss_config.items() if v is not None},
            use_kl_loss=bool(select(actor, "use_kl_loss", False)),
            cuda_ipc=bool(select(main_config, "remote_backend.weight_sync.cuda_ipc", False)),
            low_memory=bool(select(main_config, "remote_backend.weight_sync.low_memory", False)),
        )


def policy_regime(main_config: Any) -> PolicyRegime:
    """The preflight's view of verl's config."""
    return PolicyRegime(
        use_kl_loss=bool(select(main_config, "actor_rollout_ref.actor.use_kl_loss", False)),
        use_kl_in_reward=bool(select(main_config, "algorithm.use_kl_in_reward", False)),
        epochs=int(select(main_config, "actor_rollout_ref.actor.ppo_epochs", 1)),
        advantage_estimator=str(select(main_config, "algorithm.adv_estimator", "grpo")),
        policy_loss=select(main_config, "actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"),
        multi_turn=bool(select(main_config, "actor_rollout_ref.rollout.multi_turn.enable", False)),
        labels=_KNOB_LABELS,
    )


def client_config(main_config: Any, environ: Mapping[str, str] | None = None) -> ClientConfig:
    """Build the ``ClientConfig`` a verl run asks for.

    ``remote_backend.backend`` picks local | ray | remote; when it is null, ``ICEFLOE_BACKEND`` /
    ``ARCTIC_BACKEND`` decide (through ``ClientConfig.from_env``, the one reader of env vars),
    then the chosen type's section (``remote_backend.local`` / ``.ray`` / ``.remote``) applies.
    """
    data = _client_data(main_config)
    chosen = select(main_config, "remote_backend.backend")
    if chosen is None:
        chosen = ClientConfig.from_env(data, environ=environ).backend.type
    chosen = str(chosen).lower()
    if chosen == "cortex":
        chosen = "remote"
    if chosen not in _BACKEND_TYPES:
        raise ConfigError(f"remote_backend.backend must be one of {list(_BACKEND_TYPES)} or null; got {chosen!r}")
    section = _plain(select(main_config, f"remote_backend.{chosen}", {})) or {}
    backend = {key: value for key, value in section.items() if value is not None}
    data["backend"] = {**backend, "type": chosen}
    return ClientConfig.from_env(data, environ=environ)


def _client_data(main_config: Any) -> dict[str, Any]:
    actor = select(main_config, "actor_rollout_ref.actor", {})
    optim = select(actor, "optim", {})
    rollout = select(main_config, "actor_rollout_ref.rollout", {})
    remote = select(main_config, "remote_backend", {})
    uses_reference = bool(select(actor, "use_kl_loss", False)) or bool(
        select(main_config, "algorithm.use_kl_in_reward", False)
    )
    log_prob_workers = int(select(remote, "log_prob_gpus", 0))
    if uses_reference and log_prob_workers == 0:
        log_prob_workers = 1  # KL needs the frozen reference policy; 0 in the YAML means "only when needed"
    betas = _plain(select(optim, "betas", [0.9, 0.999]))
    grad_clip = select(optim, "clip_grad", select(actor, "grad_clip", 1.0))
    sampling: dict[str, Any] = {"engine": str(select(remote, "sampling.engine", "auto"))}
    max_num_seqs = int(select(rollout, "max_num_seqs", 0) or 0)
    if max_num_seqs > 0:
        sampling["max_batch_size"] = max_num_seqs
    engine_kwargs = dict(_plain(select(remote, "sampling.engine_kwargs", {})) or {})
    for name in ("gpu_memory_utilization", "enforce_eager", "enable_chunked_prefill"):
        value = select(rollout, name)
        if value is not None:
            engine_kwargs.setdefault(name, _plain(value))
    sampling["engine_kwargs"] = engine_kwargs
    # verl's token budget counts only with dynamic batch size (else it splits by rows); icefloe always
    # splits by tokens, so without it the engine picks the budget from the model and device.
    token_budget = select(actor, "ppo_max_token_len_per_gpu") if select(actor, "use_dynamic_bsz", False) else None
    data: dict[str, Any] = {
        "model": str(_required(main_config, "actor_rollout_ref.model.path")),
        "seed": int(select(remote, "seed", 0)),
        "dtype": str(select(remote, "dtype", "float32")),
        "max_seq_len": int(_required(main_config, "data.max_prompt_length"))
        + int(_required(main_config, "data.max_response_length")),
        "num_training_workers": int(select(remote, "training_gpus", 1)),
        "num_sampling_workers": int(select(remote, "sampling_gpus", 1)),
        "num_log_prob_workers": log_prob_workers,
        "training": {
            "optimizer": {
                "lr": float(select(optim, "lr", 1e-6)),
                "betas": [float(b) for b in betas],
                "weight_decay": float(select(optim, "weight_decay", 0.0)),
            },
            "grad_clip": float(grad_clip),
            "lr_schedule": _schedule(main_config, optim),
            "micro_batch_tokens": None if token_budget is None else int(token_budget),
            "gradient_checkpointing": bool(
                select(main_config, "actor_rollout_ref.model.enable_gradient_checkpointing", False)
            ),
        },
        "sampling": sampling,
        "lora": _lora(main_config),
    }
    checkpoint_dir = select(main_config, "trainer.default_local_dir")
    if checkpoint_dir:
        data["training"]["checkpoint_dir"] = str(checkpoint_dir)
    return data


def _lora(main_config: Any) -> dict[str, Any] | None:
    """``actor_rollout_ref.model.lora_rank`` (0 = full weights), ``lora_alpha``, ``target_modules`` → ``lora``.

    verl's LoRA settings that icefloe cannot honour are refused, never dropped: each changes what is trained.
    """
    model = select(main_config, "actor_rollout_ref.model", {})
    rank = int(select(model, "lora_rank", 0) or 0)
    if rank <= 0:
        return None
    problems = [
        f"actor_rollout_ref.model.{name}={_plain(select(model, name))!r} ({fix})"
        for name, fix in (
            ("exclude_modules", "list the modules to adapt in target_modules instead"),
            ("lora_adapter_path", "start from the base model, or load the adapter as an icefloe checkpoint"),
        )
        if select(model, name) is not None
    ]
    target_modules = _plain(select(model, "target_modules", "all-linear"))
    if isinstance(target_modules, str) and target_modules != "all-linear":
        problems.append(
            f"actor_rollout_ref.model.target_modules={target_modules!r} (a pattern; give a list of module names "
            "or 'all-linear')"
        )
    if problems:
        raise ConfigError("these verl LoRA settings have no icefloe equivalent:\n  " + "\n  ".join(sorted(problems)))
    return {"rank": rank, "alpha": int(select(model, "lora_alpha", 16)), "target_modules": target_modules}


def _schedule(main_config: Any, optim: Any) -> dict[str, Any]:
    """verl steps its scheduler once per training step; icefloe once per optimizer step."""
    epochs = int(select(main_config, "actor_rollout_ref.actor.ppo_epochs", 1))
    train_rows = int(select(main_config, "data.train_batch_size", 0) or 0)
    mini_rows = int(select(main_config, "actor_rollout_ref.actor.ppo_mini_batch_size", 1) or 1)
    steps_per_update = epochs * max(1, train_rows // mini_rows)
    # verl's YAML keeps optim.total_training_steps at -1 until its trainer copies the horizon there.
    horizons = (select(optim, "total_training_steps", 0), select(main_config, "trainer.total_training_steps", 0))
    total_updates = next((int(steps) for steps in horizons if int(steps) > 0), 0)
    warmup = int(select(optim, "lr_warmup_steps", -1))
    if warmup <= 0:  # verl 0.9.1's engines: None, 0 or negative → lr_warmup_steps_ratio
        warmup = int(float(select(optim, "lr_warmup_steps_ratio", 0.0)) * total_updates)
    kind = str(select(optim, "lr_scheduler_type", select(optim, "warmup_style", "constant"))).lower()
    if kind not in ("constant", "cosine", "linear"):
        raise ConfigError(
            f"actor_rollout_ref.actor.optim.lr_scheduler_type must be constant, cosine or linear; got {kind!r}"
        )
    if kind != "constant" and total_updates == 0:
        raise ConfigError(
            f"actor_rollout_ref.actor.optim.lr_scheduler_type={kind!r} needs a horizon; set "
            "trainer.total_training_steps (or actor_rollout_ref.actor.optim.total_training_steps) to a "
            "positive value"
        )
    schedule: dict[str, Any] = {"kind": kind, "warmup_steps": warmup * steps_per_update}
    if total_updates:
        schedule["total_steps"] = max(total_updates, warmup) * steps_per_update
    min_lr_ratio = select(optim, "min_lr_ratio")
    if min_lr_ratio is not None and kind != "constant":
        schedule["min_lr_ratio"] = float(min_lr_ratio)
    return schedule


def _required(tree: Any, path: str) -> Any:
    value = select(tree, path)
    if value is None:
        raise ConfigError(f"{path} is required by the icefloe verl backend; set it in the verl config")
    return value
