"""Generate-stream events waiting for a poll, and the per-tenant budget of bytes they may hold.

A ``generate-stream`` queues its prompts and keeps each prompt's outcome as an event until a poll
drains it. Events no one drains would otherwise hold the service's memory for as long as the job
runs, so every event is counted in bytes against its job's tenant (:class:`StreamBudget`), as it is
pushed. Past ``--max-stream-events-mb`` a new stream is refused (429), and a running stream whose
samples would not fit fails its remaining prompts with an error event naming the cap: an outcome is
never dropped without an event that says so. A poll that drains events, and a stream that ends, give
their bytes back.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from icefloe.protocol import TooManyRequestsError
from icefloe.service.limits import TenantBytes
from icefloe.service.work.items import Sample

__all__ = ["EVENT_OVERHEAD_BYTES", "GenerateStream", "OpenStreams", "StreamBudget"]

_MiB = 1 << 20
_CAP_FLAG = "icefloe serve --max-stream-events-mb"

# What an event costs beside its text: its dict, its list of samples and their string headers.
EVENT_OVERHEAD_BYTES = 256


class StreamBudget(TenantBytes):
    """Bytes of undrained generate-stream events per tenant, and what a stream is told past them."""

    def check_room(self, tenant: str) -> None:
        """Refuse a new stream (429) while the tenant's undrained events fill its budget."""
        held = self.held(tenant)
        if held >= self.cap_bytes:
            raise TooManyRequestsError(
                f"your generate-stream events that no poll has drained hold {held / _MiB:.0f} MiB (at most "
                f"{self.cap_bytes // _MiB} MiB: {_CAP_FLAG}); poll (drain) your open streams first, then retry"
            )

    def overflow_error(self, size: int) -> str:
        """The error event of a prompt whose samples did not fit."""
        return (
            f"its samples ({size / _MiB:.1f} MiB) would take your undrained generate-stream events past "
            f"{self.cap_bytes // _MiB} MiB ({_CAP_FLAG}); this stream's remaining prompts fail: poll (drain) "
            "your open streams as they run"
        )


@dataclass
class GenerateStream:
    """Events of one ``generate-stream`` request (UTF-8 JSON with a generate's fields): its prompts are
    the :class:`Sample` items of ``items`` (consecutive prompts each, samples as JSON text), and each
    prompt's outcome an event the moment its item finishes. Polls drain events destructively, as the
    training API specifies: ``{type: "result", index, result}``, ``{type: "error", index, error}``, then
    ``{type: "done", completed, failed}``. Each event is counted against ``owner``'s ``budget`` until it
    is drained or the stream is closed; the worker pushes while a poll drains, hence the lock.
    """

    job_id: str
    owner: str
    budget: StreamBudget
    items: list[Sample]
    count: int  # prompts
    completed: int = 0
    failed: int = 0
    overflow: str | None = None  # the error that fails the rest of a stream whose samples did not fit
    _events: deque[tuple[int, dict[str, Any]]] = field(default_factory=deque)  # (bytes counted, event)
    _settled: set[int] = field(default_factory=set)  # prompts with an event
    _closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def push(self, item: Sample, *, result: Any = None, error: str | None = None) -> str | None:
        """Queue the events of ``item``'s prompts (``result``: their samples' JSON texts, prompt-major);
        after the last prompt's, ``done``, and return the counts (JSON) the request finishes with."""
        with self._lock:
            if self._closed or self.overflow is not None:  # no one will poll these, or its prompts failed already
                return None
            if error is None:
                self._push_results(item, result)
            else:
                self._push_errors(range(item.index, item.index + len(item.prompts)), error)
            if self.completed + self.failed < self.count:
                return None
            self._append({"type": "done", "completed": self.completed, "failed": self.failed}, 0)
            return json.dumps({"completed": self.completed, "failed": self.failed})

    def _push_results(self, item: Sample, result: list[str]) -> None:
        size = sum(map(len, result)) + EVENT_OVERHEAD_BYTES * len(item.params)
        if not self.budget.take(self.owner, size):  # this prompt and every one not run yet fail now
            self.overflow = self.budget.overflow_error(size)
            self._push_errors([i for i in range(self.count) if i not in self._settled], self.overflow)
            return
        first = 0
        for offset, params in enumerate(item.params):
            samples = result[first : first + params.n]
            event = {"type": "result", "index": item.index + offset, "result": samples}
            self._events.append((self._cost(samples), event))
            first += params.n
        self._settled.update(range(item.index, item.index + len(item.params)))
        self.completed += len(item.params)

    @staticmethod
    def _cost(samples: list[str]) -> int:
        return sum(map(len, samples)) + EVENT_OVERHEAD_BYTES

    def _push_errors(self, prompts: Iterable[int], error: str) -> None:
        for index in prompts:
            self._append({"type": "error", "index": index, "error": error}, len(error))
            self._settled.add(index)
            self.failed += 1

    def _append(self, event: dict[str, Any], text_bytes: int) -> None:
        """An event the budget must hold whatever it holds already (an outcome is never dropped)."""
        size = text_bytes + EVENT_OVERHEAD_BYTES
        self.budget.take(self.owner, size, force=True)
        self._events.append((size, event))

    def drain(self, max_events: int) -> list[dict[str, Any]]:
        """Up to ``max_events`` events, oldest first, their bytes given back to the budget."""
        with self._lock:
            taken = [self._events.popleft() for _ in range(min(max_events, len(self._events)))]
        self.budget.give(self.owner, sum(size for size, _ in taken))
        return [event for _, event in taken]

    def close(self) -> None:
        """Drop the events no poll drained and give their bytes back; later pushes are ignored."""
        with self._lock:
            self._closed = True
            held = sum(size for size, _ in self._events)
            self._events.clear()
        self.budget.give(self.owner, held)

    @property
    def pending_events(self) -> int:
        return len(self._events)


class OpenStreams:
    """The streams of requests whose events may still be polled, by request id; one leaving is closed."""

    def __init__(self, budget: StreamBudget) -> None:
        self.budget = budget
        self._streams: dict[str, GenerateStream] = {}

    def open(self, request_id: str, stream: GenerateStream) -> None:
        self._streams[request_id] = stream

    def get(self, request_id: str) -> GenerateStream | None:
        return self._streams.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def close(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.close()

    def close_job(self, job_id: str) -> None:
        """Close every stream of ``job_id`` (its job ended: no poll will drain them)."""
        for request_id, stream in list(self._streams.items()):
            if stream.job_id == job_id:
                self.close(request_id)
