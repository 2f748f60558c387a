"""Batch validation messages, micro-batch splitting and the shifted log-prob helper."""

from __future__ import annotations

import io
import pickle
import socket
import threading

import pytest
import torch
from torch.testing import assert_close

from icefloe.engines import batch as batch_module
from icefloe.engines.batch import Frame, shifted_token_logprobs, validate_batch
from icefloe.engines.micro_batches import MicroBatch, cut_micro_batch, row_spans
from icefloe.protocol import InvalidRequestError

from .engine_batches import make_batch


def _batch() -> dict:
    return make_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], [1.0, -0.5])


def test_validate_batch_normalises_aliases_dtypes_and_defaults():
    batch = _batch()
    old = torch.zeros(2, 5, dtype=torch.float64)
    batch["context"]["old_log_probs_shifted"] = old
    batch["kwargs"]["input_ids"] = batch["kwargs"]["input_ids"].int()
    del batch["kwargs"]["position_ids"]
    batch["processing"] = None
    frame = validate_batch(batch)
    assert frame["context"]["old_logprobs"].dtype == torch.float32
    assert "old_log_probs_shifted" not in frame["context"]
    assert frame["kwargs"]["input_ids"].dtype == torch.int64
    assert frame["kwargs"]["position_ids"].tolist() == [list(range(5))] * 2
    assert frame["processing"] == {"loss_fn": "grpo", "config": {}}


def test_a_validated_batch_reaches_another_process_as_a_frame_whose_large_tensors_travel_out_of_band():
    """A Frame pickles as itself over an engine process's pipe: its tensors from 16 KiB up are written from
    their own memory, not copied into the message, and it arrives validated, not checked again."""
    from icefloe.service.hosts import process

    raw = _batch()
    for section in ("kwargs", "context"):  # 2,000 rows of 5: 40 KB a float32 tensor
        raw[section] = {name: tensor.repeat(1000, 1) for name, tensor in raw[section].items()}
    raw["context"]["old_log_probs_shifted"] = torch.zeros(2000, 5, dtype=torch.float64)  # normalised here, once
    validated = validate_batch(raw)
    aside: list[pickle.PickleBuffer] = []
    head = io.BytesIO()
    process._Pickler(head, protocol=5, buffer_callback=process._set_aside(aside)).dump(validated)
    tensors = [t for section in ("kwargs", "context") for t in validated[section].values()]
    large = [t for t in tensors if t.numel() * t.element_size() >= 16 << 10]
    small_bytes = sum(t.numel() * t.element_size() for t in tensors) - sum(t.numel() * t.element_size() for t in large)
    assert len(large) >= 4 and len(aside) == len(large)  # each large tensor sent from its own memory
    assert head.getbuffer().nbytes < small_bytes + 4096
    arrived = _over_a_pipe(validated)
    assert type(arrived) is Frame and arrived.training and arrived.keys() == validated.keys()
    assert arrived["processing"] == validated["processing"] and arrived["context"].keys() == validated["context"].keys()
    assert arrived["context"]["old_logprobs"].dtype == torch.float32
    for section in ("kwargs", "context"):
        for name, tensor in validated[section].items():
            assert_close(arrived[section][name], tensor, rtol=0, atol=0)


class _Keeper:
    """Stand-in engines that keep what a call brought them."""

    kept: object = None

    def keep(self, value: object) -> None:
        self.kept = value


def _over_a_pipe(value: object) -> object:
    """``value`` as an engine process's engines get it: sent over a Pipe, handed on by :func:`serve` there."""
    from icefloe.service.hosts.process import Pipe, serve

    near, far = socket.socketpair()
    keeper = _Keeper()
    serving = threading.Thread(target=serve, args=(keeper, Pipe(far)), daemon=True)
    serving.start()
    pipe = Pipe(near)
    try:
        assert pipe.exchange(("keep", (value,)))[0] == "ok"
    finally:
        pipe.close()
        serving.join(10)
        far.close()
    return keeper.kept


def _set(section: str, **values):
    return lambda b: b[section].update(values)


def _mask_value(row: int, column: int, value: float):
    return lambda b: b["context"]["loss_mask"].__setitem__((row, column), value)


