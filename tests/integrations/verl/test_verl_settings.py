"""verl config → ClientConfig / VerlSettings, and the zero-log-prob preflight."""

from __future__ import annotations

import pytest

from icefloe.config import ClientConfig
from icefloe.integrations.verl import backend as backend_module
from icefloe.integrations.verl.backend import IcefloeBackend, preflight
from icefloe.integrations.verl.settings import VerlSettings, client_config
from icefloe.protocol import OP_FORWARD, OPS, ConfigError


def test_client_config_maps_optimizer_schedule_and_lengths(make_config) -> None:
    config = make_config(**{
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 2,
        "actor_rollout_ref.actor.optim.weight_decay": 0.01,
        "actor_rollout_ref.actor.optim.betas": [0.8, 0.95],
        "actor_rollout_ref.actor.optim.clip_grad": 0.5,
        "actor_rollout_ref.actor.ppo_epochs": 2,
    })  # fmt: skip
    built = client_config(config, environ={})
    assert built.model == "tiny:arith" and built.max_seq_len == 10
    assert built.backend.type == "local" and built.backend.device == "cpu"
    assert (built.training.optimizer.lr, built.training.optimizer.betas) == (5e-3, (0.8, 0.95))
    assert (built.training.optimizer.weight_decay, built.training.grad_clip) == (0.01, 0.5)
    # verl steps its scheduler once per update: 2 epochs × (2 rows / 1 per mini-batch) optimizer steps each.
    schedule = built.training.lr_schedule
    assert (schedule.kind, schedule.warmup_steps, schedule.total_steps) == ("cosine", 8, 40)
    settings = VerlSettings.from_verl(config)
    assert (settings.mini_batch_size, settings.ppo_epochs, settings.max_prompt_length) == (2, 2, 6)
    assert settings.actor_loss_config["clip_ratio"] == 0.2


