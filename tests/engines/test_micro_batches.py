"""Micro-batches by token budget: the plan, the cut, and results equal to one pass over the padded batch."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from icefloe.engines import batch as batch_module
from icefloe.engines.batch import shifted_token_logprobs, validate_batch
from icefloe.engines.losses import AGG_MODES
from icefloe.engines.micro_batches import (
    MicroBatch,
    Spans,
    cut_micro_batch,
    default_token_budget,
    place_rows,
    plan_micro_batches,
    row_spans,
    training_bytes_per_token,
)
from icefloe.engines.training import TrainingEngine
from icefloe.protocol import InvalidRequestError

from .engine_batches import make_batch, make_config

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# Wide clip ranges keep every loss's gradient alive on random old log-probs.
CLIPS = {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
# Each loss with the settings that exercise it: every grpo aggregation mode (seq-mean modes need
# the whole batch's row count and width across passes), and the Tinker losses with explicit targets.
CASES = [
    *[("grpo", {"loss_agg_mode": mode, "c_clip": 3.0, "entropy_coeff": 0.01}, False) for mode in AGG_MODES],
    ("cross_entropy", {}, False),
    ("cross_entropy", {"loss_agg_mode": "token-sum"}, True),
    ("importance_sampling", {}, True),
    ("ppo", CLIPS, True),
    ("cispo", CLIPS, True),
    ("dro", {}, True),
    ("gspo", CLIPS, True),
    ("gspo", {"clip_low_threshold": 0.98, "clip_high_threshold": 1.02}, True),  # some rows clipped, some not
]


def _rows(num_rows: int, *, seed: int, longest: int = 40) -> tuple[list, list, list]:
    gen = torch.Generator().manual_seed(seed)
    prompts, responses, advantages = [], [], []
    for _ in range(num_rows):
        total = int(torch.randint(3, longest + 1, (1,), generator=gen))
        split = int(torch.randint(1, total, (1,), generator=gen))
        tokens = torch.randint(4, 19, (total,), generator=gen).tolist()
        prompts.append(tokens[:split])
        responses.append(tokens[split:])
        advantages.append(float(torch.randn(1, generator=gen)))
    return prompts, responses, advantages


def _batch(loss_fn: str, config: dict, targets: bool, *, seed: int = 0) -> dict:
    """Nine right-padded rows of 3 to 40 tokens; ``targets``: the Tinker API's frame (explicit targets)."""
    batch = make_batch(*_rows(9, seed=seed), loss_fn=loss_fn, config=config)
    context = batch["context"]
    gen = torch.Generator().manual_seed(seed + 1)
    if targets:
        attention_BS = batch["kwargs"]["attention_mask"]
        ids_BS = batch["kwargs"]["input_ids"]
        context["target_tokens"] = torch.where(attention_BS.bool(), ids_BS.roll(-1, dims=1), 0)
        context["loss_mask"] = attention_BS.float()
        context["advantages"] = context["loss_mask"] * torch.randn(ids_BS.shape[0], 1, generator=gen)
        del context["input_ids"]
    context["old_logprobs"] = (-3.0 + 0.3 * torch.randn(context["loss_mask"].shape, generator=gen)) * (
        context["loss_mask"]
    )
    batch["processing"]["config"]["return_logprobs"] = True
    return batch


@pytest.fixture(scope="module")
def engines(model_dir) -> dict[str, TrainingEngine]:
    """One pass over the padded batch (budget 0), the default budget, and a budget that forces many passes."""
    budgets = {"one_pass": 0, "default": None, "small": 48}
    return {
        name: TrainingEngine(make_config(training={"micro_batch_tokens": budget}), model_dir=model_dir)
        for name, budget in budgets.items()
    }


