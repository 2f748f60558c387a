"""Byte chunking: splitting rules, shuffled reassembly, one error per corruption, events, inline envelope."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import uuid

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from icefloe import wire
from icefloe.protocol import ChunkDigestError, ChunkError, ChunkIndexError, ChunkMismatchError, FrameFormatError

from .support import split_header

_SMALL_CAP = wire.CHUNK_OVERHEAD_BYTES + 100  # 100-byte payloads


def _frame(size: int = 1000, seed: int = 0) -> bytes:
    values = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return wire.encode({"blob": values, "seed": seed})


def _chunk(payload: bytes, kind: str = "request", **descriptor) -> bytes:
    """A hand-made chunk frame, for descriptors the splitter would never write."""
    return wire.encode({"payload": np.frombuffer(payload, dtype=np.uint8)}, op_metadata={f"{kind}_chunk": descriptor})


# --- splitting ---------------------------------------------------------------------------------
def test_split_frame_returns_a_fitting_frame_unchanged():
    frame = _frame()
    assert wire.split_frame(frame, max_bytes=len(frame)) == [frame]
    assert wire.split_frame(frame, max_bytes=0) == [frame]
    assert wire.chunk_descriptor(frame) is None


def test_split_frame_writes_descriptors_per_spec():
    frame = _frame(size=250)
    chunks = wire.split_frame(frame, max_bytes=_SMALL_CAP, operation="fwd-bwd", force=True)
    descriptors = [wire.chunk_descriptor(chunk) for chunk in chunks]
    group = descriptors[0]["chunk_group_id"]
    assert uuid.UUID(group).version == 4
    assert len(chunks) == -(-len(frame) // 100)
    assert descriptors[1] == {
        "chunk_idx": 1,
        "total_chunks": len(chunks),
        "frame_sha256": hashlib.sha256(frame).hexdigest(),
        "frame_size_bytes": len(frame),
        "chunk_group_id": group,
        "operation": "fwd-bwd",
        "kind": "request",
    }
    assert list(json.loads(split_header(chunks[0])[0]["__metadata__"]["op"])["request_chunk"]) == [
        "chunk_idx", "total_chunks", "frame_sha256", "frame_size_bytes", "chunk_group_id", "operation",
    ]  # fmt: skip
    assert wire.chunk_payload(chunks[1]) == frame[100:200]
    assert all(len(chunk) <= _SMALL_CAP for chunk in chunks)


def test_split_frame_force_wraps_a_single_chunk_and_keeps_a_given_group_id():
    frame = _frame()
    (chunk,) = wire.split_frame(frame, max_bytes=wire.MAX_POST_BYTES, force=True, chunk_group_id="g-1")
    assert wire.chunk_descriptor(chunk)["chunk_group_id"] == "g-1"
    (unbounded,) = wire.split_frame(frame, max_bytes=0, force=True)
    assert wire.chunk_payload(unbounded) == frame
    assert wire.join_chunks([chunk]) == frame


def test_split_frame_forced_empty_frame_yields_one_empty_chunk():
    (chunk,) = wire.split_frame(b"", max_bytes=_SMALL_CAP, force=True)
    assert wire.chunk_payload(chunk) == b""
    assert wire.join_chunks([chunk]) == b""


def test_split_frame_result_kind_has_no_group_id():
    chunks = wire.split_frame(_frame(), max_bytes=_SMALL_CAP, kind="result", force=True)
    assert "chunk_group_id" not in wire.chunk_descriptor(chunks[0])
    assert wire.chunk_descriptor(chunks[0])["kind"] == "result"
    with pytest.raises(ChunkError, match="chunk_group_id is only for request chunks"):
        wire.split_frame(_frame(), max_bytes=_SMALL_CAP, kind="result", chunk_group_id="g")


def test_split_frame_halves_payload_until_chunks_fit():
    """A long operation label makes the chunk header exceed the 8 KiB reserve; payloads must shrink."""
    frame = _frame(size=5000)
    label = "x" * 8500
    chunks = wire.split_frame(frame, max_bytes=10_000, operation=label, force=True)
    assert all(len(chunk) <= 10_000 for chunk in chunks)
    assert len(wire.chunk_payload(chunks[0])) == (10_000 - wire.CHUNK_OVERHEAD_BYTES) // 2
    assert wire.join_chunks(chunks[::-1]) == frame


def test_split_frame_refuses_a_cap_too_small_for_any_chunk():
    with pytest.raises(ChunkError, match="max_bytes=9000 cannot hold a chunk frame even with a 1-byte payload"):
        wire.split_frame(_frame(), max_bytes=9000, operation="x" * 9000, force=True)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"chunk_group_id": ""}, "chunk_group_id must be a non-empty str; got ''"),
        ({"operation": 3}, "operation must be a non-empty str; got 3"),
    ],
)
def test_split_frame_rejects_bad_labels(arguments, message):
    with pytest.raises(ChunkError, match=message):
        wire.split_frame(_frame(), max_bytes=_SMALL_CAP, force=True, **arguments)


def test_split_frame_rejects_unknown_kind():
    with pytest.raises(ChunkError, match="kind must be 'request' or 'result'; got 'reply'"):
        wire.split_frame(_frame(), max_bytes=_SMALL_CAP, kind="reply")


# --- joining -----------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(size=st.integers(0, 3000), cap_payload=st.integers(1, 700), seed=st.integers(0, 2**16))
def test_join_chunks_reassembles_shuffled_chunks(size, cap_payload, seed):
    frame = _frame(size=size, seed=seed)
    chunks = wire.split_frame(frame, max_bytes=wire.CHUNK_OVERHEAD_BYTES + cap_payload, force=True)
    random.Random(seed).shuffle(chunks)
    assert wire.join_chunks(chunks) == frame
    assert wire.decode(wire.join_chunks(chunks))["seed"] == seed


def test_join_chunks_passes_a_single_plain_frame_through():
    frame = _frame()
    assert wire.join_chunks([frame]) is frame


def test_join_chunks_rejects_empty_list():
    with pytest.raises(ChunkIndexError, match="no frames to join"):
        wire.join_chunks([])


def _pieces(frame: bytes, count: int = 3) -> list[bytes]:
    size = -(-len(frame) // count)
    return [frame[i * size : (i + 1) * size] for i in range(count)]


def _forged(
    frame: bytes, pieces: list[bytes] | None = None, overrides: dict[int, dict] | None = None, **common
) -> list[bytes]:
    """Hand-made chunks of ``frame``; ``common`` changes every descriptor, ``overrides[i]`` chunk i's."""
    pieces = pieces if pieces is not None else _pieces(frame)
    base = {
        "total_chunks": len(pieces),
        "frame_sha256": hashlib.sha256(frame).hexdigest(),
        "frame_size_bytes": len(frame),
        "chunk_group_id": "group",
        **common,
    }
    overrides = overrides or {}
    return [
        _chunk(piece, **{"chunk_idx": index, **base, **overrides.get(index, {})}) for index, piece in enumerate(pieces)
    ]


