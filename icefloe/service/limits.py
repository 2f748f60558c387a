"""How much one request may make the service hold: every bound a body meets before it is parsed.

A body is refused from the cheapest evidence first: its ``Content-Length`` (or the bytes read so
far), then a length prefix it declares (a DSSST1 frame's header, a ``requests:batch`` head), then a
count of the JSON containers and strings it could build, taken with ``bytes.count`` before any object exists.
Only then is it parsed, off the event loop when it is large. Parsed Python objects cost ten to a
hundred times their JSON bytes, so counting before parsing is what keeps a small hostile body from
costing gigabytes; a large body's arrays of numbers are read as machine numbers instead
(:mod:`icefloe.wire.dense_json`). docs/service.md lists these bounds and the serve options that change them.

What waits after parsing (ops held behind a seq_id gap, stream events no poll drained) is bounded per
tenant by a :class:`TenantBytes`.
"""

from __future__ import annotations

import re
import struct
import threading
from collections.abc import Iterable

from icefloe.protocol import PayloadTooLargeError
from icefloe.wire.frames import MAX_HEADER_BYTES, read_header

__all__ = [
    "CHECK_ON_LOOP_BYTES",
    "MAX_BATCH_HEAD_BYTES",
    "MAX_BATCH_PARTS",
    "MAX_CREATE_JOB_BYTES",
    "MAX_FRAME_HEADER_BYTES",
    "MAX_JSON_BYTES",
    "MAX_JSON_CONTAINERS",
    "MAX_JSON_DEPTH",
    "MAX_JSON_STRINGS",
    "MAX_JSON_VALUES",
    "MAX_LISTED_ERRORS",
    "MAX_PROMPTS",
    "MAX_PROTO_FIELDS",
    "MAX_PROTO_OBJECTS",
    "MAX_STOPS",
    "MAX_SUB_JOBS",
    "MAX_TINKER_DATUMS",
    "SEQUENCE_WINDOW",
    "TenantBytes",
    "check_containers",
    "check_counts",
    "check_frame_header",
    "check_frame_header_length",
    "check_strings",
    "check_values",
    "truncated",
]

# Bodies larger than this are parsed and checked on a worker thread; smaller ones cost less than the hop.
CHECK_ON_LOOP_BYTES = 64 * 1024
# Parsing JSON holds the GIL however it is run (a 15 MB array of ints took 0.2 s), so a larger body
# would stall every request. Its text may cost four times its size once parsed (a string holding one
# character beyond the BMP takes 4 bytes a character; an array of one-digit numbers with one int64, 8 bytes
# a number): with the body itself and the parser's copy that stays within twice the service's 8 MiB floor.
MAX_JSON_BYTES = 2 * 1024 * 1024
# A create-job body is kept as the lists it stores (a float costs 32 bytes for the 4 of "0.5,"): a
# config of 64 sub-jobs takes a few tens of KiB.
MAX_CREATE_JOB_BYTES = 256 * 1024
# Containers nested deeper than this are refused. Real bodies nest fewer than ten; past a few
# hundred, pydantic's encoder fails (a 500), past about a thousand the parser itself does.
MAX_JSON_DEPTH = 64
# Objects plus arrays one JSON body (or a frame's header) may hold: a Tinker forward_backward of
# 1024 datums holds about ten per datum. Each costs about 100 bytes once parsed, for 2 to 3 bytes of JSON.
MAX_JSON_CONTAINERS = 65_536
# Strings (keys included) one JSON body may hold: 16,384 text prompts, or a Tinker forward_backward of 1024
# datums, hold a few tens of thousands. Each costs about 57 bytes once parsed, for the 5 of "ab",.
MAX_JSON_STRINGS = 65_536
# Values (numbers, true, false, null) one JSON body may hold outside arrays of plain numbers, which are read as
# machine numbers: each costs 24 to 32 bytes once parsed, for the 4 of "0.5,". An array of numbers with one
# string in it is such a list.
MAX_JSON_VALUES = 131_072
# A DSSST1 header lists tensors and the tree's plain values; tensors carry the bulk in the data region,
# but a generate's token-id prompts are plain values: 1024 prompts of 2048 tokens take about 13 MB.
MAX_FRAME_HEADER_BYTES = 16 * 1024 * 1024
MAX_BATCH_HEAD_BYTES = 1024 * 1024  # a requests:batch head: 256 parts' methods, paths and headers
MAX_BATCH_PARTS = 256
MAX_PROMPTS = 16_384  # prompts in one generate or generate-stream of the training API (a rollout batch)
MAX_SUB_JOBS = 64  # sub-job configs in one create-job
# A LoRA adapter's rank, in both APIs: an adapter joins a host other tenants train on, and its memory grows
# with its rank (r=20,000 on a tiny model took the shared engine process from 326 to 746 MiB).
MAX_LORA_RANK = 1024
# Stop strings or stop token ids of one Tinker sample: each is checked at every decode step of every sample.
MAX_STOPS = 1024
# A Tinker forward_backward's datums: the SDK sends at most 1024 in one request (its fwdbwd_max_chunk_len).
MAX_TINKER_DATUMS = 4096
# Messages, map entries (two each) and repeated values one protobuf body may hold, counted from its wire bytes
# before it is parsed: each costs 30 to 75 bytes once parsed, for as little as 2. A forward_backward of 4096
# datums with five loss inputs each holds about 94,000.
MAX_PROTO_OBJECTS = 131_072
# Fields of any kind in one protobuf body, each one step of the count that precedes parsing; the same
# 4096 datums hold about 139,000.
MAX_PROTO_FIELDS = 262_144
MAX_LISTED_ERRORS = 10  # a refusal names this many problems, then counts the rest
SEQUENCE_WINDOW = 10_000  # default of --sequence-window: how far past the next number a call may be

