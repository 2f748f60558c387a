"""Request chunk groups of one job: reassembly with at-most-once execution.

A client splits a large (or, for forward-backward, every) frame into request chunks sharing a
``chunk_group_id``. Chunks are kept with the job, not the connection, so a client may retry any
POST. The group executes exactly once per (group id, frame hash): a replayed final chunk of a group
that already ran answers with the ORIGINAL ``{request_id, job_id}``. Refusals are the three
chunk-group 409s of the training API.

Memory is bounded twice: a group holds at most the ``frame_size_bytes`` it declared (a chunk
carrying more is a 400), and a tenant's jobs hold at most ``max_bytes`` of chunk payloads together.
To stay under that, the job's least recently sent other groups are dropped (their next chunk answers
``chunk_group_restart_required``); when the tenant's other jobs hold the rest, the chunk is a 429 (sent
again once their uploads finish); a group that alone exceeds it is a 413. Open groups are also
counted, so that empty chunks cannot pile up group records; that bound is far above what concurrent
clients keep open, so in practice only the byte cap drops a group.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from icefloe import wire
from icefloe.protocol import (
    ChunkGroupConflictError,
    ChunkGroupError,
    ChunkGroupMissingChunksError,
    ChunkGroupRestartError,
    InvalidRequestError,
    PayloadTooLargeError,
    TooManyRequestsError,
)

__all__ = ["ChunkGroups"]

_MAX_OPEN_GROUPS = 4096  # bounds the records of open groups (a chunk may be empty); the byte cap bounds payloads
_MAX_DONE_GROUPS = 4096
_MAX_FRAME_SIZE_BYTES = 64 * 1024**3  # 64 GiB: far above any real frame, small enough to refuse nonsense
_MAX_TOTAL_CHUNKS = 1_000_000
_MAX_LISTED_MISSING = 1000  # a missing-chunks refusal names at most this many; the retry then reveals the rest


@dataclass
class _Group:
    frame_sha256: str
    total_chunks: int
    frame_size_bytes: int
    payloads: dict[int, bytes] = field(default_factory=dict)  # chunk index -> its payload
    payload_digests: dict[int, str] = field(default_factory=dict)
    held_bytes: int = 0  # summed over the payloads held; at most frame_size_bytes
    response: dict[str, Any] | None = None  # once executed: what the final chunk answered


class ChunkGroups:
    """Open and finished chunk groups of one job; thread-safe, one group executes at a time."""

    def __init__(self, *, max_bytes: int, held_elsewhere: Callable[[], int] = lambda: 0) -> None:
        self.max_bytes = max_bytes  # chunk payloads held for the tenant's unfinished groups, at most
        self.held_elsewhere = held_elsewhere  # what the tenant's other jobs hold of it
        self._lock = threading.Lock()
        self._open: OrderedDict[str, _Group] = OrderedDict()  # least recently sent to first
        self._done: OrderedDict[str, _Group] = OrderedDict()
        self._held_bytes = 0

    @property
    def held_bytes(self) -> int:
        """Chunk payloads held now for this job's unfinished groups."""
        return self._held_bytes

    def accept(
        self, descriptor: dict[str, Any], payload: bytes, *, execute: Callable[[bytes], dict[str, Any]]
    ) -> dict[str, Any]:
        """Take one request chunk (its descriptor, as :func:`wire.chunk_descriptor` checked it, and its
        payload); on the final one join the group and ``execute`` the frame.

        Returns ``{"chunk_cached": True}`` for a non-final chunk, else what ``execute`` returned
        (``{request_id, job_id}``), or the original response when the group already ran.
        """
        group_id, index, total, sha, size = _descriptor_fields(descriptor)
        final = index == total - 1
        with self._lock:
            done = self._done.get(group_id)
            if done is not None:
                if done.frame_sha256 != sha or done.total_chunks != total:
                    raise _conflict(group_id, index, "was already executed with a different frame hash or chunk count")
                return dict(done.response) if final else {"chunk_cached": True}
            group = self._open.get(group_id)
            if group is None:
                if index != 0:
                    raise _refusal(
                        ChunkGroupRestartError,
                        f"chunk group {group_id} is unknown to this job; restart it from chunk 0",
                        chunk_group_id=group_id,
                        received_chunk=index,
                        expected_start_chunk=0,
                    )
                group = _Group(frame_sha256=sha, total_chunks=total, frame_size_bytes=size)
                self._open[group_id] = group
                while len(self._open) > _MAX_OPEN_GROUPS:
                    self._drop_oldest()
            elif (group.frame_sha256, group.total_chunks, group.frame_size_bytes) != (sha, total, size):
                raise _conflict(group_id, index, "was reused with a different frame hash, size or chunk count")
            self._open.move_to_end(group_id)
            # A lone chunk cannot come twice while its group is open (it executes at once): no digest needed.
            digest = hashlib.sha256(payload).hexdigest() if total > 1 else ""
            if group.payload_digests.get(index, digest) != digest:
                raise _conflict(group_id, index, f"received chunk {index} again with a different payload")
            self._hold(group_id, group, index, payload)
            group.payload_digests[index] = digest
            if not final:
                return {"chunk_cached": True}
            if len(group.payloads) < total:  # indices lie in [0, total): a full count means all came
                missing = list(
                    itertools.islice((i for i in range(total) if i not in group.payloads), _MAX_LISTED_MISSING)
                )
                raise _refusal(
                    ChunkGroupMissingChunksError,
                    "request chunk group is missing chunks",
                    chunk_group_id=group_id,
                    missing_chunks=missing,
                )
            del self._open[group_id]
            self._held_bytes -= group.held_bytes
            joined = wire.join_payloads([group.payloads[i] for i in range(total)], descriptor)
            response = execute(joined)  # under the lock: a concurrent replay waits and then sees it done
            group.payloads, group.payload_digests, group.response = {}, {}, dict(response)
            self._done[group_id] = group
            while len(self._done) > _MAX_DONE_GROUPS:
                self._done.popitem(last=False)
            return response

    def _hold(self, group_id: str, group: _Group, index: int, payload: bytes) -> None:
        """Keep one chunk of ``group``, within its declared size and the job's cap (called under the lock)."""
        previous = group.payloads.get(index)  # a resent chunk: its digest matched, so it is the same size
        growth = len(payload) - (len(previous) if previous is not None else 0)
        if group.held_bytes + growth > group.frame_size_bytes:
            raise InvalidRequestError(
                f"chunk {index} of chunk group {group_id} brings its payload to {group.held_bytes + growth} bytes, "
                f"more than the request_chunk.frame_size_bytes={group.frame_size_bytes} it declared; send the "
                "frame's true size, split into chunks that add up to it"
            )
        if group.held_bytes + growth > self.max_bytes:
            raise PayloadTooLargeError(
                f"chunk group {group_id} needs more than the {self.max_bytes} bytes of request chunks this "
                "service holds per tenant (ServeSettings.max_tenant_chunk_bytes); send a smaller frame"
            )
        elsewhere = self.held_elsewhere()
        while self._held_bytes + growth + elsewhere > self.max_bytes and len(self._open) > 1:
            self._drop_oldest()  # this job's least recently sent group (this one was sent last)
        if self._held_bytes + growth + elsewhere > self.max_bytes:
            raise TooManyRequestsError(
                f"your other jobs' unfinished request chunk groups hold {elsewhere} of the {self.max_bytes} bytes "
                "a tenant may hold (ServeSettings.max_tenant_chunk_bytes): send this chunk again once those "
                "uploads finish"
            )
        group.payloads[index] = payload
        group.held_bytes += growth
        self._held_bytes += growth

    def _drop_oldest(self) -> None:
        """Forget the least recently sent open group; its next chunk answers chunk_group_restart_required."""
        _, dropped = self._open.popitem(last=False)
        self._held_bytes -= dropped.held_bytes


