"""The canonical frame builder and the one verl-payload lowering."""

import pytest
import torch

from icefloe.client.batch import build_batch, responses_from_canonical, to_canonical
from icefloe.protocol import InvalidRequestError

PAD = 0
PROMPTS = [[11, 12, 13], [14, 15]]
RESPONSES = [[21, 22], [23, 24, 25]]


def _verl_payload() -> dict:
    """Rows (p=3, r=2) and (p=2, r=3): prompts left-padded to 3, responses right-padded to 3."""
    input_ids = torch.tensor([[11, 12, 13, 21, 22, PAD], [PAD, 14, 15, 23, 24, 25]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]])
    return {
        "batch": {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "prompts": input_ids[:, :3],
            "responses": input_ids[:, 3:],
            "response_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]),
            "advantages": torch.tensor([[0.5, 0.5, 0.0], [-1.0, -1.0, -1.0]]),
            "old_log_probs": torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]),
        },
        "meta": {
            "pad_token_id": PAD,
            "temperature": 0.7,
            "global_batch_size": 2,
            "actor_config": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},
        },
        "processing": {"loss_fn": "verl_grpo", "post": ["apply_temperature", "compute_entropy_and_logprobs"]},
    }


def test_build_batch_shifts_labels_onto_prediction_columns():
    frame = build_batch(PROMPTS, RESPONSES, [0.5, -1.0], pad_id=PAD, old_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]])
    ctx = frame["context"]
    assert frame["kwargs"]["input_ids"].tolist() == [[11, 12, 13, 21, 22], [14, 15, 23, 24, 25]]
    assert frame["kwargs"]["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert frame["kwargs"]["position_ids"].tolist() == [list(range(5))] * 2
    assert ctx["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 0]]
    assert ctx["advantages"].tolist() == [[0, 0, 0.5, 0.5, 0], [0, -1, -1, -1, 0]]
    torch.testing.assert_close(ctx["old_logprobs"], torch.tensor([[0, 0, -0.1, -0.2, 0], [0, -0.3, -0.4, -0.5, 0]]))
    assert frame["processing"] == {"loss_fn": "grpo", "config": {}}


def test_to_canonical_lowers_verl_payload_golden():
    """Left padding is removed and the frame is trimmed to the longest row, exactly as build_batch lays it out."""
    frame = to_canonical(_verl_payload())
    expected = build_batch(PROMPTS, RESPONSES, [0.5, -1.0], pad_id=PAD, old_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]])
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert torch.equal(frame["kwargs"][key], expected["kwargs"][key]), key
    for key in ("input_ids", "loss_mask", "advantages", "old_logprobs"):
        torch.testing.assert_close(frame["context"][key], expected["context"][key], msg=key)
    assert frame["processing"] == {
        "loss_fn": "grpo",
        "config": {
            "eps_clip": 0.2,
            "eps_clip_higher": 0.28,
            "c_clip": 3.0,  # verl's defaults fill what the actor config leaves unset
            "loss_agg_mode": "token-mean",
            "entropy_coeff": 0.0,
            "use_kl_loss": False,
            "kl_coef": 0.001,
            "kl_type": "low_var_kl",
            "loss_scale_factor": 3,  # the response width R
            "global_batch_size": 2,
            "temperature": 0.7,
        },
    }


@pytest.mark.parametrize(
    ("actor", "expected"),
    [
        ({}, {"eps_clip": 0.2, "eps_clip_higher": 0.2, "c_clip": 3.0, "loss_scale_factor": 3}),
        ({"clip_ratio": 0.3}, {"eps_clip": 0.3, "eps_clip_higher": 0.3}),
        ({"clip_ratio": 0.3, "clip_ratio_low": 0.1}, {"eps_clip": 0.1, "eps_clip_higher": 0.3}),
        ({"clip_ratio_c": 10.0, "loss_scale_factor": 512}, {"c_clip": 10.0, "loss_scale_factor": 512}),
        ({"kl_loss_type": "k3+", "kl_loss_coef": 0.05}, {"kl_type": "k3+", "kl_coef": 0.05}),
    ],
)
def test_to_canonical_reads_verl_actor_knobs_with_verls_defaults(actor, expected):
    payload = _verl_payload()
    payload["meta"]["actor_config"] = actor
    config = to_canonical(payload)["processing"]["config"]
    assert {key: config[key] for key in expected} == expected


def test_to_canonical_counts_rows_with_a_token_when_verl_sends_no_batch_size():
    payload = _verl_payload()
    del payload["meta"]["global_batch_size"]
    payload["batch"]["response_mask"] = torch.tensor([[0, 0, 0], [1, 1, 1]])
    assert to_canonical(payload)["processing"]["config"]["global_batch_size"] == 1


def test_to_canonical_accepts_full_width_response_tensors():
    payload = _verl_payload()
    batch = payload["batch"]
    for name in ("response_mask", "advantages", "old_log_probs"):
        batch[name] = torch.cat([torch.zeros(2, 3, dtype=batch[name].dtype), batch[name]], dim=1)
    full = to_canonical(payload)
    narrow = to_canonical(_verl_payload())
    for key in ("loss_mask", "advantages", "old_logprobs"):
        torch.testing.assert_close(full["context"][key], narrow["context"][key])


def test_responses_from_canonical_inverts_the_lowering():
    payload = _verl_payload()
    frame = to_canonical(payload)
    back_BR = responses_from_canonical(frame["context"]["old_logprobs"], payload["batch"], response_width=3)
    torch.testing.assert_close(back_BR * payload["batch"]["response_mask"], payload["batch"]["old_log_probs"])


def test_to_canonical_passes_canonical_frames_through_and_merges_processing():
    frame = build_batch(PROMPTS, RESPONSES, [1.0, 0.0], pad_id=PAD, loss_config={"eps_clip": 0.1})
    out = to_canonical(frame, {"loss_fn": "importance_sampling", "config": {"entropy_coeff": 0.01}})
    assert out["kwargs"]["input_ids"] is frame["kwargs"]["input_ids"]
    assert out["processing"] == {"loss_fn": "importance_sampling", "config": {"eps_clip": 0.1, "entropy_coeff": 0.01}}
    assert frame["processing"]["config"] == {"eps_clip": 0.1}, "the caller's frame must not be mutated"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (([[1]], [[2], [3]]), {}, "response_ids has 2 rows but prompt_ids has 1"),
        (([[]], [[2]]), {}, "prompt_ids[0] is empty"),
        (([[1]], [[]]), {}, "response_ids[0] is empty"),
        (([[1, 2]], [[3, 4]], [1.0, 2.0]), {}, "advantages has 2 rows"),
        (([[1, 2]], [[3, 4]]), {"max_seq_len": 3}, "over max_seq_len=3"),
        (([[1, 2]], [[3, 4]]), {"old_logprobs": [[0.1]]}, "old_logprobs[0] has 1 values for 2 response tokens"),
    ],
)
def test_build_batch_rejects_bad_rows_naming_the_field(args, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_batch(*args, pad_id=PAD, **kwargs)


def test_to_canonical_rejects_unknown_shapes():
    with pytest.raises(InvalidRequestError, match="canonical"):
        to_canonical({"input_ids": [[1, 2]]})


def test_to_canonical_rejects_nested_tensors_with_a_fix():
    payload = _verl_payload()
    payload["batch"]["input_ids"] = torch.nested.nested_tensor(
        [torch.tensor([1, 2]), torch.tensor([3])], layout=torch.jagged
    )
    with pytest.raises(InvalidRequestError, match="nested"):
        to_canonical(payload)
