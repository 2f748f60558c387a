"""RoleWorker: one thread that runs a role's work strictly in submission order.

Every op for one engine goes through its worker, so an engine is only ever touched by one thread.
Batchable items (generate requests) that sit next to each other in the queue with the same key
are handed to their ``run_batch`` function together, which is how concurrent requests coalesce.

An engine in another process queues work itself. A job submitted with ``send_ahead`` hands its op
to such an engine before it runs, so the engine starts the next op the moment it finishes one
instead of waiting for this thread to record a result and send the next. When every job in front
of it went ahead already, a second thread (the sender) hands it over as soon as it is submitted,
in submission order; otherwise this thread sends it (and the job behind it) when its turn comes.
A job without ``send_ahead`` (a gate, a batch) stops this: nothing behind it is sent before it
has run.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from icefloe.protocol import ClientClosedError

__all__ = ["RoleWorker", "SyncGate"]


@dataclass
class _Job:
    future: Future
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    key: Hashable | None = None
    item: Any = None
    run_batch: Callable[[list[Any]], Sequence[Any]] | None = None
    send_ahead: Callable[[], None] | None = None
    sent: bool = False  # someone (the sender or the worker) took it on to send
    by_sender: bool = False
    handed: threading.Event = field(default_factory=threading.Event)  # send_ahead() has returned


class RoleWorker:
    """A daemon thread with a FIFO queue.

    Args:
        name: names the thread (``icefloe-<name>``) and appears in errors.
        linger_s: how long a batchable item waits for same-key company when the queue behind it is
            empty; 0 = never wait.
        max_batch_items: most items one ``run_batch`` call receives; None = no limit.
    """

    def __init__(self, name: str, *, linger_s: float = 0.002, max_batch_items: int | None = None) -> None:
        self.name = name
        self.linger_s = linger_s
        self.max_batch_items = max_batch_items
        self._queue: deque[_Job] = deque()
        self._current: _Job | None = None  # the job this thread runs now
        self._outbox: deque[_Job] = deque()  # jobs the sender hands over, in submission order
        self._sender: threading.Thread | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"icefloe-{name}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)``; its result or exception lands on the returned future."""
        return self._put(_Job(Future(), fn=fn, args=args, kwargs=kwargs))

    def submit_ahead(self, send_ahead: Callable[[], None], fn: Callable[..., Any], /, *args: Any) -> Future:
        """Like :meth:`submit`; ``send_ahead()`` hands the op to its engine early (see the module docstring)."""
        return self._put(_Job(Future(), fn=fn, args=args, send_ahead=send_ahead))

    def submit_batchable(self, key: Hashable, item: Any, run_batch: Callable[[list[Any]], Sequence[Any]]) -> Future:
        """Queue ``item``; consecutive queued items with the same ``key`` run in one ``run_batch`` call.

        ``run_batch(items)`` must return one result per item, in order.
        """
        return self._put(_Job(Future(), key=key, item=item, run_batch=run_batch))

    def close(self, wait: bool = True) -> None:
        """Refuse new work, finish what is queued, stop the threads. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
            if self._sender is not None and threading.current_thread() is not self._sender:
                self._sender.join()

    def _put(self, job: _Job) -> Future:
        with self._cond:
            if self._closed:
                raise ClientClosedError(f"worker {self.name!r} is closed; no new work is accepted")
            if job.send_ahead is not None and self._all_went_ahead():
                job.sent = job.by_sender = True
                self._outbox.append(job)
                if self._sender is None:
                    name = f"icefloe-{self.name}-send"
                    self._sender = threading.Thread(target=self._send_loop, name=name, daemon=True)
                    self._sender.start()
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    def _all_went_ahead(self) -> bool:
        """Whether every job queued or running was sent ahead (or is being sent, in order, by the sender)."""
        pending = [*self._queue, self._current] if self._current is not None else self._queue
        return all(j.send_ahead is not None and j.sent and (j.by_sender or j.handed.is_set()) for j in pending)

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while not self._outbox and not self._closed:
                    self._cond.wait()
                if not self._outbox:
                    return  # closed, and everything taken on was handed over
                job = self._outbox.popleft()
            _hand(job)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                job = self._queue.popleft()
                self._current = job
                follower = [self._queue[0]] if self._queue else []
                mine = [job, *follower] if job.send_ahead is not None else []
                mine = [j for j in mine if j.send_ahead is not None and not j.sent]
                for j in mine:
                    j.sent = True
            for j in mine:
                _hand(j)
            if job.sent:
                job.handed.wait()  # the sender may still be writing it: running it now would send it twice
            try:
                if job.run_batch is None:
                    self._run_one(job)
                else:
                    self._run_batch([job, *self._same_key_followers(job.key)])
            finally:
                with self._cond:
                    self._current = None

    def _same_key_followers(self, key: Hashable) -> list[_Job]:
        """Take the queued items right behind the head that share its key (after a short linger)."""
        limit = self.max_batch_items - 1 if self.max_batch_items is not None else None
        followers: list[_Job] = []
        deadline = time.monotonic() + self.linger_s
        with self._cond:
            while True:
                while self._queue and self._queue[0].run_batch is not None and self._queue[0].key == key:
                    if limit is not None and len(followers) >= limit:
                        return followers
                    followers.append(self._queue.popleft())
                remaining = deadline - time.monotonic()
                if self._queue or self._closed or remaining <= 0:
                    return followers
                self._cond.wait(remaining)

    @staticmethod
    def _run_one(job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        assert job.fn is not None
        try:
            result = job.fn(*job.args, **job.kwargs)
        except BaseException as exc:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    @staticmethod
    def _run_batch(jobs: list[_Job]) -> None:
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not jobs:
            return
        run_batch = jobs[0].run_batch
        assert run_batch is not None
        try:
            results = list(run_batch([job.item for job in jobs]))
            if len(results) != len(jobs):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(jobs)} items")
        except BaseException as exc:
            for job in jobs:
                job.future.set_exception(exc)
            return
        for job, result in zip(jobs, results, strict=True):
            job.future.set_result(result)


def _hand(job: _Job) -> None:
    """Hand a job's op to its engine; a failure shows when the job runs and finds it unsent."""
    assert job.send_ahead is not None
    try:
        with contextlib.suppress(BaseException):  # the sender thread must outlive any one send
            job.send_ahead()
    finally:
        job.handed.set()