def _run(engine: TrainingEngine, batch: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    assert engine.optimizer is not None
    engine.optimizer.zero_grad(set_to_none=True)
    result = engine.fwd_bwd(batch)
    grads = {name: p.grad.clone() for name, p in engine.model.named_parameters() if p.grad is not None}
    return result, grads


def _scores_a_token(batch: dict) -> torch.Tensor:
    """Columns whose log-prob means something: those that score a real token."""
    attention_BS = batch["kwargs"]["attention_mask"].bool()
    if "target_tokens" in batch["context"]:
        return attention_BS
    return torch.nn.functional.pad(attention_BS[:, 1:], (0, 1))


@pytest.mark.parametrize(("loss_fn", "config", "targets"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_micro_batched_fwd_bwd_equals_one_pass_for_every_loss(engines, loss_fn, config, targets):
    batch = _batch(loss_fn, config, targets)
    expected, expected_grads = _run(engines["one_pass"], batch)
    assert expected["metrics"]["padding_ratio"] > 1.3  # the one pass computes every padded position
    scored_BS = _scores_a_token(batch)
    for name in ("default", "small"):
        result, grads = _run(engines[name], batch)
        # float32 sums of another order: a loss of ~100 (cispo sums its tokens) differs by ~1e-5 alone
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-5), name
        assert result["num_tokens"] == expected["num_tokens"]
        assert result["metrics"]["padding_ratio"] <= 1.05
        assert result["metrics"].keys() == expected["metrics"].keys()
        for metric, value in expected["metrics"].items():
            if metric != "padding_ratio":
                assert result["metrics"][metric] == pytest.approx(value, rel=1e-6, abs=1e-5), (name, metric)
        assert result["logprobs"].shape == expected["logprobs"].shape  # the caller's rows, order and width
        assert_close(result["logprobs"][scored_BS], expected["logprobs"][scored_BS], **TOLERANCE)
        assert result["logprobs"][~scored_BS].eq(0).all()
        assert grads.keys() == expected_grads.keys() and grads
        for param, grad in expected_grads.items():
            assert_close(grads[param], grad, **TOLERANCE, msg=f"{name}: {param}")


def test_forward_equals_one_pass_for_left_and_right_padded_rows(engines):
    """verl's layout: prompts left-padded, responses right-padded, position ids counted over real tokens."""
    prompts, responses, _ = _rows(7, seed=4, longest=30)
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    ids_BS = torch.zeros((7, width_p + width_r), dtype=torch.int64)
    attention_BS = torch.zeros_like(ids_BS)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        ids_BS[row, width_p - len(prompt) : width_p + len(response)] = torch.tensor(prompt + response)
        attention_BS[row, width_p - len(prompt) : width_p + len(response)] = 1
    positions_BS = (attention_BS.cumsum(-1) - 1).clamp_min(0)
    batch = {"kwargs": {"input_ids": ids_BS, "attention_mask": attention_BS, "position_ids": positions_BS}}
    expected = engines["one_pass"].forward(batch)
    scored_BS = torch.nn.functional.pad((attention_BS[:, 1:] * attention_BS[:, :-1]).bool(), (0, 1))
    for name in ("default", "small"):
        result = engines[name].forward(batch)
        for key in ("logprobs", "entropy"):
            assert result[key].shape == expected[key].shape
            assert_close(result[key][scored_BS], expected[key][scored_BS], **TOLERANCE)
            assert result[key][~scored_BS].eq(0).all()


def test_a_row_over_an_explicit_budget_is_refused_before_any_work(model_dir):
    engine = TrainingEngine(make_config(training={"micro_batch_tokens": 12}), model_dir=model_dir)
    batch = make_batch([[5, 6], [5] * 10, [7]], [[7], [8] * 5, [9] * 13], [1.0, -1.0, 0.5])
    with pytest.raises(InvalidRequestError) as caught:
        engine.fwd_bwd(batch)
    assert str(caught.value).startswith(
        "row 1 has 15, row 2 has 14 tokens, more than the micro-batch budget of 12 tokens per pass "
        "(training.micro_batch_tokens); raise training.micro_batch_tokens to at least 15"
    )
    assert all(p.grad is None for p in engine.model.parameters())
    with pytest.raises(InvalidRequestError, match="row 1 has 15"):
        engine.forward(batch)


def test_plan_keeps_every_pass_within_the_budget_and_the_padding_within_five_percent():
    gen = torch.Generator().manual_seed(0)
    lengths_B = torch.randint(100, 1701, (80,), generator=gen)
    spans = Spans(torch.zeros(80, dtype=torch.int64), lengths_B)
    passes = plan_micro_batches(spans, 4096)
    assert sorted(row for micro in passes for row in micro.rows) == list(range(80))
    for micro in passes:
        assert micro.num_positions <= 4096
        assert micro.width == max(int(lengths_B[row]) for row in micro.rows)
    assert sum(m.num_positions for m in passes) <= 1.05 * int(lengths_B.sum())
    assert plan_micro_batches(spans, 0) == [MicroBatch(tuple(range(80)), int(lengths_B.max()))]


def test_spans_cover_attended_and_scored_columns():
    batch = make_batch([[5, 6], [7]], [[8], [9, 9, 9]], [1.0, 1.0])
    frame = validate_batch(batch)
    spans = row_spans(frame)
    assert spans.start_B.tolist() == [0, 0] and spans.length_B.tolist() == [3, 4]
    assert row_spans(frame, whole=True).length_B.tolist() == [4, 4]
    frame["kwargs"]["attention_mask"] = torch.zeros_like(frame["kwargs"]["attention_mask"])
    frame["context"]["loss_mask"] = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    spans = row_spans(frame)  # a scored column needs the next token too; an empty row still runs once
    assert spans.start_B.tolist() == [2, 0] and spans.length_B.tolist() == [2, 1]


def test_cut_drops_the_mask_of_gapless_rows_and_puts_outputs_back_in_place():
    frame = validate_batch(make_batch([[5, 6], [7]], [[8], [9, 9, 9]], [1.0, 1.0]))
    spans = row_spans(frame)
    micro = MicroBatch((1, 0), 4)
    part = cut_micro_batch(frame, micro, spans)
    assert "attention_mask" not in part["kwargs"]
    assert part["kwargs"]["input_ids"].tolist() == [[7, 9, 9, 9], [5, 6, 8, 0]]
    assert part["kwargs"]["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert part["context"]["loss_mask"].tolist() == [[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    out_BS = torch.zeros(2, 4)
    place_rows(out_BS, torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]]), micro, spans, shifted=True)
    assert out_BS.tolist() == [[5.0, 6.0, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0]]

    frame["kwargs"]["attention_mask"][1, 1] = 0  # a gap inside a span: the mask must stay
    assert cut_micro_batch(frame, micro, spans)["kwargs"]["attention_mask"].tolist() == [[1, 0, 1, 1], [1, 1, 1, 0]]


