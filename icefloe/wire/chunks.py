"""Byte chunking of DSSST1 frames, ``result_chunk`` events and the inline result envelope.

A frame too large for one POST (or one poll response) is cut into byte ranges; each range travels
as its own DSSST1 frame ``{"payload": uint8[n]}`` whose ``op`` metadata holds a descriptor under
``request_chunk`` or ``result_chunk``: ``chunk_idx``, ``total_chunks``, ``frame_sha256`` and
``frame_size_bytes`` of the whole frame, plus ``chunk_group_id`` (request kind, a UUID4 unless the
caller gives one) and an optional ``operation`` label. Joining accepts chunks in any order, checks
every descriptor against the first, every index exactly once, then the joined size and SHA-256.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import re
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal

import numpy as np

from icefloe.protocol import (
    ChunkDigestError,
    ChunkError,
    ChunkIndexError,
    ChunkMismatchError,
    FrameFormatError,
)
from icefloe.wire.frames import FrameHeader, as_byte_view, read_header
from icefloe.wire.tree import WIRE_VERSION, decode, encode, parse_op, read_metadata

__all__ = [
    "CHUNK_OVERHEAD_BYTES",
    "MAX_POST_BYTES",
    "ChunkKind",
    "b64decode",
    "chunk_descriptor",
    "chunk_payload",
    "decode_inline_result",
    "inline_result",
    "join_chunks",
    "join_payloads",
    "join_result_events",
    "result_chunk_events",
    "split_frame",
]

ChunkKind = Literal["request", "result"]

# The training API's per-request body cap (60 MiB).
MAX_POST_BYTES: Final = 62_914_560
# Room left in each chunk POST for the chunk frame's own header and length prefix.
CHUNK_OVERHEAD_BYTES: Final = 8192
_METADATA_KEYS: Final[dict[str, str]] = {"request": "request_chunk", "result": "result_chunk"}
_REQUIRED_FIELDS: Final = ("chunk_idx", "total_chunks", "frame_sha256", "frame_size_bytes")
_OPTIONAL_FIELDS: Final = ("chunk_group_id", "operation")
_SHARED_FIELDS: Final = ("total_chunks", "frame_sha256", "frame_size_bytes", "chunk_group_id", "operation")
_SHA256_HEX: Final = re.compile(r"[0-9a-f]{64}")
_OCTET_STREAM: Final = "application/octet-stream"


# --- splitting ---------------------------------------------------------------------------------
def split_frame(
    frame: bytes | bytearray | memoryview,
    *,
    max_bytes: int,
    kind: ChunkKind = "request",
    chunk_group_id: str | None = None,
    operation: str | None = None,
    force: bool = False,
) -> list[bytes]:
    """Cut ``frame`` into chunk frames of at most ``max_bytes`` each.

    Without ``force``, a frame that fits (or ``max_bytes <= 0``) comes back alone and unwrapped.
    With ``force``, even one chunk is wrapped (``max_bytes <= 0``: one chunk holding everything).
    Each payload starts at ``max_bytes - CHUNK_OVERHEAD_BYTES`` and halves until every chunk fits.

    Raises:
        ChunkError: bad ``kind``/``chunk_group_id``/``operation``, or ``max_bytes`` too small for any chunk.
    """
    metadata_key = _metadata_key(kind)
    if kind == "result" and chunk_group_id is not None:
        raise ChunkError("chunk_group_id is only for request chunks; result chunks carry none")
    for field, value in (("chunk_group_id", chunk_group_id), ("operation", operation)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ChunkError(f"{field} must be a non-empty str; got {value!r}")
    view = as_byte_view(frame)
    if not force and (max_bytes <= 0 or len(view) <= max_bytes):
        return [frame if isinstance(frame, bytes) else bytes(view)]
    descriptor: dict[str, Any] = {
        "frame_sha256": hashlib.sha256(view).hexdigest(),
        "frame_size_bytes": len(view),
    }
    if kind == "request":
        descriptor["chunk_group_id"] = chunk_group_id or str(uuid.uuid4())
    if operation is not None:
        descriptor["operation"] = operation
    payload_size = max(1, max_bytes - CHUNK_OVERHEAD_BYTES) if max_bytes > 0 else max(1, len(view))
    while True:
        chunks = _build_chunks(view, payload_size, metadata_key, descriptor, max_bytes)
        if chunks is not None:
            return chunks
        if payload_size == 1:
            raise ChunkError(f"max_bytes={max_bytes} cannot hold a chunk frame even with a 1-byte payload")
        payload_size //= 2


def _build_chunks(
    view: memoryview, payload_size: int, metadata_key: str, descriptor: dict[str, Any], max_bytes: int
) -> list[bytes] | None:
    """All chunk frames for ``payload_size``, or None as soon as one exceeds ``max_bytes``."""
    total = max(1, -(-len(view) // payload_size))
    chunks = []
    for index in range(total):
        start = index * payload_size
        payload = np.frombuffer(view, dtype=np.uint8, count=min(payload_size, len(view) - start), offset=start)
        op = {metadata_key: {"chunk_idx": index, "total_chunks": total, **descriptor}}
        chunk = encode({"payload": payload}, op_metadata=op)
        if max_bytes > 0 and len(chunk) > max_bytes:
            return None
        chunks.append(chunk)
    return chunks


# --- descriptors -------------------------------------------------------------------------------
def chunk_descriptor(frame: object, header: FrameHeader | None = None) -> dict[str, Any] | None:
    """The chunk descriptor of ``frame`` plus ``"kind"``, or None when it carries no chunk metadata.

    ``header``: ``read_header(frame)``, when the caller has parsed it already.

    Raises:
        ChunkError / ChunkIndexError: chunk metadata is present but malformed.
    """
    return _descriptor_from_op(read_metadata(frame, header))


def chunk_payload(frame: bytes | bytearray | memoryview, header: FrameHeader | None = None) -> bytes:
    """The payload bytes carried by one chunk frame (strictly decoded; ``header`` as for :func:`chunk_descriptor`)."""
    descriptor = _strict_descriptor(frame, position=0, header=header)
    return _payload_array(frame, descriptor, header).tobytes()


def _strict_descriptor(frame: object, position: int, header: FrameHeader | None = None) -> dict[str, Any]:
    try:
        header = header or read_header(frame)
    except FrameFormatError as error:
        raise FrameFormatError(f"chunk frame at position {position}: {error}") from error
    descriptor = _descriptor_from_op(parse_op(header.metadata.get("op")))
    if descriptor is None:
        raise ChunkMismatchError(f"frame at position {position} carries no request_chunk/result_chunk metadata")
    return descriptor


def _descriptor_from_op(op: dict[str, Any]) -> dict[str, Any] | None:
    kinds = [kind for kind, key in _METADATA_KEYS.items() if key in op]
    if not kinds:
        return None
    if len(kinds) == 2:
        raise ChunkError("frame carries both request_chunk and result_chunk metadata; expected one")
    kind = kinds[0]
    raw = op[_METADATA_KEYS[kind]]
    if not isinstance(raw, dict):
        raise ChunkError(f"{_METADATA_KEYS[kind]} must be an object; got {type(raw).__name__}")
    return {**_check_descriptor(raw, kind), "kind": kind}


def _check_descriptor(raw: dict[str, Any], kind: str) -> dict[str, Any]:
    name = _METADATA_KEYS[kind]
    missing = [field for field in _REQUIRED_FIELDS if field not in raw]
    if kind == "request" and "chunk_group_id" not in raw:
        missing.append("chunk_group_id")
    unknown = sorted(set(raw) - set(_REQUIRED_FIELDS) - set(_OPTIONAL_FIELDS))
    if missing or unknown:
        raise ChunkError(f"{name} descriptor is missing {missing} / has unknown fields {unknown}")
    for field in ("chunk_idx", "frame_size_bytes"):
        if type(raw[field]) is not int or raw[field] < 0:
            raise ChunkError(f"{name}.{field} must be an int >= 0; got {raw[field]!r}")
    total = raw["total_chunks"]
    if type(total) is not int or total < 1:
        raise ChunkError(f"{name}.total_chunks must be an int >= 1; got {total!r}")
    if raw["chunk_idx"] >= total:
        raise ChunkIndexError(f"{name}.chunk_idx {raw['chunk_idx']} is out of range for total_chunks {total}")
    sha = raw["frame_sha256"]
    if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
        raise ChunkError(f"{name}.frame_sha256 must be 64 lowercase hex characters; got {sha!r:.80}")
    for field in _OPTIONAL_FIELDS:
        if field in raw and (not isinstance(raw[field], str) or not raw[field]):
            raise ChunkError(f"{name}.{field} must be a non-empty str; got {raw[field]!r:.80}")
    return dict(raw)


def _payload_array(frame: object, descriptor: dict[str, Any], header: FrameHeader | None = None) -> np.ndarray:
    index = descriptor["chunk_idx"]
    try:
        body = decode(frame, tensors="numpy", header=header)  # type: ignore[arg-type]
    except FrameFormatError as error:
        raise FrameFormatError(f"chunk {index}: {error}") from error
    payload = body.get("payload") if isinstance(body, dict) and set(body) == {"payload"} else None
    if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
        raise ChunkError(f"chunk {index}: body must be {{'payload': U8 1-D tensor}}")
    return payload


# --- joining -----------------------------------------------------------------------------------
def join_chunks(frames: Sequence[bytes | bytearray | memoryview], *, kind: ChunkKind = "request") -> bytes:
    """Reassemble chunk frames (any order) into the original frame; one plain frame passes through.

    Raises:
        ChunkMismatchError: kinds or shared descriptor fields disagree, or a frame is not a chunk.
        ChunkIndexError: an index is duplicated, missing or out of range.
        ChunkDigestError: the joined size or SHA-256 differs from the descriptor.
    """
    _metadata_key(kind)
    frames = list(frames)
    if not frames:
        raise ChunkIndexError("no frames to join")
    if len(frames) == 1 and chunk_descriptor(frames[0]) is None:
        return frames[0]  # type: ignore[return-value]
    descriptors = [_strict_descriptor(frame, position) for position, frame in enumerate(frames)]
    first = descriptors[0]
    for descriptor in descriptors:
        if descriptor["kind"] != kind:
            raise ChunkMismatchError(
                f"chunk {descriptor['chunk_idx']} is a {descriptor['kind']} chunk; expected {kind} chunks"
            )
        for field in _SHARED_FIELDS:
            if descriptor.get(field) != first.get(field):
                raise ChunkMismatchError(
                    f"chunk {descriptor['chunk_idx']} has {field}={descriptor.get(field)!r} but chunk "
                    f"{first['chunk_idx']} has {first.get(field)!r}"
                )
    by_index: dict[int, tuple[object, dict[str, Any]]] = {}
    for frame, descriptor in zip(frames, descriptors, strict=True):
        if descriptor["chunk_idx"] in by_index:
            raise ChunkIndexError(f"chunk {descriptor['chunk_idx']} appears more than once")
        by_index[descriptor["chunk_idx"]] = (frame, descriptor)
    total = first["total_chunks"]
    if len(by_index) != total:
        missing = list(itertools.islice((i for i in range(total) if i not in by_index), 10))
        raise ChunkIndexError(f"got {len(by_index)} of {total} chunks; missing indices {missing} (first 10)")
    return join_payloads([_payload_array(*by_index[index]) for index in range(total)], first)


def join_payloads(payloads: Sequence[bytes | np.ndarray], descriptor: dict[str, Any]) -> bytes:
    """The chunks' payloads, in index order, joined and checked against ``descriptor``'s size and SHA-256.

    Raises:
        ChunkDigestError: the joined size or SHA-256 differs from the descriptor.
    """
    size = sum(len(payload) for payload in payloads)
    if size != descriptor["frame_size_bytes"]:
        raise ChunkDigestError(
            f"joined chunks hold {size} bytes; descriptors announce {descriptor['frame_size_bytes']}"
        )
    joined = b"".join(payloads)
    digest = hashlib.sha256(joined).hexdigest()
    if digest != descriptor["frame_sha256"]:
        raise ChunkDigestError(f"joined frame has SHA-256 {digest}; descriptors announce {descriptor['frame_sha256']}")
    return joined


# --- result events and the inline envelope -----------------------------------------------------
def result_chunk_events(frame: bytes | bytearray | memoryview, *, max_bytes: int) -> list[dict[str, str]]:
    """``result_chunk`` events carrying ``frame`` (split when larger than ``max_bytes``)."""
    return [
        {
            "type": "result_chunk",
            "payload_b64": base64.b64encode(chunk).decode("ascii"),
            "payload_sha256": hashlib.sha256(chunk).hexdigest(),
        }
        for chunk in split_frame(frame, max_bytes=max_bytes, kind="result")
    ]


def join_result_events(events: Iterable[dict[str, Any]]) -> bytes:
    """Check each event's ``payload_sha256`` and reassemble the result frame (pass only result_chunk events).

    Raises:
        ChunkError: an event is not a well-formed ``result_chunk`` event.
        ChunkDigestError: a chunk's SHA-256 differs from its event's ``payload_sha256``.
    """
    frames = []
    for position, event in enumerate(events):
        if not isinstance(event, dict) or event.get("type") != "result_chunk":
            kind = event.get("type") if isinstance(event, dict) else type(event).__name__
            raise ChunkError(f"event {position} is {kind!r}, not a result_chunk event")
        chunk = b64decode(event.get("payload_b64"), f"event {position} payload_b64", ChunkError)
        expected = event.get("payload_sha256")
        if expected is not None:
            actual = hashlib.sha256(chunk).hexdigest()
            if expected != actual:
                raise ChunkDigestError(
                    f"event {position}: payload_sha256 is {expected!r:.80} but the chunk hashes to {actual}"
                )
        frames.append(chunk)
    return join_chunks(frames, kind="result")


def inline_result(obj: Any) -> dict[str, str]:
    """The inline DSSST1 result envelope of ``obj``.

    The training API's own clients decode only dict results; icefloe's decode any value.
    """
    return {
        "content_type": _OCTET_STREAM,
        "encoding": "base64",
        "wire_format": WIRE_VERSION,
        "payload_b64": base64.b64encode(encode(obj)).decode("ascii"),
    }


def decode_inline_result(envelope: dict[str, Any], *, tensors: str = "torch") -> Any:
    """Decode an inline DSSST1 result envelope back to its value.

    Raises:
        FrameFormatError: an envelope field is wrong (named), or the payload is not a DSSST1 frame.
    """
    if not isinstance(envelope, dict):
        raise FrameFormatError(f"inline result envelope must be a dict; got {type(envelope).__name__}")
    # content_type is checked only when present; encoding and wire_format are required.
    expected = {"encoding": "base64", "wire_format": WIRE_VERSION, "content_type": _OCTET_STREAM}
    for field, value in expected.items():
        if (field in envelope or field != "content_type") and envelope.get(field) != value:
            raise FrameFormatError(f"inline result {field} must be {value!r}; got {envelope.get(field)!r:.80}")
    frame = b64decode(envelope.get("payload_b64"), "inline result payload_b64", FrameFormatError)
    return decode(frame, tensors=tensors)


def b64decode(text: object, what: str, error_class: type[Exception]) -> bytes:
    """Strictly decode the base64 ``text``; ``error_class`` naming ``what`` if it is not base64."""
    if not isinstance(text, str):
        raise error_class(f"{what} must be a base64 str; got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise error_class(f"{what} is not valid base64") from None


def _metadata_key(kind: str) -> str:
    key = _METADATA_KEYS.get(kind)
    if key is None:
        raise ChunkError(f"kind must be 'request' or 'result'; got {kind!r}")
    return key
