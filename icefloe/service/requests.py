"""The request table: every request's record, and the long-polls waiting for one to finish.

Rows live in SQLite; this table is their only reader and writer, and hides the cache in front:
the rows of open and of just-finished requests are kept in memory as they are written, so a
long-poll neither re-reads a status nor loads a result from SQLite. ``running`` is a memory-only
state (a restart fails every unfinished request either way). A poller registers its future under
the table's lock only while the row is open, and :meth:`RequestTable.finish` takes the futures
under the same lock, so a completion is never missed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from icefloe.protocol import NotFoundError
from icefloe.service import store

__all__ = ["RequestTable"]

_FINISHED_ROWS_KEPT = 256  # rows of just-finished requests kept in memory for their pollers

_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


class RequestTable:
    """Record, start, finish, cancel and read requests; thread-safe."""

    def __init__(self, db: store.Database) -> None:
        self._db = db
        self._lock = threading.Lock()
        self._open: dict[str, dict[str, Any]] = {}
        self._finished: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._waiting: dict[str, list[_Waiter]] = {}
        self._news: dict[str, list[Any]] = {}  # what running requests made so far, until their pollers take it
        self.on_finish: Callable[[str, str, str], None] | None = None  # (op, outcome, created_at) of each finish

    def add(self, job_id: str, sub_job_id: str, op: str, op_metadata: dict[str, Any]) -> str:
        """Record a pending request; returns its id."""
        request_id = f"{sub_job_id}:{op}:{os.urandom(16).hex()}"
        created_at = store.now_iso()
        row = {
            "request_id": request_id,
            "job_id": job_id,
            "sub_job_id": sub_job_id,
            "op": op,
            "status": "pending",
            "created_at": created_at,
            "updated_at": created_at,
            "error": "",
            "result": None,
            "result_path": None,
            "op_metadata": op_metadata,
        }
        self._db.insert("requests", {**row, "op_metadata": json.dumps(op_metadata)})
        with self._lock:
            self._open[request_id] = row
        return request_id

    def start(self, request_id: str, status: str = "running") -> bool:
        """Mark an open request ``status``; False when it may not run (cancelled, or finished already)."""
        with self._lock:
            row = self._open.get(request_id)
            if row is None or row["status"] == "cancelled":
                return False
            if row["status"] != status:
                row["status"], row["updated_at"] = status, store.now_iso()
            return True

    def finish(
        self,
        request_id: str,
        *,
        status: str,
        error: str = "",
        result_json: str | None = None,
        result_path: str | None = None,
    ) -> None:
        """Record the outcome (``result_json``: the result as JSON text) and wake the request's pollers;
        a request that is no longer open (finished, cancelled) keeps the outcome it has."""
        outcome = {
            "status": status,
            "updated_at": store.now_iso(),
            "error": error,
            "result": result_json,
            "result_path": result_path,
        }
        with self._lock:
            row = self._open.pop(request_id, None)
            if row is None:
                return
            self._finished[request_id] = {**row, **outcome}
            self._news.pop(request_id, None)  # the outcome holds all of it
            while len(self._finished) > _FINISHED_ROWS_KEPT:
                self._finished.popitem(last=False)
            waiters = self._waiting.pop(request_id, [])
        store.update_request(self._db, request_id=request_id, outcome=outcome)
        if self.on_finish is not None:
            self.on_finish(row["op"], status, row["created_at"])
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # the poller's loop already closed
                loop.call_soon_threadsafe(_resolve, future)

    def report(self, request_id: str, news: Any) -> None:
        """Keep ``news`` (what a running request made since its last news) for :meth:`take_news`, and
        wake the request's pollers; news of a request no longer open is dropped."""
        with self._lock:
            if request_id not in self._open:
                return
            self._news.setdefault(request_id, []).append(news)
            waiters = self._waiting.pop(request_id, [])
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    def take_news(self, request_id: str) -> list[Any]:
        """The news reported for the request since the last take, oldest first."""
        with self._lock:
            return self._news.pop(request_id, [])

    def cancel(self, job_id: str, request_id: str, *, why: str) -> dict[str, Any]:
        """Cancel a request that has not started; one that runs or ran is left as it is."""
        with self._lock:
            row = self._open.get(request_id)
            pending = row is not None and row["job_id"] == job_id and row["status"] == "pending"
            if pending:
                row["status"] = "cancelled"  # from now on start() refuses it
        if pending:
            self.finish(request_id, status="cancelled", error=why)
        status = "cancelled" if pending else self.get(job_id, request_id)["status"]
        return {"request_id": request_id, "cancelled": pending, "status": status}

    def open_rows(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """Copies of the rows of pending and running requests (of ``job_id``, or of every job)."""
        with self._lock:
            return [dict(row) for row in self._open.values() if job_id is None or row["job_id"] == job_id]

    def has_open(self, job_id: str) -> bool:
        """Whether any request of the job is pending or running."""
        with self._lock:
            return any(row["job_id"] == job_id for row in self._open.values())

    def is_open(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._open

    def get(self, job_id: str, request_id: str) -> dict[str, Any]:
        """The request's row, its result as JSON text; :class:`NotFoundError` outside ``job_id``."""
        with self._lock:
            row = self._open.get(request_id) or self._finished.get(request_id)
            row = dict(row) if row is not None else None
        if row is None:
            row = store.get_request(self._db, request_id=request_id)
        if row is None or row["job_id"] != job_id:
            raise NotFoundError(f"request {request_id} not found in job {job_id}")
        return row

    async def wait(self, job_id: str, request_id: str, timeout_s: float) -> dict[str, Any]:
        """The request's row once it finished or has news (:meth:`report`), or after ``timeout_s`` (a long-poll)."""
        loop = asyncio.get_running_loop()
        waiter: _Waiter = (loop, loop.create_future())
        with self._lock:
            row = self._open.get(request_id)
            waiting = timeout_s > 0 and row is not None and row["job_id"] == job_id and request_id not in self._news
            if waiting:
                self._waiting.setdefault(request_id, []).append(waiter)
        if waiting:
            timer = loop.call_later(timeout_s, _resolve, waiter[1])
            try:
                await waiter[1]
            finally:
                timer.cancel()
                with self._lock:
                    waiters = self._waiting.get(request_id, [])
                    if waiter in waiters:
                        waiters.remove(waiter)
                    if not waiters:
                        self._waiting.pop(request_id, None)
        return self.get(job_id, request_id)

    def queue(self, job_id: str) -> dict[str, int]:
        """How many of the job's requests wait (``pending``) and how many run now."""
        with self._lock:
            states = [row["status"] for row in self._open.values() if row["job_id"] == job_id]
        return {"pending": states.count("pending"), "running": len(states) - states.count("pending")}


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
