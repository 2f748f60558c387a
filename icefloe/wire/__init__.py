"""DSSST1: the wire format of every tensor that crosses a process boundary.

A frame is one safetensors blob whose ``__metadata__`` carries the structure tree (``dss``) and
optional operation metadata (``op``); see ``docs/wire.md`` and the training API reference §2.

* ``frames``  — the strict safetensors reader and the copy-light writer.
* ``tensors`` — torch/numpy tensors ↔ bytes; torch is imported only when needed.
* ``tree``    — ``encode`` / ``decode`` / ``read_metadata``. Dict keys containing ``.`` are
  ESCAPED in tensor keys (``%2E``), never refused; see that module's docstring.
* ``chunks``  — byte chunking, ``result_chunk`` events and the inline result envelope.

Every failure raises a :class:`icefloe.protocol.WireError` subclass naming the offender.
"""

from icefloe.wire.chunks import (
    CHUNK_OVERHEAD_BYTES,
    MAX_POST_BYTES,
    chunk_descriptor,
    chunk_payload,
    decode_inline_result,
    inline_result,
    join_chunks,
    join_payloads,
    join_result_events,
    result_chunk_events,
    split_frame,
)
from icefloe.wire.frames import FrameHeader, TensorSpec, read_header
from icefloe.wire.tree import WIRE_VERSION, decode, encode, read_metadata

__all__ = [
    "CHUNK_OVERHEAD_BYTES",
    "MAX_POST_BYTES",
    "WIRE_VERSION",
    "FrameHeader",
    "TensorSpec",
    "chunk_descriptor",
    "chunk_payload",
    "decode",
    "decode_inline_result",
    "encode",
    "inline_result",
    "join_chunks",
    "join_payloads",
    "join_result_events",
    "read_header",
    "read_metadata",
    "result_chunk_events",
    "split_frame",
]
