"""The legacy flat config: env promotion of SkyRL's baked-in backend, and translation to ClientConfig."""

from __future__ import annotations

import pytest

from icefloe.integrations.skyrl.legacy import LegacyClientConfig
from icefloe.protocol import ConfigError

# (explicit backend, ICEFLOE_BACKEND, ARCTIC_BACKEND) → icefloe backend type
PROMOTION_TABLE = [
    (None, None, None, "local"),
    ("local", None, None, "local"),
    ("local", None, "cortex", "remote"),
    (None, None, "cortex", "remote"),
    ("local", "remote", None, "remote"),
    ("local", "ray", None, "ray"),
    ("local", "ray", "cortex", "ray"),  # ICEFLOE_BACKEND is read first
    ("LOCAL", None, "remote", "remote"),
    ("ray", None, "cortex", "ray"),  # an explicit non-default backend wins over the environment
    ("cortex", "local", None, "remote"),
    ("remote", "local", "local", "remote"),
]


@pytest.mark.parametrize(("explicit", "icefloe_env", "arctic_env", "expected"), PROMOTION_TABLE)
def test_legacy_backend_promotion_table(monkeypatch, explicit, icefloe_env, arctic_env, expected):
    for name, value in (("ICEFLOE_BACKEND", icefloe_env), ("ARCTIC_BACKEND", arctic_env)):
        if value is not None:
            monkeypatch.setenv(name, value)
    fields = {} if explicit is None else {"backend": explicit.lower() if explicit != "LOCAL" else "local"}
    assert LegacyClientConfig.build(**fields).backend_type == expected


def test_legacy_backend_promotion_rejects_unknown_env_value_naming_the_variable(monkeypatch):
    monkeypatch.setenv("ARCTIC_BACKEND", "dss-platform")
    with pytest.raises(ConfigError, match=r"ARCTIC_BACKEND must be one of .*got 'dss-platform'"):
        LegacyClientConfig.build(backend="local")


def test_legacy_promotion_happens_inside_the_model_not_at_call_sites(monkeypatch):
    """model_validate alone (no helper) promotes: the env read lives in the pydantic model."""
    monkeypatch.setenv("ARCTIC_BACKEND", "cortex")
    assert LegacyClientConfig.model_validate({"backend": "local"}).backend == "cortex"


def test_legacy_comm_protocol_and_host_choose_ray_or_remote():
    assert LegacyClientConfig.build(comm_protocol="ray").backend_type == "ray"
    config = LegacyClientConfig.build(host="10.0.0.5", port=7000).to_client_config()
    assert config.backend.type == "remote"
    assert config.backend.base_url == "http://10.0.0.5:7000"


def test_legacy_to_client_config_maps_flat_fields(tmp_path):
    legacy = LegacyClientConfig.build(
        model_name="tiny:arith",
        seed=3,
        training_gpus=2,
        sampling_gpus=1,
        log_prob_gpus=1,
        checkpoint_path=str(tmp_path),
        ds_config={"optimizer": {"params": {"lr": 3e-6, "weight_decay": 0.1}}, "gradient_clipping": 0.5},
        vllm_config={"gpu_memory_utilization": 0.5},
    )
    config = legacy.to_client_config()
    assert (config.model, config.seed) == ("tiny:arith", 3)
    assert (config.num_training_workers, config.num_sampling_workers, config.num_log_prob_workers) == (
        2,
        1,
        1,
    )
    assert config.training.optimizer.lr == 3e-6
    assert config.training.optimizer.weight_decay == 0.1
    assert config.training.grad_clip == 0.5
    assert str(config.training.checkpoint_dir) == str(tmp_path)
    assert config.sampling.engine_kwargs == {"gpu_memory_utilization": 0.5}


def test_legacy_remote_fills_service_fields_from_env(monkeypatch):
    monkeypatch.setenv("ARCTIC_BACKEND", "cortex")
    monkeypatch.setenv("ARCTIC_CORTEX_BASE_URL", "http://127.0.0.1:8321")
    config = LegacyClientConfig.build(backend="local").to_client_config()
    assert config.backend.type == "remote"
    assert config.backend.base_url == "http://127.0.0.1:8321"


def test_legacy_rejects_unknown_fields_naming_them():
    with pytest.raises(ConfigError, match="training_gpu"):
        LegacyClientConfig.build(training_gpu=1)


def test_legacy_inert_fields_parse_and_warn(caplog):
    config = LegacyClientConfig.build(server_logs=True, ds_worker_config={"use_liger": True})
    with caplog.at_level("WARNING"):
        config.to_client_config()
    assert "'server_logs' has no effect" in caplog.text
    assert "'ds_worker_config' has no effect" in caplog.text