BAD_BATCHES = [
    (lambda b: b["context"].pop("loss_mask"), "context.loss_mask missing for loss 'grpo'"),
    (lambda b: b["context"].pop("advantages"), "context.advantages missing for loss 'grpo'"),
    (lambda b: b.pop("kwargs"), "batch.kwargs is missing"),
    (lambda b: b.pop("context"), "batch.context is missing"),
    (_set("context", advantages=torch.zeros(2, 4)), r"context.advantages has shape \[2, 4\]"),
    (_set("kwargs", input_ids=torch.zeros(2, 5)), "kwargs.input_ids must be an integer"),
    (_set("kwargs", attention_mask=torch.full((2, 5), 2)), "kwargs.attention_mask must hold only 0 and 1"),
    (_mask_value(0, 1, 0.5), "context.loss_mask must hold only 0 and 1"),
    (_mask_value(0, -1, 1.0), r"context.loss_mask\[:, -1\] must be 0"),
    (_set("context", advantages=[[0.0] * 5] * 2), "context.advantages must be a torch.Tensor"),
    (_set("context", old_log_probs_shifted=torch.zeros(2, 5), old_logprobs=torch.zeros(2, 5)), "given twice"),
    (_set("context", input_ids=torch.zeros(2, 5, dtype=torch.int64)), "context.input_ids must equal kwargs.input_ids"),
    (_set("processing", loss_fn="nope"), "processing.loss_fn 'nope' is not a registered loss"),
]


@pytest.mark.parametrize(("mutate", "message"), BAD_BATCHES)
def test_validate_batch_names_the_bad_field(mutate, message):
    batch = _batch()
    mutate(batch)
    with pytest.raises(InvalidRequestError, match=message):
        validate_batch(batch)


def test_validate_batch_checks_token_ids_against_the_vocabulary():
    with pytest.raises(InvalidRequestError, match=r"kwargs.input_ids must hold token ids in \[0, 12\)"):
        validate_batch(_batch(), vocab_size=12)


def test_validate_batch_forward_only_needs_no_context():
    batch = _batch()
    del batch["context"]
    assert validate_batch(batch, require_context=False)["context"] == {}


def test_validate_batch_cross_entropy_needs_no_advantages():
    batch = _batch()
    del batch["context"]["advantages"]
    batch["processing"]["loss_fn"] = "cross_entropy"
    assert "advantages" not in validate_batch(batch)["context"]


def test_shifted_token_logprobs_matches_a_per_position_loop():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 6, generator=gen)
    ids = torch.randint(0, 6, (2, 4), generator=gen)
    logprobs, entropy = shifted_token_logprobs(logits, ids, temperature=0.7)
    for b in range(2):
        for s in range(3):
            dist = torch.log_softmax(logits[b, s] / 0.7, dim=-1)
            assert_close(logprobs[b, s], dist[ids[b, s + 1]])
            assert_close(entropy[b, s], -(dist.exp() * dist).sum())
    assert logprobs[:, -1].eq(0).all() and entropy[:, -1].eq(0).all()
    assert logprobs.dtype == entropy.dtype == torch.float32


def test_shifted_token_logprobs_entropy_graph_is_optional():
    logits = torch.randn(1, 3, 5, requires_grad=True)
    ids = torch.tensor([[1, 2, 3]])
    logprobs, entropy = shifted_token_logprobs(logits, ids, entropy_requires_grad=False)
    assert logprobs.requires_grad and not entropy.requires_grad
    _, entropy = shifted_token_logprobs(logits, ids)
    assert entropy.requires_grad


def test_validate_batch_keeps_per_row_extras_and_drops_batch_level_ones():
    batch = _batch()
    batch["context"]["versions"] = torch.tensor([3, 4])
    batch["context"]["cu_seqlens"] = torch.tensor([0, 5, 10])
    batch["context"]["note"] = "not a tensor"
    frame = validate_batch(batch)
    assert "versions" in frame["context"] and "cu_seqlens" not in frame["context"] and "note" not in frame["context"]
    parts = [cut_micro_batch(frame, MicroBatch((row,), 5), row_spans(frame)) for row in (1, 0)]
    assert [p["context"]["versions"].tolist() for p in parts] == [[4], [3]]


