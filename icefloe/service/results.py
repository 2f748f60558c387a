"""Keep a request's result and hand it back in the form the poller can read.

Three forms, as the training API defines them: plain JSON (kept in the request's row); an inline
base64 DSSST1 envelope; or ``result_chunk`` events paged by cursor (asked for, or a frame over
``inline_result_max_bytes``). A tensor result is one DSSST1 frame on disk, kept for ``ttl_s`` after
it was written (a client may re-poll a page whose answer it lost), then deleted. The Tinker API's
results never take those forms: :class:`HeldResults` keeps them as the engines made them (tensors
and all) until the API renders each when its future is polled.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from icefloe import wire
from icefloe.protocol import ExpiredError, InvalidRequestError

__all__ = [
    "DEFAULT_MAX_EVENTS",
    "MAX_EVENTS_CAP",
    "HeldResults",
    "JsonText",
    "ResultPages",
    "contains_tensor",
    "encode_json",
    "json_text",
    "plain_json",
    "wants_dssst1",
]

_log = logging.getLogger("icefloe.service.results")

DEFAULT_MAX_EVENTS = 16
MAX_EVENTS_CAP = 512


def contains_tensor(value: Any) -> bool:
    """True when a tensor (torch or numpy) sits anywhere inside ``value``."""
    if isinstance(value, Mapping):
        return any(contains_tensor(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(contains_tensor(v) for v in value)
    return type(value).__module__.split(".", 1)[0] in ("torch", "numpy") and hasattr(value, "shape")


class JsonText(str):
    """A value already encoded as JSON: answered as it is."""


def encode_json(value: Any) -> str:
    """``value`` as JSON text (a plain str: a list of str subclasses pickles ten times slower).

    Raises:
        TypeError: ``value`` holds tensors, which have no JSON form.
    """
    text = json_text(value)
    if text is None:
        raise TypeError(f"a {type(value).__name__} holding tensors has no JSON form")
    return text


def json_text(value: Any) -> str | None:
    """A result as JSON text, or None when it holds tensors (it then travels as a DSSST1 frame).

    Engine results are plain Python already, so one ``dumps`` usually does it; walking a generate
    result (thousands of samples) first, to look for tensors, cost more than encoding it.
    """
    try:  # orjson writes NaN and infinities as null, as plain_json does; ~5x faster than json.dumps
        return orjson.dumps(value).decode()
    except TypeError:  # a tensor, a torch or numpy scalar, a non-string key, an int over 64 bits
        pass
    if contains_tensor(value):
        return None
    return json.dumps(plain_json(value))


def plain_json(value: Any) -> Any:
    """Tensor-free results as JSON values: NaN and infinities become None, keys become str.

    A torch or numpy scalar never reaches here: :func:`contains_tensor` counts it as a tensor.
    """
    kind = type(value)
    if kind in _JSON_EXACT:  # the common case first: a generate result holds thousands of these
        return value
    if kind is float:
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


_JSON_EXACT = frozenset({str, int, bool, type(None)})


def _response_options(op_metadata: Mapping[str, Any]) -> Mapping[str, Any]:
    options = op_metadata.get("response_options") if isinstance(op_metadata, Mapping) else None
    return options if isinstance(options, Mapping) else {}


def wants_dssst1(op_metadata: Mapping[str, Any]) -> bool:
    options = _response_options(op_metadata)
    return str(options.get("format", "")).lower() == "dssst1" or options.get("delivery") == "chunked"


def _wants_chunks(op_metadata: Mapping[str, Any]) -> bool:
    return _response_options(op_metadata).get("delivery") == "chunked"


def _inline_envelope(frame: bytes) -> dict[str, Any]:
    return {
        "content_type": "application/octet-stream",
        "encoding": "base64",
        "wire_format": "DSSST1",
        "payload_b64": base64.b64encode(frame).decode("ascii"),
    }


class HeldResults:
    """Results kept in memory by request id, as their op made them, for an API that renders each one
    when it is polled and keeps that answer for a poll sent again (:meth:`answer`). The oldest go
    once more than ``max_results`` are held: a future polled that late is answered as not kept,
    as after a restart (its caller sends the call again)."""

    def __init__(self, max_results: int) -> None:
        self._max = max_results
        self._held: OrderedDict[str, tuple[bool, Any]] = OrderedDict()  # id -> (rendered, value)
        self._lock = threading.Lock()  # workers put, the event loop answers

    def put(self, request_id: str, result: Any) -> None:
        with self._lock:
            self._held[request_id] = (False, result)
            while len(self._held) > self._max:
                self._held.popitem(last=False)

    def held(self, request_id: str) -> bool:
        return request_id in self._held

    def take(self, request_id: str) -> Any:
        """The result, no longer held: for an API that reads each result once. Raises KeyError as :meth:`answer`."""
        with self._lock:
            return self._held.pop(request_id)[1]

    def answer(self, request_id: str, render: Any) -> Any:
        """``render(result)``, rendered once: the first poll renders, a poll sent again gets the same
        answer. Raises KeyError for a result not held (never, or no longer)."""
        with self._lock:
            rendered, value = self._held[request_id]
        if not rendered:
            value = render(value)
            with self._lock:
                if request_id in self._held:
                    self._held[request_id] = (True, value)
        return value


class ResultPages:
    """Results on disk and their delivery as inline envelopes or cursor-paged result chunks."""

    def __init__(self, *, inline_max_bytes: int, chunk_bytes: int, ttl_s: float) -> None:
        self._inline_max_bytes = inline_max_bytes
        self._chunk_bytes = chunk_bytes
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._events: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()  # small cache of split results

    @staticmethod
    def write_frame(result: Any, path: Path) -> str:
        """Encode ``result`` as one DSSST1 frame at ``path`` (written aside, then renamed)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".partial")
        staging.write_bytes(wire.encode(result))
        staging.replace(path)
        return str(path)

    def delete_expired(self, jobs_dir: Path) -> int:
        """Delete the result files of every job under ``jobs_dir`` written more than ``ttl_s`` ago; returns how many."""
        written_before, removed = time.time() - self._ttl_s, 0
        for path in jobs_dir.glob("*/results/*"):
            try:
                if path.stat().st_mtime < written_before:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:  # gone meanwhile: a .partial renamed into place
                pass
            except OSError as exc:  # the watcher thread that sweeps must not die of one file
                _log.warning("could not delete expired result %s: %s", path, exc)
        return removed

    def render(
        self,
        request_id: str,
        result_path: str,
        op_metadata: Mapping[str, Any],
        cursor: str | None,
        max_events: int,
        answer: Callable[[bytes], bytes] | None = None,
    ) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
        """``(result, events, next_cursor)`` for one poll of a request whose result is the frame at
        ``result_path``; ``answer`` makes the frame of the answer from it (once, for paged events)."""
        expired = ExpiredError(
            f"the result of request {request_id} expired: a tensor result is kept for "
            f"ServeSettings.result_ttl_s={self._ttl_s:g} s after its request finished; run the request again"
        )
        stored = Path(result_path)
        if not stored.is_file():  # its pages too: they are kept only as long as the frame
            raise expired
        with self._lock:
            events = self._events.get(request_id)
            if events is not None:
                self._events.move_to_end(request_id)
        if events is None:
            try:
                frame = stored.read_bytes()
            except FileNotFoundError:
                raise expired from None
            frame = answer(frame) if answer is not None else frame
            if not _wants_chunks(op_metadata) and len(frame) <= self._inline_max_bytes:
                return _inline_envelope(frame), [], ""
            events = wire.result_chunk_events(frame, max_bytes=self._chunk_bytes)
            with self._lock:
                self._events[request_id] = events
                while len(self._events) > 4:
                    self._events.popitem(last=False)
        start = _cursor_position(cursor, len(events))
        end = min(len(events), start + max_events)
        return {}, events[start:end], (str(end) if end < len(events) else "")


def _cursor_position(cursor: str | None, num_events: int) -> int:
    if not cursor:
        return 0
    try:
        position = int(cursor)
    except ValueError:
        raise InvalidRequestError(f"cursor must be a next_cursor value from an earlier poll; got {cursor!r}") from None
    if not 0 <= position <= num_events:
        raise InvalidRequestError(f"cursor must be between 0 and {num_events}; got {cursor!r}")
    return position