def test_forged_chunks_join_when_untampered():
    frame = _frame()
    assert wire.join_chunks(_forged(frame)) == frame


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (
            lambda c, f: [*c[:2], _forged(f, chunk_group_id="other")[2]],
            ChunkMismatchError,
            "chunk 2 has chunk_group_id='other'",
        ),
        (
            lambda c, f: [*c[:2], _forged(f, overrides={2: {"operation": "generate"}})[2]],
            ChunkMismatchError,
            "chunk 2 has operation='generate' but chunk 0 has None",
        ),
        (
            lambda c, f: [*c[:2], _forged(f, overrides={2: {"frame_size_bytes": 5}})[2]],
            ChunkMismatchError,
            "chunk 2 has frame_size_bytes=5",
        ),
        (
            lambda c, f: [*c[:2], _forged(f, overrides={2: {"frame_sha256": "0" * 64}})[2]],
            ChunkMismatchError,
            "chunk 2 has frame_sha256=",
        ),
        (
            lambda c, f: [*c[:2], _forged(f, overrides={2: {"total_chunks": 4, "chunk_idx": 3}})[2]],
            ChunkMismatchError,
            "chunk 3 has total_chunks=4 but chunk 0 has 3",
        ),
        (
            lambda c, f: [*c[:2], f],
            ChunkMismatchError,
            "frame at position 2 carries no request_chunk/result_chunk metadata",
        ),
        (
            lambda c, f: [
                *c[:2],
                _chunk(
                    f[-5:],
                    "result",
                    chunk_idx=2,
                    total_chunks=3,
                    frame_sha256=hashlib.sha256(f).hexdigest(),
                    frame_size_bytes=len(f),
                ),
            ],
            ChunkMismatchError,
            "chunk 2 is a result chunk; expected request chunks",
        ),
        (lambda c, f: [c[0], c[1], c[1]], ChunkIndexError, "chunk 1 appears more than once"),
        (lambda c, f: [c[0], c[2]], ChunkIndexError, "got 2 of 3 chunks; missing indices [1] (first 10)"),
        (
            lambda c, f: [*c[:2], _forged(f, overrides={2: {"chunk_idx": 3}})[2]],
            ChunkIndexError,
            "request_chunk.chunk_idx 3 is out of range for total_chunks 3",
        ),
        (
            lambda c, f: [*c[:2], _forged(f, pieces=[*_pieces(f)[:2], _pieces(f)[2][:-1] + b"?"])[2]],
            ChunkDigestError,
            "joined frame has SHA-256",
        ),
        (
            lambda c, f: [*c[:2], _forged(f, pieces=[*_pieces(f)[:2], _pieces(f)[2] + b"?"])[2]],
            ChunkDigestError,
            "joined chunks hold 1193 bytes; descriptors announce 1192",
        ),
        (lambda c, f: [*c[:2], c[2][:-1]], FrameFormatError, "chunk frame at position 2: data region is"),
    ],
)
def test_join_chunks_raises_one_error_per_corruption(mutate, error, message):
    frame = _frame()
    assert len(frame) == 1192
    with pytest.raises(error) as caught:
        wire.join_chunks(mutate(_forged(frame), frame))
    assert type(caught.value) is error
    assert str(caught.value).startswith(message)


