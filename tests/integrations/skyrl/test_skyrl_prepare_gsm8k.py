"""examples/skyrl/prepare_gsm8k.py writes data that passes the preflight and that GSM8kEnv scores."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from icefloe.integrations.skyrl.preflight import check_train_data
from icefloe.integrations.skyrl.scoring import Sample, score_one

SCRIPT = Path(__file__).parents[3] / "examples" / "skyrl" / "prepare_gsm8k.py"


@pytest.fixture(scope="module")
def prepare():
    spec = importlib.util.spec_from_file_location("prepare_gsm8k", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prepare_gsm8k_from_local_jsonl_writes_skyrl_schema(prepare, tmp_path):
    rows = [
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "A shop sells 1,200 pens.", "answer": "So #### 1,200"},
    ]
    source = tmp_path / "train.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows))
    prepare.main(["--output-dir", str(tmp_path / "out"), "--jsonl-dir", str(tmp_path)])
    train = tmp_path / "out" / "train.parquet"
    check_train_data([str(train)])
    table = pq.read_table(train).to_pylist()
    assert [row["reward_spec"]["ground_truth"] for row in table] == ["7", "1200"]
    assert table[0]["env_class"] == "gsm8k"
    assert table[0]["prompt"][0]["role"] == "user"
    extras = {k: v for k, v in table[1].items() if k not in ("prompt", "env_class")}
    assert score_one(Sample("gsm8k", extras, table[1]["prompt"], "#### 1200")) == 1.0


def test_prepare_gsm8k_rejects_answer_without_marker(prepare):
    with pytest.raises(ValueError, match="no '#### <number>' line"):
        prepare.ground_truth("the answer is 7")
