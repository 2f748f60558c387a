"""The safetensors container under every DSSST1 frame: a strict reader and a copy-light writer.

Layout: ``[u64 little-endian N][N bytes of UTF-8 JSON header][data region]``. The header maps each
tensor name to ``{"dtype", "shape", "data_offsets"}`` (offsets relative to the data region) and may
hold ``"__metadata__": {str: str}``. The writer lays tensors out as the ``safetensors`` library does
(descending dtype order, hence descending element size; ties by name) and pads the header with
spaces to a multiple of 8, so for one metadata key its bytes equal the library's, the library reads
our frames and we read its frames.

The reader trusts nothing: it bounds the header length before reading it, checks every field's type,
and proves the offsets tile the data region exactly (contiguous from 0, each span equal to
shape × element size, no trailing bytes) before any tensor is built. Pickle and ``torch.save`` zip
bytes are recognised only after a parse fails, because a valid header length can begin ``80 02``.
A long metadata string (a DSSST1 tree of plain values) is not decoded with the header: it stays
:class:`EscapedText`, read where it is by the reader of the JSON it holds.
"""

from __future__ import annotations

import array
import json
import math
import re
import secrets
import struct
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from icefloe.protocol import FrameFormatError, LegacyPickleError
from icefloe.wire import dense_json

__all__ = [
    "DTYPE_SIZES",
    "MAX_HEADER_BYTES",
    "EscapedText",
    "FrameHeader",
    "TensorSpec",
    "as_byte_view",
    "parse_strict_json",
    "read_header",
    "strict_json_errors",
    "unique_pairs",
    "write_frame",
]

# Element size in bytes per safetensors dtype code (training API reference §2.1), in the library's dtype order.
DTYPE_SIZES: Final[dict[str, int]] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

# The safetensors library lays tensors out by this dtype order, descending, then by name; the table
# above is in that order, so larger elements come first and every tensor stays aligned.
_DTYPE_RANKS: Final[dict[str, int]] = {code: rank for rank, code in enumerate(DTYPE_SIZES)}
# DSSST1's own bound (the safetensors library allows 100 MB); checked before the header is read.
MAX_HEADER_BYTES: Final = 64 * 1024 * 1024
_LENGTH_PREFIX: Final = struct.Struct("<Q")
_METADATA_KEY: Final = "__metadata__"
_TENSOR_FIELDS: Final = frozenset({"dtype", "shape", "data_offsets"})
_MAX_DIMS: Final = 64  # numpy's bound on a shape's length
# A header string longer than this is kept as EscapedText: decoded with the header, a tree of plain values
# would cost the header's copy, its text and the string before its own JSON is read.
_LONG_STRING_BYTES: Final = 64 * 1024
_STRING: Final = re.compile(rb'"(?:[^"\\]++|\\.)*+"', re.DOTALL)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One header entry; ``begin``/``end`` are absolute offsets into the frame, not the data region."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class EscapedText:
    """A long metadata string as the header writes it (escaped, without its quotes): ``data[start:end]``."""

    data: bytes | bytearray
    start: int
    end: int

    def decoded(self) -> str:
        """The string itself (a copy of the text, then the string)."""
        return json.loads(b'"' + self.data[self.start : self.end] + b'"')


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A validated header: metadata strings (a long one as :class:`EscapedText`) and tensor specs in
    data-region order."""

    metadata: dict[str, str | EscapedText]
    tensors: dict[str, TensorSpec]
    data_start: int


def as_byte_view(data: object) -> memoryview:
    """A flat unsigned-byte view of ``data`` (bytes, bytearray, memoryview, any C-contiguous buffer)."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise FrameFormatError(f"a frame must be bytes, bytearray or memoryview; got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise FrameFormatError("a frame buffer must be C-contiguous; pass bytes(frame) instead")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def read_header(frame: object) -> FrameHeader:
    """Parse and fully validate a frame's header against the frame's length.

    Raises:
        LegacyPickleError: the bytes are pickle or a zip/``torch.save`` archive.
        FrameFormatError: anything else about the container is wrong; the message names the field.
    """
    view = as_byte_view(frame)
    try:
        return _read_header(view)
    except FrameFormatError as error:
        legacy = _legacy_kind(view)
        if legacy is not None:
            raise LegacyPickleError(
                f"refusing {legacy} bytes: the wire only accepts DSSST1 (safetensors) frames and never unpickles"
            ) from error
        if bytes(view[:1]) in (b"{", b"["):  # the commonest mistake: a JSON body where a frame belongs
            raise FrameFormatError(
                f"the body is JSON text ({bytes(view[:24])!r}...), not a DSSST1 frame: encode it as one "
                "(icefloe.wire.encode), whose first 8 bytes are its header's length"
            ) from error
        raise


