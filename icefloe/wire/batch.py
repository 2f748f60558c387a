"""The envelope of the ``batch_requests`` extension: several HTTP requests (or answers) in one body.

A 4-byte big-endian length, that many bytes of a JSON list describing the parts (a request part:
``method``, ``path``, ``query``, ``headers``; an answer part: ``status``, ``headers``; each with
its body's ``size``), then the bodies back to back. docs/service.md has the contract.
"""

from __future__ import annotations

import json
import struct
from typing import Any

__all__ = ["BATCH_MEDIA_TYPE", "BATCH_PATH", "head_size", "pack", "unpack"]

BATCH_PATH = "/requests:batch"  # after the API prefix
BATCH_MEDIA_TYPE = "application/x-icefloe-batch"
_LENGTH = struct.Struct(">I")


def pack(parts: list[dict[str, Any]], bodies: list[bytes]) -> bytes:
    """The envelope holding ``parts`` (each gets its body's ``size``) and ``bodies``."""
    described = [{**part, "size": len(body)} for part, body in zip(parts, bodies, strict=True)]
    head = json.dumps(described, separators=(",", ":")).encode()
    return b"".join([_LENGTH.pack(len(head)), head, *bodies])


def head_size(envelope: bytes) -> int:
    """The byte length of the part list an envelope (at least its first 4 bytes) declares."""
    return _LENGTH.unpack_from(envelope)[0]


def unpack(envelope: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """``(part, body)`` pairs of an envelope; ValueError names what is malformed."""
    if len(envelope) < _LENGTH.size:
        raise ValueError("the envelope is shorter than its 4-byte header length")
    (head_size,) = _LENGTH.unpack_from(envelope)
    start = _LENGTH.size + head_size
    try:
        parts = json.loads(envelope[_LENGTH.size : start])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the envelope's part list is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError("the envelope's part list nests too deeply; send a flat list of objects") from None
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("size"), int) for p in parts):
        raise ValueError("the envelope's part list must be a list of objects, each with an integer 'size'")
    out = []
    for part in parts:
        end = start + part["size"]
        if part["size"] < 0 or end > len(envelope):
            raise ValueError("the envelope's bodies are shorter than the sizes its parts declare")
        out.append((part, envelope[start:end]))
        start = end
    if start != len(envelope):
        raise ValueError(f"the envelope has {len(envelope) - start} bytes after its last part")
    return out