def test_client_config_takes_verl_token_budget_only_with_dynamic_batch_size(make_config) -> None:
    budget = {"actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096}
    dynamic = make_config(**budget, **{"actor_rollout_ref.actor.use_dynamic_bsz": True})
    assert client_config(dynamic, environ={}).training.micro_batch_tokens == 4096
    # Without it verl splits by rows; the engine still splits by tokens, with a budget of its own choosing.
    assert client_config(make_config(**budget), environ={}).training.micro_batch_tokens is None


def test_client_config_maps_verl_lora_settings(make_config) -> None:
    assert client_config(make_config(), environ={}).lora is None
    assert client_config(make_config(**{"actor_rollout_ref.model.lora_rank": 0}), environ={}).lora is None
    lora = client_config(make_config(**{"actor_rollout_ref.model.lora_rank": 8}), environ={}).lora
    assert lora is not None and (lora.rank, lora.alpha, lora.target_modules) == (8, 16, "all-linear")  # verl defaults
    config = make_config(**{
        "actor_rollout_ref.model.lora_rank": 4,
        "actor_rollout_ref.model.lora_alpha": 32,
        "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
    })  # fmt: skip
    lora = client_config(config, environ={}).lora
    assert lora is not None and (lora.rank, lora.alpha, lora.target_modules) == (4, 32, ["q_proj", "v_proj"])


def test_client_config_refuses_verl_lora_settings_it_cannot_honour(make_config) -> None:
    config = make_config(**{
        "actor_rollout_ref.model.lora_rank": 8,
        "actor_rollout_ref.model.exclude_modules": ["lm_head"],
        "actor_rollout_ref.model.lora_adapter_path": "/ckpt/adapter",
        "actor_rollout_ref.model.target_modules": ".*proj",
    })  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        client_config(config, environ={})
    lines = str(refused.value).splitlines()[1:]
    assert [line.split("=")[0].strip() for line in lines] == [
        "actor_rollout_ref.model.exclude_modules",
        "actor_rollout_ref.model.lora_adapter_path",
        "actor_rollout_ref.model.target_modules",
    ]


def test_client_config_backend_from_env_when_yaml_leaves_it_null(make_config) -> None:
    config = make_config(**{"remote_backend.backend": None})
    assert client_config(config, environ={"ICEFLOE_BACKEND": "local"}).backend.device == "cpu"
    with pytest.raises(ConfigError, match="ICEFLOE_BACKEND"):
        client_config(config, environ={"ICEFLOE_BACKEND": "tpu"})
    with pytest.raises(ConfigError, match=r"remote_backend\.backend must be one of"):
        client_config(make_config(**{"remote_backend.backend": "tpu"}), environ={})


def test_client_config_starts_a_reference_worker_for_kl(make_config) -> None:
    assert client_config(make_config(), environ={}).num_log_prob_workers == 0
    kl = make_config(**{"algorithm.use_kl_in_reward": True})
    assert client_config(kl, environ={}).num_log_prob_workers == 1


def test_client_config_decay_without_horizon_names_the_fix(make_config) -> None:
    config = make_config(
        **{"actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine", "trainer.total_training_steps": None}
    )
    with pytest.raises(ConfigError, match=r"trainer\.total_training_steps"):
        client_config(config, environ={})


def _no_forward(config: ClientConfig) -> frozenset[str]:
    """A service like the managed endpoint: every op but forward (what its probe reports)."""
    return OPS - {OP_FORWARD}


def test_preflight_lists_every_offending_knob_in_one_sorted_error(make_config, monkeypatch) -> None:
    monkeypatch.setattr(backend_module, "probe_capabilities", _no_forward)
    config = make_config(**{
        "actor_rollout_ref.actor.use_kl_loss": True,
        "algorithm.use_kl_in_reward": True,
        "actor_rollout_ref.actor.ppo_epochs": 2,
        "algorithm.adv_estimator": "gae",
        "actor_rollout_ref.actor.policy_loss.loss_mode": "my_loss",
        "actor_rollout_ref.rollout.multi_turn.enable": True,
    })  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        preflight(config, client_config(config, environ={}))
    listed = [line.strip() for line in str(raised.value).splitlines()[1:]]
    assert [line.split("=")[0] for line in listed] == [
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        "actor_rollout_ref.actor.ppo_epochs",
        "actor_rollout_ref.actor.use_kl_loss",
        "actor_rollout_ref.rollout.multi_turn.enable",
        "algorithm.adv_estimator",
        "algorithm.use_kl_in_reward",
    ]


def test_preflight_passes_safe_regime_without_forward_and_everything_with_it(make_config, monkeypatch) -> None:
    safe = make_config()
    risky = make_config(**{"actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.ppo_epochs": 2})
    assert preflight(risky, client_config(risky, environ={})).backend.type == "local"  # local has forward
    monkeypatch.setattr(backend_module, "probe_capabilities", _no_forward)
    assert preflight(safe, client_config(safe, environ={})).model == "tiny:arith"


def test_preflight_allows_zero_logprobs_only_for_the_safe_regime(make_config, monkeypatch) -> None:
    remote = {"remote_backend.backend": "remote", "remote_backend.remote": {"base_url": "http://127.0.0.1:9"}}
    safe = make_config(**remote)
    assert preflight(safe, client_config(safe, environ={})).backend.allow_zero_logprobs is True
    kl = make_config(**remote, **{"actor_rollout_ref.actor.use_kl_loss": True})
    # A service with forward serves KL runs with real log-probs: the zero path stays off.
    monkeypatch.setattr(backend_module, "probe_capabilities", lambda config: OPS)
    assert preflight(kl, client_config(kl, environ={})).backend.allow_zero_logprobs is False


@pytest.mark.parametrize("mode", ["gspo", "sapo", "clip_cov"])
def test_settings_refuse_verl_policy_losses_icefloe_does_not_reproduce(make_config, mode) -> None:
    config = make_config(**{"actor_rollout_ref.actor.policy_loss.loss_mode": mode})
    with pytest.raises(ConfigError) as refused:
        VerlSettings.from_verl(config)
    message = str(refused.value)
    assert f"actor_rollout_ref.actor.policy_loss.loss_mode={mode!r}" in message
    assert "vanilla" in message
    with pytest.raises(ConfigError, match=r"policy_loss\.loss_mode"):  # before any client or rollout exists
        IcefloeBackend.from_config(config)
    assert VerlSettings.from_verl(make_config()).policy_loss == "vanilla"


def test_client_config_reads_trainer_horizon_when_optim_keeps_verl_default(make_config) -> None:
    # verl's YAML carries optim.total_training_steps=-1 until its trainer fills it in.
    config = make_config(**{
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine",
        "actor_rollout_ref.actor.optim.total_training_steps": -1,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.2,
        "trainer.total_training_steps": 10,
    })  # fmt: skip
    schedule = client_config(config, environ={}).training.lr_schedule
    # 2 optimizer steps per verl step (2 rows, 1 per mini-batch): warmup 0.2 × 10 steps, horizon 10 steps.
    assert (schedule.kind, schedule.warmup_steps, schedule.total_steps) == ("cosine", 4, 20)


def test_client_config_zero_warmup_steps_delegate_to_the_ratio_as_verl_does(make_config) -> None:
    # verl 0.9.1's engines (fsdp, megatron, torchtitan): lr_warmup_steps None, 0 or negative → the ratio.
    config = make_config(**{
        "actor_rollout_ref.actor.optim.lr_scheduler_type": "linear",
        "actor_rollout_ref.actor.optim.total_training_steps": 10,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": 0,
        "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": 0.3,
    })  # fmt: skip
    assert client_config(config, environ={}).training.lr_schedule.warmup_steps == 3 * 2