def test_join_chunks_checks_the_expected_kind():
    chunks = wire.split_frame(_frame(), max_bytes=_SMALL_CAP, kind="result", force=True)
    with pytest.raises(ChunkMismatchError, match="chunk 0 is a result chunk; expected request chunks"):
        wire.join_chunks(chunks, kind="request")


def test_join_chunks_refuses_a_non_payload_chunk_body():
    frame = _frame()
    descriptor = {"chunk_idx": 0, "total_chunks": 1, "frame_sha256": hashlib.sha256(frame).hexdigest(),
                  "frame_size_bytes": len(frame), "chunk_group_id": "g"}  # fmt: skip
    odd = wire.encode({"payload": torch.ones(2)}, op_metadata={"request_chunk": descriptor})
    with pytest.raises(ChunkError, match=r"chunk 0: body must be \{'payload': U8 1-D tensor\}"):
        wire.join_chunks([odd])


# --- descriptors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("descriptor", "error", "message"),
    [
        ({"chunk_idx": 0}, ChunkError, "request_chunk descriptor is missing ['total_chunks', 'frame_sha256'"),
        (
            {
                "chunk_idx": 0,
                "total_chunks": 1,
                "frame_sha256": "a" * 64,
                "frame_size_bytes": 1,
                "chunk_group_id": "g",
                "x": 1,
            },
            ChunkError,
            "request_chunk descriptor is missing [] / has unknown fields ['x']",
        ),
        (
            {
                "chunk_idx": -1,
                "total_chunks": 1,
                "frame_sha256": "a" * 64,
                "frame_size_bytes": 1,
                "chunk_group_id": "g",
            },
            ChunkError,
            "request_chunk.chunk_idx must be an int >= 0; got -1",
        ),
        (
            {
                "chunk_idx": 0,
                "total_chunks": True,
                "frame_sha256": "a" * 64,
                "frame_size_bytes": 1,
                "chunk_group_id": "g",
            },
            ChunkError,
            "request_chunk.total_chunks must be an int >= 1; got True",
        ),
        (
            {"chunk_idx": 0, "total_chunks": 1, "frame_sha256": "A" * 64, "frame_size_bytes": 1, "chunk_group_id": "g"},
            ChunkError,
            "request_chunk.frame_sha256 must be 64 lowercase hex",
        ),
        (
            {"chunk_idx": 0, "total_chunks": 1, "frame_sha256": "a" * 64, "frame_size_bytes": 1, "chunk_group_id": ""},
            ChunkError,
            "request_chunk.chunk_group_id must be a non-empty str",
        ),
        (
            {"chunk_idx": 1, "total_chunks": 1, "frame_sha256": "a" * 64, "frame_size_bytes": 1, "chunk_group_id": "g"},
            ChunkIndexError,
            "request_chunk.chunk_idx 1 is out of range",
        ),
    ],
)
def test_chunk_descriptor_rejects_malformed_descriptors(descriptor, error, message):
    with pytest.raises(error) as caught:
        wire.chunk_descriptor(_chunk(b"x", **descriptor))
    assert str(caught.value).startswith(message)


def test_chunk_descriptor_is_none_for_plain_frames_and_garbage():
    assert wire.chunk_descriptor(wire.encode({"a": 1}, op_metadata={"response_options": {}})) is None
    assert wire.chunk_descriptor(b"\x00garbage") is None