def test_chunked_logprobs_equal_one_chunk_values_and_gradients(monkeypatch):
    logits = torch.randn(3, 7, 11, requires_grad=True)
    ids = torch.randint(0, 11, (3, 7))
    whole_lp, whole_ent = shifted_token_logprobs(logits, ids, 0.8)
    (whole_lp.sum() + whole_ent.sum()).backward()
    whole_grad, logits.grad = logits.grad.clone(), None
    monkeypatch.setattr(batch_module, "_CHUNK_VALUES", 3 * 11 * 2)  # two columns per chunk
    chunked_lp, chunked_ent = shifted_token_logprobs(logits, ids, 0.8)
    (chunked_lp.sum() + chunked_ent.sum()).backward()
    assert_close(chunked_lp, whole_lp)
    assert_close(chunked_ent, whole_ent)
    assert_close(logits.grad, whole_grad)
    targets = torch.randint(0, 11, (3, 7))  # explicit targets: the last column is scored too
    last_B = logits[:, -1].log_softmax(-1).gather(-1, targets[:, -1:]).squeeze(-1)
    assert_close(shifted_token_logprobs(logits, ids, targets_BS=targets)[0][:, -1], last_B)


def test_default_budget_is_bounded_by_the_device_and_fits_the_longest_row(model_dir):
    engine = TrainingEngine(make_config(), model_dir=model_dir)
    per_token = training_bytes_per_token(engine.model.config, dtype_bytes=4, checkpointed=False)
    assert 48 <= engine.token_budget <= 160 * 2**20 // per_token
    assert training_bytes_per_token(engine.model.config, dtype_bytes=4, checkpointed=True) < per_token
    assert default_token_budget(10**15, torch.device("cpu"), floor=300) == 300  # the longest row always fits
    # a CPU pass holds at most 160 MiB of activations: fewer tokens of a larger model
    assert default_token_budget(160 * 1024, torch.device("cpu"), floor=300) == 1024
    assert default_token_budget(16 * 1024, torch.device("cpu"), floor=300) == 10240
    assert default_token_budget(160 * 1024, torch.device("cpu"), floor=3000) == 3000
    assert default_token_budget(160 * 1024, torch.device("cpu"), floor=300, capped=False) > 1024
