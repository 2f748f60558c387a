"""Sampler replicas of one SamplerGroup each draw their own samples (GRPO groups split across them)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

from icefloe.config import ClientConfig  # noqa: E402
from icefloe.engines.ray import SamplerGroup, create_placement_group, plan_placement  # noqa: E402
from icefloe.engines.sampling import SamplingEngine  # noqa: E402
from icefloe.protocol import SamplingParams  # noqa: E402

pytestmark = pytest.mark.integration

PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def config(model_dir) -> ClientConfig:
    backend = {"type": "ray", "namespace": "icefloe-tests", "num_cpus_per_worker": 0.25}
    return ClientConfig.build(model=str(model_dir), max_seq_len=48, num_sampling_workers=2, backend=backend)


@pytest.fixture(scope="module")
def samplers(ray_session, config, model_dir):
    job_name = "icefloe-test-sampler-group"
    bundles, workers = plan_placement(job_name, {"sampling": 2}, config.backend)
    placement = create_placement_group(job_name, bundles, config.backend, config.job_ready_timeout_s)
    group = SamplerGroup.create(job_name, config, workers, placement, model_dir).start()
    yield group
    group.kill()
    ray.util.remove_placement_group(placement)


def test_replicas_draw_distinct_samples_for_repeated_prompts_without_a_seed(samplers):
    """Every replica started from config.seed: copies 2 and 3 of a prompt repeated copies 0 and 1."""
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    samples = [s["token_ids"] for s in samplers.generate([PROMPT] * 4, [params] * 4)]
    assert len({tuple(tokens) for tokens in samples}) == 4, samples


def test_a_seeded_request_samples_alike_on_every_replica_and_as_one_engine(samplers, config, model_dir):
    params = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=5)
    samples = [s["token_ids"] for s in samplers.generate([PROMPT] * 4, [params] * 4)]
    single = SamplingEngine(config, model_dir=model_dir).generate([PROMPT], params)[0]["token_ids"]
    assert samples == [single] * 4
