"""Job-level calls for people and scripts: what ``icefloe jobs | logs | checkpoints`` show.

They go through the remote transport's :class:`Http` but act on jobs by id, so one can inspect or
cancel a job that another process created.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Self

from icefloe.client.remote import jobs
from icefloe.client.remote.http import Call, Endpoint, Http, Retry
from icefloe.config import RemoteConfig
from icefloe.protocol import JOB_TERMINAL_STATES, normalize_job_state

__all__ = ["ServiceAdmin"]


class ServiceAdmin:
    """Blocking calls on jobs by id; ``close()`` (or ``with``) releases the connection pool."""

    def __init__(self, backend: RemoteConfig) -> None:
        endpoint = Endpoint.from_config(backend)
        self.url = endpoint.url
        self._http = Http(endpoint, backend)

    def _send(self, call: Call) -> Any:
        return self._http.run(self._http.send(call)).body

    def list_jobs(self, status: str | None = None) -> list[dict[str, Any]]:
        """Every job the caller can see, optionally only those in ``status``."""
        params = {"status": status} if status else None
        body = self._send(Call("GET", "", "list jobs", params=params)) or {}
        return list(body.get("jobs", []))

    def get_job(self, job_id: str) -> dict[str, Any]:
        """One job with its sub-jobs and, once it failed, the reason."""
        return jobs.job_object(self._send(Call("GET", f"/{job_id}", "get job")))

    def job_metrics(self, job_id: str) -> list[dict[str, Any]] | None:
        """The job's per-step metrics, ``[{step, time, loss, ...}]`` oldest first; None where the service
        has no such route (the managed endpoint)."""
        points: list[dict[str, Any]] = []
        after_step = -1
        while after_step is not None:  # the service answers the series a page at a time
            # a route the service lacks (404) is answered, not raised or retried
            call = Call("GET", f"/{job_id}/metrics", "job metrics", params={"after_step": after_step},
                        accept=frozenset({404}))  # fmt: skip
            reply = self._http.run(self._http.send(call))
            if reply.status_code == 404:
                return None
            page = reply.body or {}
            points += page.get("points", [])
            after_step = page.get("next_after_step")
        return points

    def cancel_job(self, job_id: str) -> None:
        """Cancel a job; repeating it while the job is cancelling is fine."""
        self._send(Call("POST", f"/{job_id}:cancel", "cancel job", retry=Retry.TRANSIENT))

    def read_logs(
        self, job_id: str, *, sub_job_type: str = "training", follow: bool = False, max_wait_s: float = 6.0
    ) -> Iterator[dict[str, Any]]:
        """Log entries from the start: all there are now, or with ``follow`` until the job has ended.

        A page with entries is followed by the next at once. At the end of the log (``eof``) a
        reader that does not follow stops; a follower polls again after 0.5 s × 1.25 per empty
        page (at most ``max_wait_s``) and stops after one more read once the job is terminal.
        """
        cursor: str | None = None
        delay_s = 0.5
        ended = False  # the job was terminal before the last read, so that read saw its every line
        while True:
            payload = {"max_lines": 200, **({"cursor": cursor} if cursor else {})}
            body = {"operation_type": "tail-logs", "sub_job_type": sub_job_type, "payload": payload}
            # a page of the log: {entries, next_cursor, eof}
            page = self._send(Call("POST", f"/{job_id}/operation", "tail-logs", json=body)) or {}
            cursor = page.get("next_cursor") or cursor
            if entries := page.get("entries"):
                yield from entries
                delay_s = 0.5
                continue
            if page.get("eof") and (not follow or ended):
                return
            ended = follow and normalize_job_state(self.get_job(job_id).get("status")) in JOB_TERMINAL_STATES
            if not ended:
                time.sleep(delay_s)
                delay_s = min(delay_s * 1.25, max_wait_s)

    def list_checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._http.run(jobs.list_checkpoints(self._http, job_id))

    def export_checkpoint(self, job_id: str, checkpoint_id: str) -> dict[str, Any]:
        return self._http.run(jobs.export_checkpoint(self._http, job_id, checkpoint_id))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
