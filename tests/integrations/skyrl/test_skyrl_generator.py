"""The generator's translation of SkyRL sampling params, prompt encoding and scoring guards."""

from __future__ import annotations

import pytest

from icefloe.protocol import ConfigError


@pytest.fixture
def generator_module(skyrl):
    from icefloe.integrations.skyrl import generator

    return generator


def test_sampling_params_keep_icefloe_fields_and_rename_skyrl_ones(generator_module):
    params = generator_module.to_sampling_params(
        {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_generate_length": 12, "min_p": 0.1, "n": 4,
         "stop": ("####",), "logprobs": None}
    )  # fmt: skip
    assert params == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 12, "stop": ["####"]}


def test_scoring_guard_refuses_a_batch_where_every_env_failed(generator_module):
    with pytest.raises(ConfigError, match=r"every sample's environment failed, e.g. 'gsm8k': AssertionError"):
        generator_module._check_scoring(["AssertionError: reward_spec field is required"] * 2, ["gsm8k", "gsm8k"])


def test_scoring_guard_warns_about_partial_failures(generator_module, caplog):
    with caplog.at_level("WARNING"):
        generator_module._check_scoring([None, "KeyError: 'ground_truth'"], ["gsm8k", "gsm8k"])
    assert "1 of 2 samples failed scoring" in caplog.text


def test_chat_prompts_need_a_chat_template(generator_module):
    from icefloe.integrations.skyrl.scoring import ScoringPool

    class PlainTokenizer:
        chat_template = None

    generator = generator_module.IcefloeGenerator(None, PlainTokenizer(), ScoringPool(1))
    with pytest.raises(ConfigError, match="no chat template"):
        generator.encode_prompt([{"role": "user", "content": "1+1?"}])
