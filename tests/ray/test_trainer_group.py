"""A TrainerGroup of two data-parallel ranks answers the Tinker API's extras like one engine does."""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)
from torch.testing import assert_close

from icefloe.engines.ray import TrainerGroup
from icefloe.engines.training import TrainingEngine

from .conftest import two_replica_group

pytestmark = pytest.mark.integration

ADAM = {"beta1": 0.5, "beta2": 0.9, "eps": 1e-6, "weight_decay": 0.1, "grad_clip_norm": 0.5}


def targets_batch(rows: int) -> dict:
    generator = torch.Generator().manual_seed(rows)
    shape = (rows, 6)
    context = {
        "target_tokens": torch.randint(4, 18, shape, generator=generator),
        "loss_mask": torch.ones(shape),
        "weights": torch.rand(shape, generator=generator),
    }
    processing = {"loss_fn": "cross_entropy", "config": {"loss_agg_mode": "token-sum", "return_logprobs": True}}
    return {"kwargs": {"input_ids": torch.randint(4, 18, shape, generator=generator)}, "context": context,
            "processing": processing}  # fmt: skip


@pytest.fixture(scope="module")
def started(ray_session, model_dir):
    yield from two_replica_group(TrainerGroup, "training", model_dir)


@pytest.fixture(scope="module")
def single(config, model_dir) -> TrainingEngine:
    """One engine taking the same steps as ``replicas``."""
    return TrainingEngine(config, model_dir=model_dir)


@pytest.mark.parametrize("rows", [5, 1], ids=["split", "one-row-and-a-padding-row"])
def test_group_fwd_bwd_returns_every_rows_logprobs_and_step_takes_adam_params(replicas, single, rows):
    """combine_fwd_bwd dropped the logprobs, and step had no Adam parameters: Tinker on ray failed."""
    expected = single.fwd_bwd(targets_batch(rows))
    result = replicas.fwd_bwd(targets_batch(rows))
    assert_close(result["logprobs"], expected["logprobs"], atol=1e-5, rtol=1e-5)
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    stepped, expected_step = replicas.step(1e-3, ADAM), single.step(1e-3, ADAM)
    assert stepped["grad_norm"] == pytest.approx(expected_step["grad_norm"], rel=1e-5)
    assert stepped["global_step"] == expected_step["global_step"]


def test_group_load_takes_the_optimizer_flag_and_reports_its_own_step(replicas, tmp_path):
    """Tinker's load_state passes ``optimizer``; the group did not take it."""
    replicas.fwd_bwd(targets_batch(2))
    steps = replicas.step(1e-3)["global_step"]
    saved = replicas.save_checkpoint(tmp_path, "resumable")
    assert replicas.load_checkpoint(saved["path"], False)["global_step"] == steps
