"""Tinker forward_backward requests to canonical batches: every field is checked where the request is
converted, so the batch goes to the engine as it is (no second validation on the way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icefloe.engines.batch import validate_batch
from icefloe.protocol import InvalidRequestError

pb = pytest.importorskip("tinker.proto.tinker_public_pb2")
convert = pytest.importorskip("icefloe.service.tinker.convert")


def _request(*datums: tuple[list[int], list[int]]) -> object:
    """A cross_entropy request of datums ``(input tokens, target tokens)``, every weight 1."""
    message = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    for tokens, targets in datums:
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype=np.int32).tobytes()
        for name, values in (("target_tokens", np.asarray(targets, np.int64)), ("weights", np.ones(len(tokens)))):
            dtype = pb.DTYPE_INT64 if name == "target_tokens" else pb.DTYPE_FLOAT32
            array = values.astype(np.int64 if name == "target_tokens" else np.float32)
            datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dense=array.tobytes(), dtype=dtype, shape=[len(tokens)]))
    return message


def _batch(message: object) -> dict:
    batch, _ = convert.batch_from_request(message, pad_id=0, context_length=64, max_tokens=1024)
    return batch


def test_batch_from_request_is_a_batch_the_engine_takes_as_it_is():
    batch = _batch(_request(([5, 6, 7], [6, 7, 8]), ([9, 10], [10, 11])))
    validated = validate_batch(batch, require_context=True)
    for section in ("kwargs", "context"):
        for name, tensor in batch[section].items():
            assert validated[section][name].dtype == tensor.dtype, f"{section}.{name}"
            assert torch.equal(validated[section][name], tensor), f"{section}.{name}"
    assert validated["processing"] == batch["processing"]


def test_batch_from_request_refuses_a_negative_token_id_naming_the_datum():
    with pytest.raises(InvalidRequestError, match=r"data\.1\.model_input holds token id -3; token ids are integers"):
        _batch(_request(([5, 6], [6, 7]), ([5, -3], [6, 7])))


def test_batch_from_request_refuses_a_negative_target_naming_the_field():
    with pytest.raises(InvalidRequestError, match=r"data\.0\.loss_fn_inputs\.target_tokens holds -100, not a token"):
        _batch(_request(([5, 6], [6, -100])))


def test_model_id_of_reads_a_full_request_and_refuses_each_count_naming_it():
    """Counted from the wire bytes: a request as the SDK builds it passes; a body of empty datums, of empty
    chunks or of a long packed shape is refused before it is parsed, and bytes that are no protobuf are a 400."""
    from icefloe.protocol import PayloadTooLargeError

    message = pb.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, loss_fn="cross_entropy")
    for _ in range(1024):
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.arange(8, dtype=np.int32).tobytes()
        for name in ("target_tokens", "weights", "advantages", "logprobs", "mask"):
            datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dense=bytes(32), dtype=pb.DTYPE_FLOAT32, shape=[8]))
    assert convert.model_id_of(message.SerializeToString()) == "s:train:0"
    head = b"\x0a\x09s:train:0"
    with pytest.raises(PayloadTooLargeError, match="more than 4096 datums"):
        convert.model_id_of(head + b"\x1a\x00" * 5000)
    chunks = b"\x0a\x00" * 200_000
    with pytest.raises(PayloadTooLargeError, match="more than 131072 protobuf messages"):
        convert.model_id_of(head + b"\x1a" + bytes([0x80 | len(chunks) & 0x7F, 0x80 | len(chunks) >> 7 & 0x7F,
                                                    len(chunks) >> 14]) + chunks)  # fmt: skip
    with pytest.raises(PayloadTooLargeError, match="more than 262144 protobuf fields"):
        convert.model_id_of(head + b"\x10\x01" * 300_000)  # seq_id again and again: nothing built, but walked
    with pytest.raises(InvalidRequestError, match="the body is not a ForwardBackwardRequest protobuf"):
        convert.model_id_of(head + b"\x1a\x05\x0a")
    with pytest.raises(InvalidRequestError, match="protobuf with a model_id"):  # walked as unknown fields, no model
        convert.model_id_of(b"\x12" * 70_000)
