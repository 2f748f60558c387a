"""``generate-stream``: one request whose per-prompt results are drained as events while it runs.

The body is UTF-8 JSON sent as octet-stream (never DSSST1, never chunked), with the fields of a
generate. Each prompt is queued as its own batchable item, so the prompts of one stream (and of
streams sent close together) are generated as one batch, and each result becomes an event the
moment its batch finishes. Polls drain events destructively, as the training API specifies:
``{type: "result", index, result}``, ``{type: "error", index, error}``, and a final
``{type: "done", completed, failed}``.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from typing import Any

from pydantic import ValidationError

from icefloe.protocol import InvalidRequestError
from icefloe.service.jobs import JobManager, LiveJob
from icefloe.service.models import GenerateBody
from icefloe.service.operations import generate_target, sampling_params_per_prompt, validation_text

__all__ = ["OP_GENERATE_STREAM", "GenerateStream", "submit_generate_stream"]

OP_GENERATE_STREAM = "generate-stream"


class GenerateStream:
    """Events of one streaming request; filled by the sampler's worker, drained by polls."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.completed = 0
        self.failed = 0
        self._events: deque[dict[str, Any]] = deque()
        self._lock = threading.Lock()

    def push(self, event: dict[str, Any]) -> bool:
        """Queue one event; True when it was the last prompt's (the stream is then complete)."""
        with self._lock:
            self._events.append(event)
            if event["type"] == "result":
                self.completed += 1
            elif event["type"] == "error":
                self.failed += 1
            finished = self.completed + self.failed == self.total
            if finished:
                self._events.append({"type": "done", "completed": self.completed, "failed": self.failed})
            return finished

    def drain(self, max_events: int) -> list[dict[str, Any]]:
        with self._lock:
            return [self._events.popleft() for _ in range(min(max_events, len(self._events)))]

    @property
    def pending_events(self) -> int:
        with self._lock:
            return len(self._events)


def _parse(body: bytes) -> GenerateBody:
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"generate-stream body must be UTF-8 JSON (not DSSST1); {exc}") from None
    try:
        return GenerateBody.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequestError(validation_text(exc)) from None


def submit_generate_stream(manager: JobManager, job: LiveJob, body: bytes, *, sub_job_id: str | None) -> dict:
    """Queue every prompt of the stream; returns ``{request_id, job_id, count}``."""

    request = _parse(body)
    target = sub_job_id or generate_target(job, request.routing_key)
    params = sampling_params_per_prompt(request, job, target)
    host = job.host
    assert host is not None
    request_id = manager.requests.add(job.job_id, target, OP_GENERATE_STREAM, {})
    stream = GenerateStream(total=len(request.prompts))
    manager.streams[request_id] = stream

    def run_batch(items: list[tuple[int, Any, Any]]) -> list[None]:
        manager.requests.start(request_id, "streaming")
        finished = False
        try:
            if job.stopping:
                raise InvalidRequestError(f"job {job.job_id} is {job.status}")
            samples = host.generate(target, [prompt for _, prompt, _ in items], [p for _, _, p in items])
        except Exception as exc:  # each prompt of the failed batch gets an error event
            for index, _, _ in items:
                finished = stream.push({"type": "error", "index": index, "error": f"{type(exc).__name__}: {exc}"})
        else:
            cursor = 0
            for index, _, item_params in items:
                chunk = samples[cursor : cursor + item_params.n]
                cursor += item_params.n
                result = {"job_id": job.job_id, "results": chunk}
                finished = stream.push({"type": "result", "index": index, "result": result})
        if finished:
            manager.requests.finish(
                request_id,
                status="done",
                result_json=json.dumps({"completed": stream.completed, "failed": stream.failed}),
            )
        return [None] * len(items)

    for index, (prompt, prompt_params) in enumerate(zip(request.prompts, params, strict=True)):
        job.workers[target].submit_batchable(OP_GENERATE_STREAM, (index, prompt, prompt_params), run_batch)
    return {"request_id": request_id, "job_id": job.job_id, "count": len(request.prompts)}
