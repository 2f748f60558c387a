"""verl sampling params → icefloe SamplingParams."""

from __future__ import annotations

import logging

import pytest

from icefloe.integrations.verl import sampling
from icefloe.integrations.verl.sampling import to_sampling_params
from icefloe.protocol import InvalidRequestError


def test_to_sampling_params_maps_and_clamps() -> None:
    params = to_sampling_params(
        {"max_new_tokens": 50, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": 0},
        prompt_length=6,
        default_max_tokens=4,
        max_model_len=10,
    )
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.logprobs) == (
        4,
        0.7,
        0.9,
        0,
        True,
    )
    assert to_sampling_params({}, prompt_length=2, default_max_tokens=3, max_model_len=10).max_tokens == 3
    assert (
        to_sampling_params({"response_length": 5}, prompt_length=2, default_max_tokens=3, max_model_len=10).max_tokens
        == 5
    )


def test_to_sampling_params_rejects_full_context_and_n() -> None:
    with pytest.raises(InvalidRequestError, match="max_model_len=4"):
        to_sampling_params({}, prompt_length=4, default_max_tokens=2, max_model_len=4)
    with pytest.raises(InvalidRequestError, match="n=2"):
        to_sampling_params({"n": 2}, prompt_length=1, default_max_tokens=2, max_model_len=4)


def test_to_sampling_params_warns_once_per_dropped_name(caplog, monkeypatch) -> None:
    monkeypatch.setattr(sampling, "_warned", set())
    request = {"repetition_penalty": 1.3, "min_p": 0.0, "presence_penalty": 0.5}
    with caplog.at_level(logging.WARNING, logger=sampling.__name__):
        to_sampling_params(request, prompt_length=1, default_max_tokens=2, max_model_len=8)
        to_sampling_params(request, prompt_length=1, default_max_tokens=2, max_model_len=8)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert warnings[0].endswith("presence_penalty, repetition_penalty")  # min_p left at its neutral value
