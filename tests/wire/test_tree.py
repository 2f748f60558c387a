"""encode/decode round trips (hypothesis), dotted-key escaping, tree validation and lenient metadata."""

from __future__ import annotations

import array
import json
import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from icefloe import wire
from icefloe.protocol import FrameFormatError

from .support import TORCH_DTYPES, assert_same, join_header, split_header

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.float16, np.int32, np.uint32, np.float32,
                np.float64, np.int64, np.uint64]  # fmt: skip


def _random_bytes(seed: int, count: int, boolean: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2 if boolean else 256, count, dtype=np.uint8)


@st.composite
def torch_tensors(draw) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs included) in any dtype; 0-dim, empty, transposed or strided."""
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    stored = list(reversed(shape)) if layout == "transposed" else list(shape)
    if layout == "strided" and stored:
        stored[-1] *= 2
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = _random_bytes(draw(st.integers(0, 2**32 - 1)), math.prod(stored) * itemsize, dtype == torch.bool)
    tensor = torch.from_numpy(raw).view(dtype).reshape(stored) if raw.size else torch.empty(stored, dtype=dtype)
    if layout == "transposed" and len(shape) > 1:
        tensor = tensor.permute(*reversed(range(len(shape))))
    elif layout == "strided" and shape:
        tensor = tensor[..., ::2]
    return tensor


@st.composite
def numpy_arrays(draw) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    raw = _random_bytes(draw(st.integers(0, 2**32 - 1)), math.prod(shape) * dtype.itemsize, dtype == np.bool_)
    array = raw.view(dtype).reshape(shape)
    return array.T if draw(st.booleans()) else array


_KEYS = st.text(max_size=4) | st.sampled_from(
    ["a.b", "a", "b", ".", "%2E", "__metadata__", "__dss_empty__", "__root__"]
)
_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=6)
    | torch_tensors()
)


def _nested(leaves) -> st.SearchStrategy:
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=3)
            | st.lists(children, max_size=3).map(tuple)
            | st.dictionaries(_KEYS, children, max_size=3)
        ),
        max_leaves=8,
    )


# --- round trips -------------------------------------------------------------------------------
@_SETTINGS
@given(_nested(_LEAVES))
def test_encode_decode_round_trips_nested_values_and_torch_tensors(value):
    frame = wire.encode(value)
    assert_same(value, wire.decode(frame))
    assert_same(value, wire.decode(bytearray(frame)))


@_SETTINGS
@given(_nested(st.none() | st.integers(-5, 5) | st.text(max_size=3) | numpy_arrays()))
def test_encode_decode_round_trips_numpy_arrays(value):
    assert_same(value, wire.decode(wire.encode(value), tensors="numpy"))


@_SETTINGS
@given(torch_tensors())
def test_decode_numpy_widens_bfloat16_and_float8_to_exact_float32(tensor):
    decoded = wire.decode(wire.encode({"x": tensor}), tensors="numpy")["x"]
    if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        assert decoded.dtype == np.float32
        np.testing.assert_array_equal(decoded, tensor.float().numpy())
    else:
        assert decoded.tobytes() == tensor.contiguous().numpy().tobytes()


def test_decode_from_bytearray_views_the_buffer_and_from_bytes_copies():
    frame = wire.encode({"x": torch.arange(4, dtype=torch.int64)})
    writable = bytearray(frame)
    view = wire.decode(writable)["x"]
    view[0] = 7  # writes through to the caller's buffer
    assert wire.decode(bytes(writable))["x"].tolist() == [7, 1, 2, 3]

    copied = wire.decode(frame)["x"]
    copied[0] = 9
    assert wire.decode(frame)["x"].tolist() == [0, 1, 2, 3]


def test_decode_copies_misaligned_tensors_from_unpadded_frames():
    """A foreign writer may skip header padding; an int64 at an odd address must still decode right."""
    frame = wire.encode({"x": torch.arange(3, dtype=torch.int64)})
    header, data = split_header(frame)
    odd = join_header(json.dumps(header, separators=(",", ":")) + " ", data, pad=False)
    assert len(odd) % 8 != 0
    assert wire.decode(bytearray(odd))["x"].tolist() == [0, 1, 2]


def test_encode_accepts_grad_and_big_endian_inputs():
    weights = torch.ones(2, requires_grad=True)
    big_endian = np.arange(3, dtype=">i4")
    decoded = wire.decode(wire.encode({"w": weights * 2, "b": big_endian}))
    assert decoded["w"].tolist() == [2.0, 2.0] and not decoded["w"].requires_grad
    assert decoded["b"].dtype == torch.int32 and decoded["b"].tolist() == [0, 1, 2]


def test_encode_keeps_tuples_inside_tensor_free_containers():
    value = {"config": {"pair": (1, 2)}, "rows": [[(3,)]]}
    assert wire.decode(wire.encode(value)) == value
    assert isinstance(wire.decode(wire.encode(value))["rows"][0][0], tuple)


# --- dotted keys are escaped ------------------------------------------------------------------
def test_encode_escapes_dotted_keys_so_they_never_collide_with_nested_paths():
    value = {"a.b": torch.tensor([1]), "a": {"b": torch.tensor([2])}, "p%2E": torch.tensor([3])}
    frame = wire.encode(value)
    header, _ = split_header(frame)
    assert sorted(name for name in header if name != "__metadata__") == ["a%2Eb", "a.b", "p%252E"]
    assert_same(value, wire.decode(frame))


def test_encode_escapes_reserved_top_level_tensor_names():
    value = {"__metadata__": torch.tensor([1]), "__dss_empty__": torch.tensor([2], dtype=torch.uint8)}
    header, _ = split_header(wire.encode(value))
    assert sorted(name for name in header if name != "__metadata__") == ["%5F_dss_empty__", "%5F_metadata__"]
    assert_same(value, wire.decode(wire.encode(value)))


# --- encode refusals ---------------------------------------------------------------------------
def _cycle() -> list:
    loop: list = []
    loop.append(loop)
    return loop


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({1: torch.ones(1)}, "dict key 1 at the root is int; the wire needs str keys"),
        ({"a": {(1, 2): 3}}, "dict key (1, 2) at 'a' is tuple; the wire needs str keys"),
        ({"a": {1, 2}}, "value at 'a' is builtins.set; the wire carries only dict/list/tuple"),
        ({"a": b"raw"}, "value at 'a' is builtins.bytes"),
        ({"n": np.int64(3)}, "value at 'n' is numpy.int64"),
        ({"c": torch.ones(2, dtype=torch.complex64)}, "tensor 'c': dtype torch.complex64 has no DSSST1 code"),
        ({"c": np.ones(2, dtype=np.complex64)}, "tensor 'c': numpy dtype complex64 has no DSSST1 code"),
        ({"m": np.ma.masked_array([1, 2], mask=[0, 1])}, "tensor 'm': masked arrays would lose their mask"),
        ({"s": torch.eye(2).to_sparse()}, "tensor 's': layout torch.sparse_coo is not supported"),
        ({"meta": torch.empty(2, device="meta")}, "tensor 'meta' is on the meta device"),
        (_cycle(), "value at '0.0.0.0"),
    ],
)
def test_encode_refuses_what_the_wire_cannot_carry(value, message):
    with pytest.raises(FrameFormatError) as caught:
        wire.encode(value)
    assert str(caught.value).startswith(message)


def test_encode_refuses_non_dict_op_metadata():
    with pytest.raises(FrameFormatError, match="op_metadata must be a dict; got list"):
        wire.encode({}, op_metadata=["x"])


# --- decode refusals ---------------------------------------------------------------------------
def _frame(tree, tensors=None, dss_extra=None, version="DSSST1") -> bytes:
    """A frame with a hand-written tree; ``tensors`` maps name → (dtype, shape, bytes)."""
    tensors = tensors if tensors is not None else {"x": ("F32", [1], bytes(4))}
    dss = {"v": version, "tree": tree, **(dss_extra or {})}
    header: dict = {"__metadata__": {"dss": json.dumps(dss)}}
    data = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    return join_header(header, data)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (
            join_header({"x": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}, b"\x00"),
            "frame has no __metadata__",
        ),
        (_frame(["t", "x"], version="DSSST2"), "__metadata__['dss'].v is 'DSSST2'; this reader speaks 'DSSST1'"),
        (_frame(["t", "x"], dss_extra={"extra": 1}), "__metadata__['dss'] must be an object with exactly v and tree"),
        (_frame(["q", "x"]), "tree node tree has unknown tag 'q'; expected one of t, d, l, u, j"),
        (_frame([["t"], "x"]), "tree node tree has unknown tag ['t']"),
        (_frame([]), "tree node tree has unknown tag []"),
        (_frame(["t", 3]), "tree node tree must be ['t', key] or ['t', key, options]"),
        (_frame(["t", "x", {"scalar": "yes"}]), "tree node tree options must be {'scalar': bool}"),
        (
            _frame(["t", "x", {"scalar": True}], {"x": ("F32", [2], bytes(8))}),
            "tensor 'x' is marked scalar but has shape [2]",
        ),
        (_frame(["t", "y"]), "tree references tensor 'y', which the frame does not contain"),
        (_frame(["l", [["t", "x"], ["t", "x"]]]), "tree references tensor 'x' twice (again at tree[1])"),
        (_frame(["j", 1]), "frame holds tensors the tree never references: ['x']"),
        (_frame(["d", [["a", ["t", "x"]], ["a", ["j", 1]]]]), "tree node tree repeats dict key 'a'"),
        (_frame(["d", [["a"]]]), "tree node tree item 0 must be [str key, node]"),
        (_frame(["d", {"a": 1}]), "tree node tree ('d') must hold a list; got dict"),
        (_frame(["l", [["t", "x"]], 3]), "tree node tree ('l') must have 2 elements; got 3"),
        (_frame(["t", "x"], {"x": ("BOOL", [2], b"\x01\x02")}), "tensor 'x': BOOL bytes must be 0 or 1; found 2"),
        (
            _frame(["j", 1], {"__dss_empty__": ("U8", [2], b"\x00\x00")}),
            "frame holds tensors the tree never references",
        ),
    ],
)
def test_decode_rejects_invalid_tree(frame, message):
    with pytest.raises(FrameFormatError) as caught:
        wire.decode(frame)
    assert str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("dss_text", "message"),
    [
        ("not json", "__metadata__['dss'] is not valid JSON (Expecting value at char 0)"),
        ('{"v": "DSSST1", "tree": ["j", {"a": 1, "a": 2}]}', "duplicate JSON key 'a'"),
        ("[1]", "__metadata__['dss'] must be an object with exactly v and tree; got list"),
    ],
)
def test_decode_rejects_malformed_dss_metadata(dss_text, message):
    frame = join_header({"__metadata__": {"dss": dss_text}}, b"")
    with pytest.raises(FrameFormatError) as caught:
        wire.decode(frame)
    assert str(caught.value).startswith(message)


def test_decode_rejects_trees_nested_deeper_than_the_limit():
    tree: list = ["t", "x"]
    for _ in range(wire.tree.MAX_DEPTH + 1):
        tree = ["l", [tree]]
    with pytest.raises(FrameFormatError, match="nests deeper than 128 levels"):
        wire.decode(_frame(tree))


def test_decode_rejects_unknown_tensors_kind():
    with pytest.raises(FrameFormatError, match="tensors must be 'torch' or 'numpy'; got 'jax'"):
        wire.decode(wire.encode({}), tensors="jax")


def test_decode_accepts_frames_without_placeholder_and_drops_placeholder():
    assert wire.decode(_frame(["j", {"a": 1}], {})) == {"a": 1}
    assert wire.decode(_frame(["u", []], {"__dss_empty__": ("U8", [1], b"\x00")})) == ()


# --- read_metadata -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "frame",
    [b"", b"garbage", b"\x80\x04junk", _frame(["j", 1], {}), 12],
)
def test_read_metadata_is_lenient_on_garbage(frame):
    assert wire.read_metadata(frame) == {}


@pytest.mark.parametrize("op_text", ["not json", "[1, 2]", '"text"', "[" * 5000])
def test_read_metadata_returns_empty_for_non_object_op(op_text):
    header = {"__metadata__": {"dss": json.dumps({"v": "DSSST1", "tree": ["j", 1]}), "op": op_text}}
    assert wire.read_metadata(join_header(header, b"")) == {}


def test_read_metadata_returns_op_without_decoding_tensors():
    frame = wire.encode({"x": torch.ones(3)}, op_metadata={"router_replay": {"k": [1]}})
    assert wire.read_metadata(frame) == {"router_replay": {"k": [1]}}


# --- light install -----------------------------------------------------------------------------
def test_wire_works_without_torch_installed():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, as on a light install
        import numpy as np
        from icefloe import wire
        frame = wire.encode({"ids": np.arange(4), "flag": True, "pair": (1, 2)}, op_metadata={"k": 1})
        value = wire.decode(frame)
        assert isinstance(value["ids"], np.ndarray) and value["ids"].tolist() == [0, 1, 2, 3], value
        assert value["pair"] == (1, 2) and wire.read_metadata(frame) == {"k": 1}
        chunks = wire.split_frame(frame, max_bytes=8200, force=True)
        assert wire.join_chunks(chunks) == frame
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_wire_all_is_sorted_and_complete():
    # ruff's RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical.
    assert wire.__all__ == sorted(wire.__all__, key=lambda name: (not name.isupper(), not name[0].isupper(), name))
    assert {
        "encode", "decode", "read_metadata", "read_header", "split_frame", "join_chunks", "chunk_descriptor",
        "chunk_payload", "result_chunk_events", "join_result_events", "inline_result", "decode_inline_result",
        "MAX_POST_BYTES", "CHUNK_OVERHEAD_BYTES", "WIRE_VERSION",
    } <= set(wire.__all__)  # fmt: skip
    assert (wire.MAX_POST_BYTES, wire.CHUNK_OVERHEAD_BYTES, wire.WIRE_VERSION) == (62_914_560, 8192, "DSSST1")


# --- a large tree's plain values ---------------------------------------------------------------
def _long_prompts() -> dict:
    """Token-id prompts whose tree is over 64 KiB, beside strings that hold brackets, quotes and escapes."""
    ids = np.random.default_rng(0).integers(1000, 50_000, size=(16, 2048))
    return {"prompts": ids.tolist(), "a": ['a "quoted" \\ line\nand \U0001f600', "[1, 2]", "\\[3]"], "b": [0.5, 1e-3]}


def test_decode_dense_reads_a_large_trees_arrays_of_numbers_as_machine_numbers():
    value = _long_prompts()
    frame = wire.encode(value)
    decoded = wire.decode(frame, dense=True)
    assert [type(p) for p in decoded["prompts"]] == [array.array] * 16 and decoded["prompts"][0].typecode == "i"
    assert [p.tolist() for p in decoded["prompts"]] == value["prompts"]
    assert decoded["a"] == value["a"] and decoded["b"] == array.array("d", value["b"])
    assert wire.decode(frame) == value  # lists unless asked


def test_decode_dense_keeps_the_strict_duplicate_key_check_of_a_large_tree():
    frame = wire.encode(_long_prompts())
    doubled = frame.replace(b'\\"b\\": [', b'\\"a\\": [', 1)
    assert doubled != frame
    for dense in (True, False):
        with pytest.raises(FrameFormatError, match="duplicate JSON key 'a'"):
            wire.decode(doubled, dense=dense)


def test_a_large_header_keeps_its_duplicate_tensor_names_refused():
    frame = wire.encode({"x": torch.zeros(2), "y": torch.ones(2), "prompts": _long_prompts()["prompts"]})
    with pytest.raises(FrameFormatError, match="duplicate JSON key 'x'"):
        wire.decode(frame.replace(b'"y":{"dtype"', b'"x":{"dtype"', 1), dense=True)