def _descriptor_fields(descriptor: dict[str, Any]) -> tuple[str, int, int, str, int]:
    if descriptor.get("kind") != "request":
        raise InvalidRequestError(
            f"a POST body must be a request chunk or a plain DSSST1 frame; got a {descriptor.get('kind')!r} chunk"
        )
    # wire.chunk_descriptor checked already: a request chunk's group id (a non-empty str), the ints'
    # types and lower bounds, chunk_idx < total_chunks, frame_sha256 (64 hex characters)
    group_id, index, total = descriptor["chunk_group_id"], descriptor["chunk_idx"], descriptor["total_chunks"]
    sha, size = descriptor["frame_sha256"], descriptor["frame_size_bytes"]
    if size > _MAX_FRAME_SIZE_BYTES:
        raise InvalidRequestError(f"request_chunk.frame_size_bytes must be in [0, {_MAX_FRAME_SIZE_BYTES}]; got {size}")
    if total > min(size + 1, _MAX_TOTAL_CHUNKS):
        raise InvalidRequestError(
            f"request_chunk.total_chunks must be in [1, {min(size + 1, _MAX_TOTAL_CHUNKS)}] for a frame of"
            f" {size} bytes (at most {_MAX_TOTAL_CHUNKS} chunks); got {total}"
        )
    return group_id, index, total, sha, size


def _conflict(group_id: str, index: int, what: str) -> ChunkGroupError:
    return _refusal(
        ChunkGroupConflictError, f"chunk group {group_id} {what}", chunk_group_id=group_id, received_chunk=index
    )


def _refusal(kind: type[ChunkGroupError], message: str, **detail: Any) -> ChunkGroupError:
    """A chunk-group refusal whose error body also carries ``detail`` (the group id, the chunks at fault)."""
    error = kind(message, category="user")
    error.detail = detail
    return error
