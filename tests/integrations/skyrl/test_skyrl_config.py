"""``trainer.icefloe.*`` parsing and its translation (with SkyRL's own fields) to ClientConfig."""

from __future__ import annotations

import pytest

from icefloe.integrations.skyrl.config import IcefloeSection, client_config_from_skyrl, loss_config_from_skyrl
from icefloe.protocol import ConfigError


def test_config_class_parses_icefloe_section_from_cli(make_cfg):
    cfg = make_cfg("trainer.icefloe.colocate=true", "trainer.icefloe.num_log_prob_workers=1", "trainer.seed=7")
    assert isinstance(cfg.trainer.icefloe, IcefloeSection)
    assert cfg.trainer.icefloe.colocate is True
    assert cfg.trainer.icefloe.num_log_prob_workers == 1
    assert cfg.trainer.seed == 7


def test_config_class_rejects_unknown_icefloe_knob(make_cfg):
    with pytest.raises((TypeError, ValueError), match="colocat"):
        make_cfg("trainer.icefloe.colocat=true")


def test_config_translation_reads_skyrl_fields(make_cfg, tmp_path):
    cfg = make_cfg(
        "trainer.policy.model.path=tiny:arith",
        "trainer.seed=5",
        f"trainer.ckpt_path={tmp_path}",
        "trainer.policy.optimizer_config.lr=3e-3",
        "trainer.policy.optimizer_config.max_grad_norm=0.5",
        "trainer.placement.policy_num_gpus_per_node=4",
        "generator.inference_engine.num_engines=2",
        "generator.inference_engine.tensor_parallel_size=2",
        "trainer.max_prompt_length=64",
        "generator.sampling_params.max_generate_length=32",
        "trainer.icefloe.dtype=float32",
        "trainer.icefloe.device=cpu",
    )
    config = client_config_from_skyrl(cfg)
    assert (config.model, config.seed, config.dtype, config.max_seq_len) == ("tiny:arith", 5, "float32", 96)
    assert (config.num_training_workers, config.num_sampling_workers) == (4, 4)
    assert config.training.optimizer.lr == 3e-3
    assert config.training.grad_clip == 0.5
    assert str(config.training.checkpoint_dir) == str(tmp_path)
    assert config.backend.type == "local"
    assert config.backend.device == "cpu"


def test_config_section_worker_counts_override_skyrl_placement(make_cfg):
    cfg = make_cfg("trainer.icefloe.num_training_workers=1", "trainer.icefloe.num_sampling_workers=1")
    config = client_config_from_skyrl(cfg)
    assert (config.num_training_workers, config.num_sampling_workers) == (1, 1)


def test_config_default_backend_yields_to_arctic_backend_env(make_cfg, monkeypatch):
    monkeypatch.setenv("ARCTIC_BACKEND", "cortex")
    monkeypatch.setenv("ARCTIC_CORTEX_BASE_URL", "http://127.0.0.1:9")
    config = client_config_from_skyrl(make_cfg())
    assert config.backend.type == "remote"
    assert config.backend.base_url == "http://127.0.0.1:9"


def test_config_explicit_section_backend_wins_over_env(make_cfg, monkeypatch):
    monkeypatch.setenv("ICEFLOE_BACKEND", "remote")
    config = client_config_from_skyrl(make_cfg("trainer.icefloe.backend=ray", "trainer.icefloe.colocate=true"))
    assert config.backend.type == "ray"
    assert config.backend.colocate is True


def test_loss_config_maps_skyrl_algorithm(make_cfg):
    cfg = make_cfg(
        "trainer.algorithm.eps_clip_low=0.1",
        "trainer.algorithm.eps_clip_high=0.3",
        "trainer.algorithm.policy_loss_type=dual_clip",
        "trainer.algorithm.loss_reduction=sequence_mean",
        "trainer.algorithm.kl_estimator_type=k3",
        "trainer.algorithm.use_entropy_loss=true",
    )
    assert loss_config_from_skyrl(cfg) == {
        "eps_clip": 0.1,
        "eps_clip_higher": 0.3,
        "c_clip": 3.0,
        "loss_agg_mode": "seq-mean-token-mean",
        "entropy_coeff": 0.01,
        "use_kl_loss": True,
        "kl_coef": 0.001,
        "kl_type": "low_var_kl",
    }


def test_loss_config_lists_every_unsupported_setting(make_cfg):
    cfg = make_cfg("trainer.algorithm.policy_loss_type=sapo", "trainer.algorithm.loss_reduction=prompt_mean")
    with pytest.raises(ConfigError) as raised:
        loss_config_from_skyrl(cfg)
    assert "policy_loss_type='sapo'" in str(raised.value)
    assert "loss_reduction='prompt_mean'" in str(raised.value)


def test_config_translation_maps_skyrl_lora(make_cfg):
    assert client_config_from_skyrl(make_cfg()).lora is None  # rank 0: full weights
    cfg = make_cfg(
        "trainer.policy.model.path=tiny:arith",
        "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.alpha=32",
        "trainer.policy.model.lora.dropout=0.05",
        "trainer.icefloe.dtype=float32",
    )
    lora = client_config_from_skyrl(cfg).lora
    assert lora is not None
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 32, 0.05, "all-linear")


def test_config_translation_refuses_skyrl_lora_settings_it_cannot_honour(make_cfg):
    cfg = make_cfg(
        "trainer.policy.model.path=tiny:arith",
        "trainer.policy.model.lora.rank=8",
        "trainer.policy.model.lora.init_method=xavier",
        "trainer.policy.model.lora.exclude_modules=lm_head",
        "trainer.policy.model.lora.target_modules=.*proj",
    )
    with pytest.raises(ConfigError) as refused:
        client_config_from_skyrl(cfg)
    lines = str(refused.value).splitlines()[1:]
    assert [line.split("=")[0].strip() for line in lines] == [
        "trainer.policy.model.lora.exclude_modules",
        "trainer.policy.model.lora.init_method",
        "trainer.policy.model.lora.target_modules",
    ]
