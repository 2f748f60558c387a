"""Sampler replicas of one SamplerGroup each draw their own samples (GRPO groups split across them)."""

from __future__ import annotations

import pytest
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)

from icefloe.engines.ray import SamplerGroup
from icefloe.engines.sampling import SamplingEngine
from icefloe.protocol import SamplingParams

from .conftest import two_replica_group

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def started(ray_session, model_dir):
    yield from two_replica_group(SamplerGroup, "sampling", model_dir)


def test_replicas_draw_distinct_samples_for_repeated_prompts_without_a_seed(replicas):
    """Every replica started from config.seed: copies 2 and 3 of a prompt repeated copies 0 and 1."""
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    samples = [s["token_ids"] for s in replicas.generate([PROMPT] * 4, [params] * 4)]
    assert len({tuple(tokens) for tokens in samples}) == 4, samples


def test_a_seeded_request_samples_alike_on_every_replica_and_as_one_engine(replicas, config, model_dir):
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=5)
    samples = [s["token_ids"] for s in replicas.generate([PROMPT] * 4, [params] * 4)]
    single = SamplingEngine(config, model_dir=model_dir).generate([PROMPT], params)[0]["token_ids"]
    assert samples == [single] * 4