_FRAME_PREFIX = struct.Struct("<Q")
_FRAME_INSTEAD = "send the values as tensors, or split the batch into several requests"
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NUMBERS_ARRAY = re.compile(rb"\[[-+0-9.eENaInfity, \t\n\r]*\]")  # as icefloe.wire.dense_json finds them


def check_containers(raw: bytes, what: str, *, limit: int = MAX_JSON_CONTAINERS, instead: str = "") -> None:
    """:class:`PayloadTooLargeError` when JSON ``raw`` would build more than ``limit`` objects and arrays.

    ``bytes.count`` bounds the count from above without building anything; only a body over the
    bound by that count (brackets inside strings count too) is counted again with its strings blanked.
    ``instead``: what the caller may send instead.
    """
    found = raw.count(b"[") + raw.count(b"{")
    if found <= limit:
        return
    outside_strings = _JSON_STRING.sub(b'""', raw)
    found = outside_strings.count(b"[") + outside_strings.count(b"{")
    if found > limit:
        raise _too_many(found, "JSON arrays and objects", limit, what, instead)


def check_strings(raw: bytes, what: str, *, limit: int = MAX_JSON_STRINGS, instead: str = "") -> None:
    """:class:`PayloadTooLargeError` when JSON ``raw`` holds more than ``limit`` strings (keys included).

    Each string takes two quotes: ``bytes.count`` bounds the count from above (an escaped quote counts
    too), and only a body over the bound by that count is counted again, string by string.
    """
    if raw.count(b'"') <= 2 * limit:
        return
    found = _JSON_STRING.subn(b"", raw)[1]
    if found > limit:
        raise _too_many(found, "JSON strings", limit, what, instead)


def check_values(raw: bytes, what: str, *, limit: int = MAX_JSON_VALUES, instead: str = "") -> None:
    """:class:`PayloadTooLargeError` when JSON ``raw`` holds more than ``limit`` values outside arrays of plain
    numbers. Each takes a comma but the last of its container: ``bytes.count`` bounds the count from above,
    and only a body over the bound by that count is counted again with its strings and numeric arrays blanked."""
    if raw.count(b",") <= limit:
        return
    found = _NUMBERS_ARRAY.sub(b"[]", _JSON_STRING.sub(b'""', raw)).count(b",")
    if found > limit:
        raise _too_many(found, "JSON values outside arrays of plain numbers", limit, what, instead)


def _too_many(found: int, things: str, limit: int, what: str, instead: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"{what} holds {found} {things}; at most {limit} are accepted in one request: "
        f"{instead or 'split it into several requests, or send tensors as a DSSST1 frame'}"
    )


