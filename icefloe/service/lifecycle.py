"""A job's lifecycle as an explicit transition table.

::

    pending → placing → initializing → running → cancelling → cancelled → terminated
                                                                failed  (from every state before cancelled)

:meth:`JobState._move` is the one place a state changes; it refuses a move the table does not hold
(:class:`ConflictError` naming the state) and records every move in SQLite and the job's log.
A stop is asked for, never carried out, by whoever decides it (a cancel, an engine crash, service
shutdown): the first sets :attr:`JobState.stop` and the outcome; the job's own thread sees it,
releases the engines and then applies the outcome (:meth:`JobState.finish`).
"""

from __future__ import annotations

import logging
import threading

from icefloe.protocol import JOB_ACTIVE_STATES, ConflictError
from icefloe.service import store
from icefloe.service.joblog import JobLog

__all__ = ["TRANSITIONS", "JobState", "fail_interrupted_jobs"]

_log = logging.getLogger("icefloe.service.jobs")

TRANSITIONS: dict[str, frozenset[str]] = {
    "pending": frozenset({"placing", "cancelling", "failed"}),
    "placing": frozenset({"initializing", "cancelling", "failed"}),
    "initializing": frozenset({"running", "cancelling", "failed"}),
    "running": frozenset({"cancelling", "failed"}),
    "cancelling": frozenset({"cancelled", "failed"}),
    "cancelled": frozenset({"terminated"}),
    "terminated": frozenset(),
    "failed": frozenset(),
}


class JobState:
    """The live state of one job: where it stands in :data:`TRANSITIONS`, and whether it must stop."""

    def __init__(self, job_id: str, db: store.Database, log: JobLog) -> None:
        self.job_id = job_id
        self.status = "pending"
        self.stop = threading.Event()  # set once: the job's thread then releases the engines
        self._outcome: tuple[str, str | None] | None = None  # (final state, reason); None = record nothing
        self.stop_reason = ""  # why it stops, for the requests it leaves unrun
        self._db = db
        self._log = log
        self._lock = threading.Lock()

    def _move(self, to: str, reason: str | None = None) -> None:
        if to not in TRANSITIONS[self.status]:
            raise ConflictError(f"job {self.job_id} is {self.status}; a {self.status} job cannot become {to}")
        self.status = to
        # Logged before the row changes: a `logs --follow` reader stops once it sees the job ended,
        # so the line saying so must already be in the log.
        self._log.write(f"job is {to}" + (f": {reason}" if reason else ""), level="ERROR" if to == "failed" else "INFO")
        store.update_job(self._db, job_id=self.job_id, status=to, reason=reason)
        console_level = logging.WARNING if to == "failed" else logging.INFO  # the serve console's line
        _log.log(console_level, "job %s is %s%s", self.job_id, to, f": {reason}" if reason else "")

    def advance(self, to: str) -> bool:
        """The job's thread moves on to ``to``; False (nothing moves) once a stop was asked for."""
        with self._lock:
            if self.stop.is_set():
                return False
            self._move(to)
            return True

    def cancel(self, reason: str | None = None) -> str:
        """Ask for a stop that ends ``cancelled``: ``cancelling`` at once; idempotent while cancelling."""
        with self._lock:
            if self.status in ("cancelling", "cancelled") or (self.stop.is_set() and TRANSITIONS[self.status]):
                return self.status  # already stopping (a failure or shutdown under way: it keeps its outcome)
            self._move("cancelling", reason)
            self._outcome = ("cancelled", None)
            self.stop_reason = reason or "cancelled"
            self.stop.set()
            return self.status

    def fail(self, reason: str) -> None:
        """Ask for a stop that ends ``failed`` with ``reason``, unless another stop came first."""
        with self._lock:
            if not self.stop.is_set():
                self._outcome = ("failed", reason)
                self.stop_reason = reason
                self.stop.set()

    def shut_down(self) -> None:
        """Ask for a stop that records nothing (service shutdown): the next start fails the job."""
        self.stop_reason = self.stop_reason or "the service is shutting down"
        self.stop.set()

    def finish(self) -> None:
        """Apply the outcome, once the engines are released."""
        with self._lock:
            if self._outcome is None:
                return
            final, reason = self._outcome
            self._outcome = None
            if final == "failed":
                self._move("failed", reason)
            else:
                self._move("cancelled")
                self._move("terminated")


def fail_interrupted_jobs(db: store.Database) -> None:
    """Fail the jobs and requests a previous service process left active; a job's reason names the
    checkpoint to resume from."""
    marks = ",".join("?" * len(JOB_ACTIVE_STATES))
    for row in db.fetch_all(f"SELECT job_id FROM jobs WHERE status IN ({marks})", JOB_ACTIVE_STATES):
        job_id = row["job_id"]
        saved = store.list_checkpoints(db, job_id=job_id)  # latest last
        reason = "service restarted; no checkpoint was saved"
        if saved:
            latest = saved[-1]["checkpoint_id"]
            reason = (
                f"service restarted; resume from checkpoint {latest} (create a job with "
                f"source_checkpoint_info={{checkpoint_id: {latest!r}, source_job_id: {job_id!r}}})"
            )
        store.update_job(db, job_id=job_id, status="failed", reason=reason)
        _log.warning("job %s was active when the service stopped; marked failed", job_id)
    error = "service restarted before the request finished; submit it again to a new job"
    db.execute(
        "UPDATE requests SET status = 'failed', error = ?, updated_at = ? WHERE status IN ('pending', 'running')",
        (error, store.now_iso()),
    )