def write_frame(metadata: dict[str, str], tensors: Sequence[tuple[str, str, Sequence[int], memoryview]]) -> bytes:
    """Serialise ``(name, dtype code, shape, raw little-endian bytes)`` tensors into one frame.

    The only copy is the final join; ``raw`` should be a flat byte view of a contiguous buffer.
    """
    ordered = sorted(tensors, key=lambda item: (-_DTYPE_RANKS[item[1]], item[0]))
    header: dict[str, Any] = {}
    if metadata:
        header[_METADATA_KEY] = metadata
    offset = 0
    for name, dtype, shape, raw in ordered:
        end = offset + raw.nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    header_bytes = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    parts: list[bytes | memoryview] = [_LENGTH_PREFIX.pack(len(header_bytes)), header_bytes]
    parts.extend(raw for _, _, _, raw in ordered)
    return b"".join(parts)


# --- reading -----------------------------------------------------------------------------------
def _read_header(view: memoryview) -> FrameHeader:
    if len(view) < _LENGTH_PREFIX.size:
        raise FrameFormatError(f"frame is {len(view)} bytes; a DSSST1 frame starts with an 8-byte header length")
    (header_len,) = _LENGTH_PREFIX.unpack_from(view, 0)
    if not 0 < header_len <= MAX_HEADER_BYTES:
        raise FrameFormatError(f"header length {header_len} is outside 1..{MAX_HEADER_BYTES} bytes")
    data_start = _LENGTH_PREFIX.size + header_len
    if data_start > len(view):
        raise FrameFormatError(f"header length {header_len} runs past the end of a {len(view)}-byte frame")
    raw_header = _parse_header(view, data_start)
    if not isinstance(raw_header, dict):
        raise FrameFormatError(f"header must be a JSON object; got {type(raw_header).__name__}")
    metadata = _check_metadata(raw_header.pop(_METADATA_KEY, {}))
    specs = [_check_entry(name, entry, data_start) for name, entry in raw_header.items()]
    specs.sort(key=lambda spec: (spec.begin, spec.end))
    _check_tiling(specs, data_start, len(view))
    return FrameHeader(metadata=metadata, tensors={spec.name: spec for spec in specs}, data_start=data_start)


def _parse_header(view: memoryview, data_start: int) -> Any:
    """The header's JSON, each string longer than ``_LONG_STRING_BYTES`` in a metadata value an
    :class:`EscapedText` of the frame's own bytes where they are ``bytes`` (no copy of the header)."""
    data, start = view.obj, _LENGTH_PREFIX.size
    if not isinstance(data, (bytes, bytearray)) or view.nbytes != len(data):
        data, start = bytes(view[start:data_start]), 0
    end = start + data_start - _LENGTH_PREFIX.size
    if end - start <= _LONG_STRING_BYTES:
        return _parse_json(bytes(data[start:end]), "header")
    prefix, long = secrets.token_hex(8) + ":", {}
    parts, at = [], start
    for match in _STRING.finditer(data, start, end):
        if match.end() - match.start() > _LONG_STRING_BYTES:
            placeholder = f"{prefix}{len(long)}"
            long[placeholder] = EscapedText(data, match.start() + 1, match.end() - 1)
            parts += (data[at : match.start()], json.dumps(placeholder).encode())
            at = match.end()
    parts.append(data[at:end])
    with strict_json_errors("header"):  # its arrays of numbers as array.array: a tensor's shape is checked as one
        header = dense_json.loads(b"".join(parts), pairs_hook=unique_pairs)
    return _with_long_strings(header, long)


def _with_long_strings(header: Any, long: dict[str, EscapedText]) -> Any:
    """``header`` with the placeholders of long strings put back: as EscapedText in a metadata value,
    decoded in a tensor name; anywhere else a header is refused whatever the string held."""
    if not long or not isinstance(header, dict):
        return header

    def name(key: str) -> str:
        return long[key].decoded() if key in long else key

    restored = unique_pairs([(name(key), value) for key, value in header.items()])
    metadata = restored.get(_METADATA_KEY)
    if isinstance(metadata, dict):
        restored[_METADATA_KEY] = unique_pairs([(name(key), _escaped(value, long)) for key, value in metadata.items()])
    return restored


def _escaped(value: Any, long: dict[str, EscapedText]) -> Any:
    return long.get(value, value) if isinstance(value, str) else value


