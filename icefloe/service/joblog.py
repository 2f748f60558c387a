"""Structured per-sub-job logs: JSONL entries ``{ts, level, logger, msg}`` read back by ``tail-logs``.

Each sub-job has one append-only file; a cursor is a byte offset into it, so paging is exact and a
client that lost a response simply re-reads from the cursor it already had. Job-wide events
(placement, loading, cancel) go to every sub-job's file so each tail tells the whole story.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from icefloe.protocol import InvalidRequestError
from icefloe.service.store import now_iso

__all__ = ["ENGINE_LOGGER", "JobLog", "JobLogRouter", "LogTarget", "Recorder", "TokenRedactor", "relay"]

ENGINE_LOGGER = "icefloe"  # the logger whose records (every engine's) a router is attached to
# The op the current thread runs, if any: the router serving it and where its records go.
_op = threading.local()
_ALWAYS = ("always", None, Warning, None, 0)  # the entry filterwarnings("always", append=True) adds
_MAX_WARNED = 4096


class TokenRedactor(logging.Filter):
    """Replace any configured bearer token inside a log record with ``***`` before it is written."""

    def __init__(self, tokens: tuple[str, ...]) -> None:
        super().__init__()
        self._tokens = tuple(t for t in tokens if t)

    def redact(self, text: str) -> str:
        for token in self._tokens:
            text = text.replace(token, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        """Scrub the template and each argument in place: formatters such as uvicorn's access
        formatter unpack ``record.args``, so they must keep their shape."""
        if self._tokens:
            if isinstance(record.msg, str):
                record.msg = self.redact(record.msg)
            if isinstance(record.args, tuple):
                record.args = tuple(self.redact(a) if isinstance(a, str) else a for a in record.args)
            elif isinstance(record.args, dict):
                record.args = {k: self.redact(v) if isinstance(v, str) else v for k, v in record.args.items()}
        return True


class JobLog:
    """Append and page the log files of one job's sub-jobs.

    ``shown`` turns a line into what its reader gets (the service's folders named, not spelled out):
    the files keep every line as written, for the operator.
    """

    def __init__(self, log_dir: Path, sub_job_ids: list[str], *, shown: Callable[[str], str] = str) -> None:
        self._dir = log_dir
        self._sub_job_ids = list(sub_job_ids)
        self._shown = shown
        self._lock = threading.Lock()
        log_dir.mkdir(parents=True, exist_ok=True)

    def _path(self, sub_job_id: str) -> Path:
        return self._dir / f"{sub_job_id.replace(':', '_')}.jsonl"

    def write(self, msg: str, *, level: str = "INFO", sub_job_id: str | None = None, logger: str | None = None) -> None:
        entry = {"ts": now_iso(), "level": level, "logger": logger or f"icefloe.job.{sub_job_id or 'job'}", "msg": msg}
        line = json.dumps(entry) + "\n"
        targets = [sub_job_id] if sub_job_id else self._sub_job_ids
        with self._lock:
            for target in targets:
                with self._path(target).open("a", encoding="utf-8") as fh:
                    fh.write(line)

    def tail(self, sub_job_id: str, *, cursor: str | None, max_lines: int) -> dict[str, Any]:
        """One page ``{entries, next_cursor, eof}`` from ``cursor`` (empty = from the start).

        ``eof`` is true when the page reached the current end of the log, also while the job runs:
        a reader that does not follow stops there; one that follows polls again for later lines.
        """
        if cursor and not cursor.isdecimal():
            raise InvalidRequestError(f"payload.cursor must be a cursor returned by tail-logs; got {cursor!r}")
        offset = int(cursor or 0)
        path = self._path(sub_job_id)
        entries: list[dict[str, Any]] = []
        size = path.stat().st_size if path.exists() else 0
        if offset < size:
            with path.open("rb") as fh:
                fh.seek(offset)
                while len(entries) < max_lines:
                    raw = fh.readline()
                    if not raw.endswith(b"\n"):
                        break  # a line still being written; read it next time
                    offset += len(raw)
                    entries.append(self._entry(raw))
        return {"entries": entries, "next_cursor": str(offset), "eof": offset >= size}

    def last(self, sub_job_id: str, *, max_lines: int, max_bytes: int = 256 * 1024) -> list[dict[str, Any]]:
        """The sub-job's last ``max_lines`` entries, read from at most its last ``max_bytes``."""
        path = self._path(sub_job_id)
        if not path.exists():
            return []
        with path.open("rb") as fh:
            start = max(0, fh.seek(0, 2) - max_bytes)
            fh.seek(start)
            lines = fh.read().split(b"\n")
        if start > 0:
            lines = lines[1:]  # the first line read may be cut
        return [self._entry(raw) for raw in lines[:-1][-max_lines:]]  # after the last newline: still being written

    def _entry(self, raw: bytes) -> dict[str, Any]:
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:  # a line not written by JobLog.write
            entry = {"msg": raw.decode("utf-8", "replace").rstrip("\n")}
        if isinstance(entry, dict) and isinstance(entry.get("msg"), str):
            entry["msg"] = self._shown(entry["msg"])
        return entry


class LogTarget(Protocol):
    """Where a router writes a record: a :class:`JobLog`, or a :class:`Recorder` that keeps it to send on."""

    def write(self, msg: str, *, level: str = ..., sub_job_id: str | None = ..., logger: str | None = ...) -> None: ...


class Recorder:
    """Keeps the records an engine process (or actor) logs while it runs one call, to send back with
    its answer; the service's side hands them to :func:`relay`, for the logs of the jobs whose op it is."""

    def __init__(self) -> None:
        self.entries: list[dict[str, str]] = []

    def write(self, msg: str, *, level: str = "INFO", sub_job_id: str | None = None, logger: str | None = None) -> None:
        entry = {"msg": msg, "level": level, "logger": logger or "icefloe"}
        self.entries.append(entry if sub_job_id is None else {**entry, "owner": sub_job_id})


class JobLogRouter(logging.Handler):
    """Copy the warnings engines log (and ``warnings.warn``) into the logs of the jobs they are about.

    A thread running an op says whose it is with :meth:`serving`: on a shared host one worker thread
    runs every run's ops, and one op may be a batch of several jobs' calls: a record an engine logs
    about its own call (its ``owner``, a sub-job) goes to that call's job alone, any other to each job
    of the batch. Outside ops a thread bound by name routes its records: a job's lifecycle thread
    (``icefloe-lifecycle-<job>``), which loads its engines. :meth:`attach` also routes warnings.
    """

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self._targets: dict[str, tuple[LogTarget, str | None]] = {}
        self._lock_targets = threading.Lock()
        self._shown: tuple[Callable[..., Any], Callable[..., Any]] | None = None  # (before attach(), ours)
        self._warned: set[tuple[Any, ...]] = set()  # places shown, and (log, sub-job, place) written

    def bind(self, thread_name: str, log: LogTarget, sub_job_id: str | None) -> None:
        with self._lock_targets:
            self._targets[thread_name] = (log, sub_job_id)

    def unbind(self, log: LogTarget) -> None:
        with self._lock_targets:
            self._targets = {name: target for name, target in self._targets.items() if target[0] is not log}

    @contextlib.contextmanager
    def serving(self, targets: Iterable[tuple[LogTarget, str | None]]) -> Iterator[None]:
        """While this lasts, what this thread logs goes to ``targets`` (each a log and its sub-job)."""
        previous = getattr(_op, "serving", None)
        _op.serving = (self, list(targets))
        try:
            yield
        finally:
            _op.serving = previous

    def attach(self, logger: logging.Logger) -> None:
        """Route ``logger``'s records, and every ``warnings.warn``: shown as before, once per place in
        the code per process, and written once per place into the log of each job whose op warned it.

        Python's own once-per-place rule would keep a warning from every job after the first on a
        shared host, so warnings are let through every time and the router keeps the rule itself."""
        logger.addHandler(self)
        shown = warnings.showwarning
        warnings.filterwarnings("always", append=True)  # after every filter a caller or library set

        def tee(message: Any, category: type[Warning], filename: str, lineno: int, *rest: Any) -> None:
            place = (str(message), category, filename, lineno)
            self.warned(message, category, filename, lineno)
            if self._remember(("shown", place)):
                shown(message, category, filename, lineno, *rest)

        warnings.showwarning, self._shown = tee, (shown, tee)

    def detach(self, logger: logging.Logger) -> None:
        logger.removeHandler(self)
        if self._shown is not None and warnings.showwarning is self._shown[1]:  # else another took it over since
            warnings.showwarning = self._shown[0]
        with contextlib.suppress(ValueError):  # "always" left nothing in the registries a version bump clears
            warnings.filters.remove(_ALWAYS)
        self._shown = None

    def warned(self, message: Any, category: type[Warning], filename: str, lineno: int) -> None:
        """A warning, as a WARNING record of the ``py.warnings`` logger (as ``logging.captureWarnings`` makes)."""
        if self._routes(threading.current_thread().name):
            self.handle(
                logging.LogRecord(
                    "py.warnings", logging.WARNING, filename, lineno, "%s: %s", (category.__name__, message), None
                )
            )

    def _remember(self, key: tuple[Any, ...]) -> bool:
        """Whether ``key`` is new; the set is emptied when full, so a warning whose text keeps changing
        costs bounded memory (and is written again, as Python would show it again)."""
        with self._lock_targets:
            if key in self._warned:
                return False
            if len(self._warned) >= _MAX_WARNED:
                self._warned.clear()
            self._warned.add(key)
            return True

    def _routes(self, thread_name: str) -> Sequence[tuple[LogTarget, str | None]]:
        serving = getattr(_op, "serving", None)
        if serving is not None and serving[0] is self:
            return serving[1]
        target = self._targets.get(thread_name)
        return [target] if target is not None else []

    def emit(self, record: logging.LogRecord) -> None:
        owner = getattr(record, "owner", None)  # the sub-job whose call it is about, if the engine said
        for log, sub_job_id in self._routes(record.threadName or ""):
            if owner is None or sub_job_id in (None, owner):
                self._write(log, sub_job_id or owner, record)

    def _write(self, log: LogTarget, sub_job_id: str | None, record: logging.LogRecord) -> None:
        """Write ``record`` to one log; a warning once per text per job (a :class:`Recorder` keeps every
        one: the service's router it is relayed to keeps the rule)."""
        once = record.name == "py.warnings" and not isinstance(log, Recorder)
        if once and not self._remember((log, sub_job_id, record.getMessage())):
            return
        try:
            log.write(record.getMessage(), level=record.levelname, sub_job_id=sub_job_id, logger=record.name)
        except OSError:  # a log that cannot be written must not break the op that logged
            self.handleError(record)


def relay(entries: Iterable[dict[str, str]]) -> None:
    """Log on this thread what a :class:`Recorder` kept elsewhere while it ran this thread's call: its
    records are routed as this thread's own are (to the jobs of the op it serves, or by its name)."""
    logger = logging.getLogger(ENGINE_LOGGER)
    for entry in entries:
        fields = {"name": entry["logger"], "msg": entry["msg"], "levelname": entry["level"]}
        fields["owner"] = entry.get("owner")  # the sub-job the record is about, as the engine said
        logger.handle(logging.makeLogRecord({**fields, "levelno": logging.getLevelName(entry["level"])}))
