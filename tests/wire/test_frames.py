"""The safetensors container: golden bytes from the spec, strict header validation, legacy refusal."""

from __future__ import annotations

import io
import json
import pickle
import struct

import numpy as np
import pytest
import torch

from icefloe import wire
from icefloe.protocol import FrameFormatError, LegacyPickleError, WireError
from icefloe.wire.frames import MAX_HEADER_BYTES, read_header

from .support import join_header, split_header


def _escaped(text: str) -> str:
    return text.replace('"', '\\"')


def _golden(header_text: str, data: bytes) -> bytes:
    raw = header_text.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


# --- golden frames (training API reference §2.6) -------------------------------------------------
def test_encode_generate_request_matches_spec_layout_byte_for_byte():
    dss = '{"v": "DSSST1", "tree": ["j", {"prompts": [[1, 2, 3]], "strict": false}]}'
    op = '{"response_options": {"format": "dssst1", "delivery": "chunked"}}'
    header = (
        f'{{"__metadata__":{{"dss":"{_escaped(dss)}","op":"{_escaped(op)}"}},'
        '"__dss_empty__":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    )
    expected = _golden(header, b"\x00")

    frame = wire.encode(
        {"prompts": [[1, 2, 3]], "strict": False},
        op_metadata={"response_options": {"format": "dssst1", "delivery": "chunked"}},
    )

    assert frame == expected
    assert struct.unpack_from("<Q", frame)[0] % 8 == 0
    assert wire.decode(frame) == {"prompts": [[1, 2, 3]], "strict": False}


def _small_fwd_bwd() -> dict:
    return {
        "args": (),
        "kwargs": {
            "input_ids": torch.tensor([[5, 6]]),
            "attention_mask": torch.tensor([[1, 1]]),
            "position_ids": torch.tensor([[0, 1]]),
            "use_cache": False,
        },
        "context": {
            "input_ids": torch.tensor([[5, 6]]),
            "advantages": torch.tensor([[0.5, 0.0]]),
            "loss_mask": torch.tensor([[1.0, 0.0]]),
        },
        "processing": {"loss_fn": "grpo", "config": {"eps_clip": 0.2}},
    }


def test_encode_fwd_bwd_frame_matches_golden_header_offsets_and_data():
    dss = (
        '{"v": "DSSST1", "tree": ["d", [["args", ["u", []]], ["kwargs", ["d", [["input_ids", ["t", '
        '"kwargs.input_ids"]], ["attention_mask", ["t", "kwargs.attention_mask"]], ["position_ids", ["t", '
        '"kwargs.position_ids"]], ["use_cache", ["j", false]]]]], ["context", ["d", [["input_ids", ["t", '
        '"context.input_ids"]], ["advantages", ["t", "context.advantages"]], ["loss_mask", ["t", '
        '"context.loss_mask"]]]]], ["processing", ["j", {"loss_fn": "grpo", "config": {"eps_clip": 0.2}}]]]]}'
    )
    # 8-byte dtypes first, ties by name; then the 4-byte ones.
    header = (
        f'{{"__metadata__":{{"dss":"{_escaped(dss)}"}},'
        '"context.input_ids":{"dtype":"I64","shape":[1,2],"data_offsets":[0,16]},'
        '"kwargs.attention_mask":{"dtype":"I64","shape":[1,2],"data_offsets":[16,32]},'
        '"kwargs.input_ids":{"dtype":"I64","shape":[1,2],"data_offsets":[32,48]},'
        '"kwargs.position_ids":{"dtype":"I64","shape":[1,2],"data_offsets":[48,64]},'
        '"context.advantages":{"dtype":"F32","shape":[1,2],"data_offsets":[64,72]},'
        '"context.loss_mask":{"dtype":"F32","shape":[1,2],"data_offsets":[72,80]}}'
    )
    data = (
        struct.pack("<2q", 5, 6)
        + struct.pack("<2q", 1, 1)
        + struct.pack("<2q", 5, 6)
        + struct.pack("<2q", 0, 1)
        + struct.pack("<2f", 0.5, 0.0)
        + struct.pack("<2f", 1.0, 0.0)
    )

    assert wire.encode(_small_fwd_bwd()) == _golden(header, data)


def test_encode_chunk_frame_matches_spec_layout():
    frame = wire.encode({"payload": np.frombuffer(b"abc", dtype=np.uint8)}, op_metadata={"request_chunk": {"a": 1}})
    header, data = split_header(frame)
    assert json.loads(header["__metadata__"]["dss"]) == {"v": "DSSST1", "tree": ["d", [["payload", ["t", "payload"]]]]}
    assert header["payload"] == {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}
    assert data == b"abc"


def test_encode_scalar_and_root_tensor_use_scalar_flag_and_root_key():
    header, data = split_header(wire.encode(torch.tensor(2.5, dtype=torch.float64)))
    assert json.loads(header["__metadata__"]["dss"])["tree"] == ["t", "__root__", {"scalar": True}]
    assert header["__root__"] == {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}
    assert data == struct.pack("<d", 2.5)


def test_encode_omits_empty_op_metadata():
    header, _ = split_header(wire.encode({"a": 1}, op_metadata={}))
    assert set(header["__metadata__"]) == {"dss"}


# --- strict header reader ----------------------------------------------------------------------
def _entry(dtype="F32", shape=(2,), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\x01\x00", "frame is 2 bytes; a DSSST1 frame starts with an 8-byte header length"),
        (struct.pack("<Q", 0), "header length 0 is outside 1..67108864 bytes"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "header length 67108865 is outside 1..67108864 bytes"),
        (struct.pack("<Q", 64) + b"{}", "header length 64 runs past the end of a 10-byte frame"),
        (b'{"prompts": [[1, 2, 3]]}', "the body is JSON text (b'{\"prompts\": [[1, 2, 3]]}'...), not a DSSST1 frame"),
        (join_header(b"\xff\xfe{}", b""), "header is not valid UTF-8 (invalid start byte at byte 0)"),
        (join_header("{not json", b""), "header is not valid JSON (Expecting property name enclosed in double quotes"),
        (join_header("[1, 2]", b""), "header must be a JSON object; got list"),
        (join_header("[" + "9" * 5000 + "]", b""), "header is not valid JSON (Exceeds the limit (4300 digits)"),
        (join_header({"__metadata__": []}, b""), "__metadata__ must be an object of strings; got list"),
        (join_header({"__metadata__": {"dss": 1}}, b""), "__metadata__['dss'] must be a string; got int"),
        (join_header({"x": {"dtype": "F32"}}, b""), "tensor 'x': entry must have exactly dtype, shape, data_offsets"),
        (join_header({"x": {**_entry(), "extra": 1}}, bytes(8)), "tensor 'x': entry must have exactly dtype"),
        (join_header({"x": _entry(dtype="C64")}, bytes(8)), "tensor 'x': unknown dtype 'C64'; known: BOOL, U8"),
        (join_header({"x": _entry(shape=(-2,))}, bytes(8)), "tensor 'x': shape must be a list of non-negative ints"),
        (join_header({"x": _entry(shape=(True,))}, bytes(8)), "tensor 'x': shape must be a list of non-negative ints"),
        (
            join_header({"x": _entry(shape=(0, 2**40, 2**40))}, b""),
            "tensor 'x': shape [0, 1099511627776, 1099511627776] overflows 64-bit sizes",
        ),
        (join_header({"x": _entry(offsets=(0,))}, bytes(8)), "tensor 'x': data_offsets must be [begin, end] ints"),
        (join_header({"x": _entry(offsets=(8, 0))}, bytes(8)), "tensor 'x': data_offsets [8, 0] end before they begin"),
        (
            join_header({"x": _entry(offsets=(0, 4))}, bytes(4)),
            "tensor 'x': data_offsets span 4 bytes but F32[2] needs 8",
        ),
        (join_header({"x": _entry(offsets=(4, 12))}, bytes(12)), "tensor 'x': data_offsets begin at 4 leaving a gap"),
        (
            join_header({"x": _entry(), "y": _entry(offsets=(4, 12))}, bytes(12)),
            "tensor 'y': data_offsets begin at 4 leaving an overlap after offset 8",
        ),
        (join_header({"x": _entry()}, bytes(9)), "data region is 9 bytes but the tensors cover 8; trailing or missing"),
        (join_header({"x": _entry()}, bytes(7)), "data region is 7 bytes but the tensors cover 8"),
        (
            join_header('{"x":' + json.dumps(_entry()) + ',"x":' + json.dumps(_entry()) + "}", bytes(8)),
            "duplicate JSON key 'x'; tensor names and object keys must be unique",
        ),
    ],
)
def test_read_header_rejects_invalid_container(frame, message):
    with pytest.raises(FrameFormatError) as caught:
        read_header(frame)
    assert str(caught.value).startswith(message)