def check_counts(raw: bytes, what: str, *, instead: str = "") -> None:
    """Every bound of a JSON body's count of objects: its containers, strings and values. ``instead``: what
    the caller may send instead, in its API's terms."""
    check_containers(raw, what, instead=instead)
    check_strings(raw, what, instead=instead)
    check_values(raw, what, instead=instead)


def check_frame_header_length(prefix: bytes | memoryview, what: str = "DSSST1 frame") -> None:
    """:class:`PayloadTooLargeError` when a frame's first 8 bytes declare a header over :data:`MAX_FRAME_HEADER_BYTES`;
    the wire's own error when they declare more than any frame may (too short a prefix is left to the frame reader)."""
    if len(prefix) < _FRAME_PREFIX.size:
        return
    (declared,) = _FRAME_PREFIX.unpack_from(prefix)
    if declared > MAX_HEADER_BYTES:  # no frame at all (pickle, random bytes): the wire names what it is
        read_header(bytes(prefix))
    if declared > MAX_FRAME_HEADER_BYTES:
        raise PayloadTooLargeError(
            f"{what} declares a {declared}-byte header; a header is at most {MAX_FRAME_HEADER_BYTES} bytes here: "
            "send large values as tensors, or split the batch into several requests"
        )


def check_frame_header(frame: bytes) -> None:
    """Bound a whole DSSST1 frame's header before it is parsed: its declared length, and the containers,
    strings and values outside arrays of plain numbers its JSON (the tree's plain values included) would
    build, counted in ``frame`` itself (a copy of a 16 MiB header would cost as much as its tree).
    Brackets, quotes and commas inside the tree's strings count too, so the counts bound from above."""
    check_frame_header_length(frame[: _FRAME_PREFIX.size])
    if len(frame) < _FRAME_PREFIX.size:
        return
    (declared,) = _FRAME_PREFIX.unpack_from(frame)
    start, end, what = _FRAME_PREFIX.size, _FRAME_PREFIX.size + declared, "the DSSST1 frame's header"
    containers = frame.count(b"[", start, end) + frame.count(b"{", start, end)
    if containers > MAX_JSON_CONTAINERS:
        raise _too_many(containers, "JSON arrays and objects", MAX_JSON_CONTAINERS, what, _FRAME_INSTEAD)
    strings = frame.count(b'"', start, end) // 2
    if strings > MAX_JSON_STRINGS:
        raise _too_many(strings, "JSON strings", MAX_JSON_STRINGS, what, _FRAME_INSTEAD)
    values = frame.count(b",", start, end)
    if values > MAX_JSON_VALUES:  # the commas of the tree's arrays of plain numbers left out, still without a copy
        values -= sum(frame.count(b",", *match.span()) for match in _NUMBERS_ARRAY.finditer(frame, start, end))
        if values > MAX_JSON_VALUES:
            loose = "JSON values outside arrays of plain numbers"
            raise _too_many(values, loose, MAX_JSON_VALUES, what, _FRAME_INSTEAD)


def truncated(problems: Iterable[str], separator: str = "; ") -> str:
    """The first :data:`MAX_LISTED_ERRORS` problems joined, then ``... and N more``: a refusal stays small
    however many items of a body are wrong."""
    listed, more = [], 0
    for problem in problems:
        if len(listed) < MAX_LISTED_ERRORS:
            listed.append(problem)
        else:
            more += 1
    return separator.join(listed) + (f"{separator}... and {more} more" if more else "")


class TenantBytes:
    """Bytes of one kind of waiting work that each tenant holds, at most ``cap_bytes`` a tenant. A tenant
    holding nothing may always take one piece, however large, so work bigger than the cap still moves.
    Host workers take while the event loop gives back, hence the lock."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def take(self, tenant: str, size: int, *, force: bool = False) -> bool:
        """Count ``size`` bytes for ``tenant`` if they fit (``force``: whether or not); False, with
        nothing counted, when they do not."""
        with self._lock:
            held = self._held.get(tenant, 0)
            if held and held + size > self.cap_bytes and not force:
                return False
            self._held[tenant] = held + size
            return True

    def give(self, tenant: str, size: int) -> None:
        with self._lock:
            left = self._held.get(tenant, 0) - size
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)