def _parse_json(raw: bytes, what: str) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise FrameFormatError(f"{what} is not valid UTF-8 ({error.reason} at byte {error.start})") from None
    return parse_strict_json(text, what)


def parse_strict_json(text: str, what: str) -> Any:
    """Parse JSON refusing duplicate object keys; every failure is a FrameFormatError naming ``what``."""
    with strict_json_errors(what):
        return json.loads(text, object_pairs_hook=unique_pairs)


@contextmanager
def strict_json_errors(what: str) -> Iterator[None]:
    """Every failure of a strict JSON read inside as a FrameFormatError naming ``what``."""
    try:
        yield
    except json.JSONDecodeError as error:
        raise FrameFormatError(f"{what} is not valid JSON ({error.msg} at char {error.pos})") from None
    except FrameFormatError:  # a duplicate key, found by the pairs hook
        raise
    except UnicodeDecodeError as error:
        raise FrameFormatError(f"{what} is not valid UTF-8 ({error.reason})") from None
    except ValueError as error:  # e.g. an integer literal past Python's 4300-digit conversion limit
        raise FrameFormatError(f"{what} is not valid JSON ({str(error)[:80]})") from None
    except RecursionError:
        raise FrameFormatError(f"{what} JSON nests too deeply") from None


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's ``object_pairs_hook`` of a strict read: a FrameFormatError on a duplicate key."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise FrameFormatError(f"duplicate JSON key {key!r}; tensor names and object keys must be unique")
        result[key] = value
    return result


def _check_metadata(metadata: object) -> dict[str, str | EscapedText]:
    if not isinstance(metadata, dict):
        raise FrameFormatError(f"__metadata__ must be an object of strings; got {type(metadata).__name__}")
    for key, value in metadata.items():
        if not isinstance(value, (str, EscapedText)):
            raise FrameFormatError(f"__metadata__[{key!r}] must be a string; got {type(value).__name__}")
    return metadata


def _check_entry(name: str, entry: object, data_start: int) -> TensorSpec:
    if not isinstance(entry, dict) or set(entry) != _TENSOR_FIELDS:
        fields = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
        raise FrameFormatError(f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets; got {fields}")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise FrameFormatError(f"tensor {name!r}: unknown dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    shape = entry["shape"]
    if type(shape) is array.array and len(shape) <= _MAX_DIMS:
        shape = shape.tolist()
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(_is_count(dim) for dim in shape):
        raise FrameFormatError(
            f"tensor {name!r}: shape must be a list of non-negative ints, at most {_MAX_DIMS}; got {shape!r:.200}"
        )
    if math.prod(dim for dim in shape if dim) * DTYPE_SIZES[dtype] > sys.maxsize:
        # Even an empty tensor's extent must fit in 64 bits: torch and numpy compute strides from it.
        raise FrameFormatError(f"tensor {name!r}: shape {shape} overflows 64-bit sizes")
    offsets = entry["data_offsets"]
    if type(offsets) is array.array and len(offsets) == 2:
        offsets = offsets.tolist()
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise FrameFormatError(f"tensor {name!r}: data_offsets must be [begin, end] ints >= 0; got {offsets!r}")
    begin, end = offsets
    if begin > end:
        raise FrameFormatError(f"tensor {name!r}: data_offsets {offsets} end before they begin")
    expected = math.prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != expected:
        raise FrameFormatError(
            f"tensor {name!r}: data_offsets span {end - begin} bytes but {dtype}{shape} needs {expected}"
        )
    return TensorSpec(name=name, dtype=dtype, shape=tuple(shape), begin=data_start + begin, end=data_start + end)


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def _check_tiling(specs: list[TensorSpec], data_start: int, frame_len: int) -> None:
    """Offsets (already sorted) must cover the data region exactly once, from 0 to its end."""
    cursor = data_start
    for spec in specs:
        if spec.begin != cursor:
            gap_or_overlap = "a gap" if spec.begin > cursor else "an overlap"
            raise FrameFormatError(
                f"tensor {spec.name!r}: data_offsets begin at {spec.begin - data_start} leaving {gap_or_overlap} "
                f"after offset {cursor - data_start}; offsets must be contiguous from 0"
            )
        cursor = spec.end
    if cursor != frame_len:
        raise FrameFormatError(
            f"data region is {frame_len - data_start} bytes but the tensors cover {cursor - data_start}; "
            "trailing or missing bytes"
        )


def _legacy_kind(view: memoryview) -> str | None:
    head = bytes(view[:4])
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return "pickle"
    if head == b"PK\x03\x04":
        return "zip / torch.save"
    return None
