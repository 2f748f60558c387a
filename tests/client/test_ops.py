"""Op builders validate arguments; parsers normalise every backend's spelling additively."""

import pytest

from icefloe.client import ops
from icefloe.protocol import OP_GENERATE, TARGET_REFERENCE, InvalidRequestError, SamplingParams


def test_normalize_fwd_bwd_mirrors_training_api_names():
    out = ops.normalize_fwd_bwd({"job_id": "j", "avg_loss": 0.5, "metrics": {"clip_ratio": 0.1}, "approx_kl": 0.01})
    assert out["loss"] == out["avg_loss"] == 0.5
    assert out["metrics"] == {"clip_ratio": 0.1, "approx_kl": 0.01, "avg_loss": 0.5, "loss": 0.5}
    assert set(out) == {"loss", "avg_loss", "metrics", "num_tokens"}, "a service's own keys stay on the wire"


def test_normalize_step_accepts_managed_and_on_prem_shapes():
    managed = ops.normalize_step({"global_steps": 3, "last_lr": 1e-5})
    assert (managed["global_step"], managed["lr"], managed["grad_norm"]) == (3, 1e-5, None)
    assert managed["metrics"]["last_lr"] == 1e-5
    on_prem = ops.normalize_step({"metrics": {"last_lr": [2e-5, 2e-5], "grad_norm": [0.7, 0.7]}})
    assert on_prem["lr"] == 2e-5 and on_prem["grad_norm"] == 0.7


def test_generate_validates_prompts_and_aligns_params():
    call = ops.generate([[1, 2], "text"], [{"max_tokens": 4}, SamplingParams(n=2)])
    assert call.request.op == OP_GENERATE
    assert [p.n for p in call.request.body["sampling_params"]] == [1, 2]
    with pytest.raises(InvalidRequestError, match="prompts must be a list"):
        ops.generate("just a string")
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\]"):
        ops.generate([[1], []])
    with pytest.raises(InvalidRequestError, match="2 entries for 1 prompts"):
        ops.generate([[1]], [{}, {}])
    with pytest.raises(InvalidRequestError, match="top_p"):
        ops.generate([[1]], {"top_p": 1.5})
    with pytest.raises(InvalidRequestError, match="bogus"):
        ops.generate([[1]], {"bogus": 1})


def test_forward_targets_reference_role_when_asked():
    from icefloe.client.batch import build_batch

    call = ops.forward(build_batch([[1, 2]], [[3]], [1.0], pad_id=0), reference=True)
    assert call.request.target == TARGET_REFERENCE


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ops.step(learning_rate=0), "learning_rate must be > 0 and finite"),
        (lambda: ops.step(learning_rate=float("inf")), "learning_rate must be > 0 and finite.*; got inf"),
        (lambda: ops.step(learning_rate=1e309), "learning_rate must be > 0 and finite.*; got inf"),
        (lambda: ops.step(learning_rate=float("nan")), "learning_rate must be > 0 and finite.*; got nan"),
        (lambda: ops.save_checkpoint("full"), "kind must be one of"),
        (lambda: ops.load_checkpoint(""), "checkpoint_id is required"),
        (lambda: ops.get_checkpoint(""), "checkpoint_id is required"),
        (lambda: ops.delete_checkpoint(""), "checkpoint_id is required"),
    ],
)
def test_builders_reject_bad_arguments(call, message):
    with pytest.raises(InvalidRequestError, match=message):
        call()
