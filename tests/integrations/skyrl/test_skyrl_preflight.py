"""Preflight: SkyRL-shaped training data, and settings the backend cannot honour, refused up front."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icefloe.integrations.skyrl.preflight import PREPARE_DATA_COMMAND, check_settings, check_train_data
from icefloe.protocol import ConfigError


def _write(path, columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def _skyrl_row_columns():
    return {
        "data_source": ["openai/gsm8k"],
        "prompt": [[{"role": "user", "content": "1+1?"}]],
        "env_class": ["gsm8k"],
        "reward_spec": [{"method": "rule", "ground_truth": "2"}],
    }


def test_preflight_accepts_skyrl_schema(tmp_path):
    check_train_data([_write(tmp_path / "train.parquet", _skyrl_row_columns())])


def test_preflight_refuses_verl_schema_naming_the_fix(tmp_path):
    verl = _write(
        tmp_path / "train.parquet",
        {
            "prompt": [[{"role": "user", "content": "1+1?"}]],
            "reward_model": [{"style": "rule", "ground_truth": "2"}],
        },
    )
    with pytest.raises(ConfigError) as raised:
        check_train_data([verl])
    message = str(raised.value)
    assert "missing column(s) env_class, reward_spec (this is verl's GSM8K schema)" in message
    assert PREPARE_DATA_COMMAND in message


def test_preflight_lists_every_bad_file(tmp_path):
    columns = _skyrl_row_columns()
    del columns["env_class"]
    bad = _write(tmp_path / "a.parquet", columns)
    with pytest.raises(ConfigError) as raised:
        check_train_data([bad, str(tmp_path / "missing.parquet")])
    assert "a.parquet: missing column(s) env_class" in str(raised.value)
    assert "missing.parquet: no such file" in str(raised.value)


def test_preflight_skips_non_parquet_sources():
    check_train_data(["openai/gsm8k", "/nowhere/train.jsonl"])


def test_settings_without_forward_refuse_multi_epoch_and_kl_together(make_cfg):
    cfg = make_cfg("trainer.update_epochs_per_batch=2", "trainer.algorithm.use_kl_loss=true")
    with pytest.raises(ConfigError) as raised:
        check_settings(cfg, has_forward=False, backend="remote")
    message = str(raised.value)
    assert "trainer.update_epochs_per_batch=2" in message
    assert "trainer.algorithm.use_kl_loss=True" in message


def test_settings_with_forward_allow_multiple_epochs(make_cfg):
    cfg = make_cfg("trainer.update_epochs_per_batch=3", "trainer.algorithm.use_kl_loss=false")
    check_settings(cfg, has_forward=True, backend="local")


def test_settings_single_epoch_grpo_without_kl_passes_without_forward(make_cfg):
    check_settings(make_cfg("trainer.algorithm.use_kl_loss=false"), has_forward=False, backend="remote")


def test_settings_refuse_skyrl_colocation_critic_and_missing_reference(make_cfg):
    cfg = make_cfg(
        "trainer.placement.colocate_all=true",
        "trainer.algorithm.advantage_estimator=gae",
        "trainer.critic.model.path=some/critic",
        "trainer.algorithm.use_kl_loss=true",
    )
    with pytest.raises(ConfigError) as raised:
        check_settings(cfg, has_forward=True, backend="local")
    message = str(raised.value)
    for needle in (
        "colocate_all=true",
        "advantage_estimator='gae'",
        "critic.model.path",
        "num_log_prob_workers=1",
    ):
        assert needle in message