class SyncGate:
    """Lines a source worker up with its target workers for one copy between engines.

    Submit :meth:`park` to every target worker and :meth:`run` to the source worker. The copy then
    happens after all work queued earlier on every worker and before any work queued later, and
    no target runs anything while the copy reads or writes its engine.

    Args:
        num_targets: how many ``park`` calls ``run`` waits for.
        abandoned: polled while waiting; a non-empty string (the reason) stops the wait, so a job
            that is shutting down never leaves a worker parked forever.
    """

    def __init__(
        self, num_targets: int, *, abandoned: Callable[[], str | None] = lambda: None, tick_s: float = 0.05
    ) -> None:
        self._num_targets = num_targets
        self._abandoned = abandoned
        self._tick_s = tick_s
        self._num_parked = 0
        self._cond = threading.Condition()
        self._released = threading.Event()

    def park(self) -> None:
        """Runs on a target worker: hold it until the copy is done (or abandoned)."""
        with self._cond:
            self._num_parked += 1
            self._cond.notify_all()
        while not self._released.wait(self._tick_s):
            if self._abandoned():
                return

    def run(self, copy: Callable[[], Any]) -> Any:
        """Runs on the source worker: wait for every target to park, copy, release them."""
        try:
            with self._cond:
                while self._num_parked < self._num_targets:
                    self._cond.wait(self._tick_s)
                    reason = self._abandoned()
                    if reason:
                        raise ClientClosedError(f"weight sync abandoned: {reason}")
            return copy()
        finally:
            self._released.set()

    def release(self) -> None:
        """Free parked targets without copying (the sync could not be queued)."""
        self._released.set()
