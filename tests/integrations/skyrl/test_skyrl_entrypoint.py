"""The override entrypoint refuses bad data and unsupported settings before training starts."""

from __future__ import annotations

import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from icefloe.protocol import ConfigError


def _argv(tmp_path, data, *extra):
    return [
        "main_base",
        "trainer.override_entrypoint=icefloe.integrations.skyrl.entrypoint",
        f"data.train_data=[{data}]",
        "trainer.policy.model.path=tiny:arith",
        f"trainer.ckpt_path={tmp_path / 'ckpt'}",
        "trainer.icefloe.device=cpu",
        "trainer.icefloe.dtype=float32",
        *extra,
    ]


def test_entrypoint_refuses_verl_shaped_data_before_building_a_client(skyrl, tmp_path, monkeypatch):
    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+1?"], "reward_model": [{"ground_truth": "2"}]}), data)
    monkeypatch.setattr(sys, "argv", _argv(tmp_path, data))
    from icefloe.integrations.skyrl import entrypoint

    monkeypatch.setattr(entrypoint, "Client", None)  # any client construction would fail differently
    with pytest.raises(ConfigError, match=r"prepare_gsm8k\.py"):
        skyrl["skyrl.train.entrypoints.main_base"].main()


def test_entrypoint_refuses_kl_without_reference_workers_before_building_a_client(skyrl, tmp_path, monkeypatch):
    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"env_class": ["gsm8k"], "reward_spec": [{"ground_truth": "2"}]}), data)
    monkeypatch.setattr(sys, "argv", _argv(tmp_path, data, "trainer.algorithm.use_kl_loss=true"))
    from icefloe.integrations.skyrl import entrypoint

    monkeypatch.setattr(entrypoint, "Client", None)  # any client construction would fail differently
    with pytest.raises(ConfigError, match="num_log_prob_workers=1"):
        entrypoint.main()