def test_read_header_rejects_non_buffer_input():
    with pytest.raises(FrameFormatError, match="a frame must be bytes, bytearray or memoryview; got str"):
        read_header("not bytes")


def test_read_header_accepts_unpadded_header_and_reports_absolute_offsets():
    frame = join_header({"x": _entry()}, bytes(8), pad=False)
    header = read_header(frame)
    assert header.data_start == len(frame) - 8
    assert (header.tensors["x"].begin, header.tensors["x"].end) == (len(frame) - 8, len(frame))


# --- legacy formats ------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_decode_refuses_pickle(protocol):
    with pytest.raises(LegacyPickleError, match="refusing pickle bytes"):
        wire.decode(pickle.dumps({"a": [1, 2]}, protocol=protocol))


def test_decode_refuses_torch_save_zip():
    buffer = io.BytesIO()
    torch.save({"a": torch.ones(2)}, buffer)
    with pytest.raises(LegacyPickleError, match=r"refusing zip / torch.save bytes"):
        wire.decode(buffer.getvalue())


def test_decode_accepts_valid_frame_whose_length_prefix_looks_like_pickle():
    """A 640-byte header encodes as 80 02 00..., the pickle-2 magic; magic is sniffed only after a failure."""
    value = {"text": "x"}
    for pad in range(0, 700):
        frame = wire.encode({**value, "pad": "y" * pad})
        if frame[:2] == b"\x80\x02":
            break
    else:
        pytest.fail("no padding produced a 640-byte header")
    assert wire.decode(frame)["pad"] == "y" * pad


def test_legacy_error_is_a_wire_error():
    assert issubclass(LegacyPickleError, WireError)