def test_chunk_descriptor_rejects_both_kinds_at_once():
    frame = wire.encode({"payload": np.zeros(1, np.uint8)}, op_metadata={"request_chunk": {}, "result_chunk": {}})
    with pytest.raises(ChunkError, match="both request_chunk and result_chunk"):
        wire.chunk_descriptor(frame)


def test_chunk_payload_refuses_plain_frames():
    with pytest.raises(ChunkMismatchError, match="carries no request_chunk/result_chunk metadata"):
        wire.chunk_payload(_frame())


# --- result events -----------------------------------------------------------------------------
def test_result_chunk_events_round_trip_and_carry_per_chunk_sha256():
    frame = _frame(size=_SMALL_CAP)
    events = wire.result_chunk_events(frame, max_bytes=_SMALL_CAP)
    assert len(events) == -(-len(frame) // 100)
    assert set(events[0]) == {"type", "payload_b64", "payload_sha256"}
    chunk = base64.b64decode(events[0]["payload_b64"])
    assert events[0]["payload_sha256"] == hashlib.sha256(chunk).hexdigest()
    assert wire.join_result_events(reversed(events)) == frame


def test_result_chunk_events_small_frame_travels_unwrapped():
    frame = _frame(size=10)
    (event,) = wire.result_chunk_events(frame, max_bytes=_SMALL_CAP)
    assert base64.b64decode(event["payload_b64"]) == frame
    assert wire.join_result_events([event]) == frame


def test_join_result_events_accepts_missing_payload_sha256():
    frame = _frame(size=_SMALL_CAP)
    events = wire.result_chunk_events(frame, max_bytes=_SMALL_CAP)
    for event in events:
        del event["payload_sha256"]
    assert wire.join_result_events(events) == frame


@pytest.mark.parametrize(
    ("mutate", "error", "message"),
    [
        (lambda e: {**e, "payload_sha256": "0" * 64}, ChunkDigestError, "event 1: payload_sha256 is '0000"),
        (lambda e: {**e, "payload_b64": "!!"}, ChunkError, "event 1 payload_b64 is not valid base64"),
        (lambda e: {**e, "payload_b64": None}, ChunkError, "event 1 payload_b64 must be a base64 str; got NoneType"),
        (lambda e: {**e, "type": "result"}, ChunkError, "event 1 is 'result', not a result_chunk event"),
    ],
)
def test_join_result_events_rejects_bad_events(mutate, error, message):
    events = wire.result_chunk_events(_frame(size=_SMALL_CAP), max_bytes=_SMALL_CAP)
    events[1] = mutate(events[1])
    with pytest.raises(error) as caught:
        wire.join_result_events(events)
    assert type(caught.value) is error
    assert str(caught.value).startswith(message)


# --- inline envelope ---------------------------------------------------------------------------
def test_inline_result_round_trips_a_dict_with_tensors():
    result = {"logprobs": torch.randn(2, 3), "n": 2}
    envelope = wire.inline_result(result)
    assert {k: v for k, v in envelope.items() if k != "payload_b64"} == {
        "content_type": "application/octet-stream",
        "encoding": "base64",
        "wire_format": "DSSST1",
    }
    decoded = wire.decode_inline_result(envelope)
    assert torch.equal(decoded["logprobs"], result["logprobs"]) and decoded["n"] == 2
    assert isinstance(wire.decode_inline_result(envelope, tensors="numpy")["logprobs"], np.ndarray)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda e: {**e, "encoding": "hex"}, "inline result encoding must be 'base64'; got 'hex'"),
        (
            lambda e: {k: v for k, v in e.items() if k != "wire_format"},
            "inline result wire_format must be 'DSSST1'; got None",
        ),
        (
            lambda e: {**e, "content_type": "application/json"},
            "inline result content_type must be 'application/octet-stream'",
        ),
        (lambda e: {**e, "payload_b64": "%%%"}, "inline result payload_b64 is not valid base64"),
        (lambda e: {**e, "payload_b64": base64.b64encode(b"junk").decode()}, "frame is 4 bytes"),
        (lambda e: [e], "inline result envelope must be a dict; got list"),
    ],
)
def test_decode_inline_result_rejects_bad_envelopes(mutate, message):
    with pytest.raises(FrameFormatError) as caught:
        wire.decode_inline_result(mutate(wire.inline_result({"a": 1})))
    assert str(caught.value).startswith(message)


def test_inline_result_round_trips_non_dict_values():
    assert wire.decode_inline_result(wire.inline_result([1, (2, 3)])) == [1, (2, 3)]
