"""Scoring in spawned worker processes with real skyrl_gym environments."""

from __future__ import annotations

import pytest

from icefloe.integrations.skyrl.scoring import Sample, ScoringPool, score_one

GSM8K_PROMPT = [{"role": "user", "content": "What is 40 + 2?"}]


@pytest.fixture(scope="module")
def pool():
    """One pool for the module: spawning workers costs seconds; it also knows the custom test env."""
    with ScoringPool(2, ["tests.integrations.skyrl.skyrl_arith_env"]) as shared:
        yield shared


def _gsm8k(text: str, truth: str = "42") -> Sample:
    return Sample(env_class="gsm8k", extras={"reward_spec": {"method": "rule", "ground_truth": truth}},
                  prompt=GSM8K_PROMPT, text=text)  # fmt: skip


def test_scoring_pool_uses_gsm8k_env_in_worker_processes(pool):
    samples = [
        _gsm8k("so #### 42"),
        _gsm8k("#### 41"),
        _gsm8k("42 without the marker"),
        _gsm8k("#### 1,000", "1000"),
    ]
    rewards, errors = pool.score(samples)
    assert rewards == [1.0, 0.0, 0.0, 1.0]
    assert errors == [None] * 4


def test_scoring_pool_registers_custom_envs_in_spawned_workers(pool):
    """Regression: spawned workers only know built-in envs; env_modules registers the others there."""
    extras = {"reward_spec": {"ground_truth": "19"}}
    samples = [Sample("icefloe_answer_digits", extras, "12+7=", text) for text in ("19", "1+", "55")]
    rewards, errors = pool.score(samples)
    assert rewards == [1.0, 0.5, 0.0]
    assert errors == [None] * 3


def test_scoring_reports_env_failures_as_zero_with_the_error(pool):
    bad = Sample(env_class="gsm8k", extras={}, prompt=GSM8K_PROMPT, text="#### 42")  # no reward_spec
    rewards, errors = pool.score([bad, _gsm8k("#### 42")])
    assert rewards == [0.0, 1.0]
    assert errors[0] is not None and "reward_spec" in errors[0]
    assert errors[1] is None


def test_score_one_matches_pool_in_process():
    assert score_one(_gsm8k("#### 42")) == 1.0


def test_scoring_pool_rejects_zero_workers():
    with pytest.raises(ValueError, match="scoring_workers must be >= 1"):
        ScoringPool(0)