def _sft(frame: dict) -> dict:
    """The training API's SFT object: pre-shifted labels (-100 = ignored) and no context or processing."""
    ids_BS = frame["kwargs"]["input_ids"]
    labels_BS = torch.where(frame["context"]["loss_mask"] > 0, ids_BS.roll(-1, dims=1), -100)
    return {"args": (), "kwargs": {**frame["kwargs"], "labels": labels_BS, "use_cache": False}}


def test_validate_batch_reads_the_sft_object_as_cross_entropy_over_its_labels():
    frame = _batch()
    normal = validate_batch(_sft(frame))
    assert normal["processing"] == {"loss_fn": "cross_entropy", "config": {}}
    assert_close(normal["context"]["loss_mask"], frame["context"]["loss_mask"])
    assert set(normal["kwargs"]) == {"input_ids", "attention_mask", "position_ids"}, "labels never reach the model"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda labels: labels.__setitem__((0, -1), 3), r"kwargs.labels\[:, -1\] must be -100"),
        (lambda labels: labels.__setitem__((0, 2), 3), r"kwargs.labels\[0, 2\] is 3 but input_ids\[0, 3\] is 10"),
    ],
)
def test_validate_batch_refuses_labels_that_are_not_pre_shifted(mutate, message):
    batch = _sft(_batch())
    mutate(batch["kwargs"]["labels"])
    with pytest.raises(InvalidRequestError, match=message):
        validate_batch(batch)


def test_validate_batch_refuses_labels_that_disagree_with_the_loss_mask():
    frame = _batch()
    batch = {**_sft(frame), "context": {**frame["context"], "loss_mask": torch.zeros(2, 5)}}
    with pytest.raises(InvalidRequestError, match=r"context\.loss_mask disagrees with kwargs\.labels"):
        validate_batch(batch)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (torch.full((2, 5), -100), r"context\.target_tokens holds -100.*\[0, 32\).*loss_mask"),
        (torch.full((2, 5), 32), r"context\.target_tokens holds 32.*\[0, 32\)"),
        (torch.full((2, 5), 3.0), r"context\.target_tokens must be an integer tensor"),
        (torch.zeros(2, 4, dtype=torch.int64), r"context\.target_tokens has shape \[2, 4\]"),
    ],
)
@pytest.mark.parametrize("require_context", [True, False], ids=["fwd_bwd", "forward"])
def test_validate_batch_checks_target_tokens_against_the_vocabulary(targets, message, require_context):
    """Out-of-vocabulary targets reached gather (a device-side assert on CUDA); forward truncated float ones."""
    batch = _batch()
    batch["context"]["target_tokens"] = targets
    with pytest.raises(InvalidRequestError, match=message):
        validate_batch(batch, require_context=require_context, vocab_size=32)


def test_an_engine_takes_a_validated_frame_as_it_is_also_in_another_process(model_dir, validations):
    """A batch was validated by the service's route, again by the engine, and a third time where an engine
    process decoded it: now once, where it enters (an engine process gets a Frame, pickled either way), and
    the engine checks it only against its vocabulary, which a route cannot know."""
    from icefloe.engines.training import TrainingEngine

    from .engine_batches import make_config

    engine = TrainingEngine(make_config(), model_dir=model_dir)
    frame = batch_module.validate_batch(_batch())
    arrived = _over_a_pipe(frame)
    engine.fwd_bwd(arrived)
    engine.forward(arrived)
    assert validations == [True]
    engine.fwd_bwd(batch_module.validate_batch(_batch(), require_context=False))  # a forward's checks: not enough
    engine.fwd_bwd(_batch())  # a plain dict
    assert validations == [True, False, True, True]

    past = batch_module.validate_batch({**_batch(), "context": None}, require_context=False)
    past["kwargs"]["input_ids"] = past["kwargs"]["input_ids"] + engine.vocab_size
    with pytest.raises(
        InvalidRequestError, match=rf"kwargs\.input_ids must hold token ids in \[0, {engine.vocab_size}\)"
    ):
        engine.forward(past)
    targets = batch_module.validate_batch(_batch())
    targets["context"]["target_tokens"] = torch.full((2, 5), engine.vocab_size)
    with pytest.raises(InvalidRequestError, match=r"context\.target_tokens holds"):
        engine.fwd_bwd(targets)
    assert len(validations) == 6, "refused by the vocabulary check alone"
