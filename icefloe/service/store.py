"""The service's records in SQLite: jobs (and their owners), requests, idempotency keys, checkpoints,
download links, and the Tinker API's sessions and runs.

One connection in WAL mode, shared by the event loop and the worker threads under one lock; each
statement is a short indexed write, so holding the lock never stalls the loop noticeably. Every data
function takes the :class:`Database` first and keyword arguments after it, so a call site reads
like the record it writes.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
    created_at TEXT NOT NULL, updated_at TEXT NOT NULL, spec TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, sub_job_id TEXT NOT NULL, op TEXT NOT NULL,
    status TEXT NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL, error TEXT NOT NULL DEFAULT '',
    result TEXT, result_path TEXT, op_metadata TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS requests_by_job ON requests (job_id);
CREATE TABLE IF NOT EXISTS idempotency (
    route TEXT NOT NULL, caller TEXT NOT NULL, key TEXT NOT NULL, body_sha256 TEXT NOT NULL,
    status_code INTEGER NOT NULL, response BLOB NOT NULL, media_type TEXT NOT NULL, created_at TEXT NOT NULL,
    PRIMARY KEY (route, caller, key)
);
CREATE INDEX IF NOT EXISTS idempotency_by_age ON idempotency (created_at);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id TEXT NOT NULL, checkpoint_id TEXT NOT NULL, global_steps INTEGER NOT NULL, avg_loss REAL,
    created_at TEXT NOT NULL, checkpoint_type TEXT NOT NULL, path TEXT NOT NULL,
    PRIMARY KEY (job_id, checkpoint_id)
);
CREATE TABLE IF NOT EXISTS file_links (
    token TEXT PRIMARY KEY, path TEXT NOT NULL, expires_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS file_links_by_expiry ON file_links (expires_at);
CREATE TABLE IF NOT EXISTS tinker_sessions (
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, status TEXT NOT NULL, created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS tinker_runs (
    run_id TEXT PRIMARY KEY, kind TEXT NOT NULL, session_id TEXT NOT NULL, job_id TEXT NOT NULL,
    base_model TEXT NOT NULL, lora_rank INTEGER, model_path TEXT, created_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS tinker_runs_by_session ON tinker_runs (session_id);
CREATE TABLE IF NOT EXISTS job_metrics (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL NOT NULL, time REAL NOT NULL,
    PRIMARY KEY (job_id, step, name)
);
CREATE TABLE IF NOT EXISTS job_reported_metrics (
    job_id TEXT NOT NULL, name TEXT NOT NULL, points INTEGER NOT NULL, PRIMARY KEY (job_id, name)
);
"""
# Columns added since a data dir could first have been made: (table, column, definition).
_ADDED_COLUMNS = (("jobs", "owner", "TEXT NOT NULL DEFAULT 'default'"),)  # jobs made before tenants: the shared one's
_AFTER_COLUMNS = "CREATE INDEX IF NOT EXISTS jobs_by_owner ON jobs (owner, status);"


def now_iso() -> str:
    """UTC now as ISO-8601 with a ``Z``, the form the training API returns."""
    return _iso(datetime.now(UTC))


def iso_ago(seconds: float) -> str:
    """UTC ``seconds`` ago in the :func:`now_iso` form (such strings compare in time order)."""
    return _iso(datetime.now(UTC) - timedelta(seconds=seconds))


def _iso(moment: datetime) -> str:
    return moment.isoformat(timespec="microseconds").removesuffix("+00:00") + "Z"  # a third of strftime's cost


class Database:
    """A SQLite file opened once, in WAL mode, usable from any thread.

    After :meth:`close`, writes are dropped and reads find nothing, so a worker thread that
    finishes during shutdown cannot fail on the closed connection.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a process crash
        self._closed = False
        self._conn.executescript(_SCHEMA)
        for table, column, definition in _ADDED_COLUMNS:
            present = {row["name"] for row in self._conn.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                self._conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        self._conn.executescript(_AFTER_COLUMNS)

    def execute(self, sql: str, params: Iterable[Any] = ()) -> int:
        with self._lock:
            if self._closed:
                return 0
            return self._conn.execute(sql, tuple(params)).rowcount

    def insert(self, table: str, row: dict[str, Any], *, verb: str = "INSERT") -> int:
        """Write ``row`` (column -> value) into ``table``; ``verb`` may say OR IGNORE or OR REPLACE."""
        return self.execute(
            f"{verb} INTO {table} ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})", row.values()
        )

    def fetch_all(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        with self._lock:
            if self._closed:
                return []
            return [dict(row) for row in self._conn.execute(sql, tuple(params)).fetchall()]

    def fetch_one(self, sql: str, params: Iterable[Any] = ()) -> dict[str, Any] | None:
        rows = self.fetch_all(sql, params)
        return rows[0] if rows else None

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()


class DataDirInUse(RuntimeError):
    """Another service holds the data dir: two services on one store would fail each other's jobs."""


def lock_data_dir(data_dir: Path) -> int:
    """Take the data dir for this process (an exclusive ``flock``); the returned descriptor holds the
    lock until it is closed or the process ends. Raises :class:`DataDirInUse` naming the holder's pid."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / "serve.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUse(
            f"data dir {data_dir} is in use by another icefloe serve (pid {holder}); stop it or pick another data dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


# --- jobs --------------------------------------------------------------------------------------
def insert_job(db: Database, *, job_id: str, status: str, spec: dict[str, Any], owner: str) -> bool:
    """False when a job with this id already exists (nothing is written then)."""
    row = {"job_id": job_id, "status": status, "created_at": (now := now_iso()), "updated_at": now, "owner": owner}
    return db.insert("jobs", {**row, "spec": json.dumps(spec)}, verb="INSERT OR IGNORE") > 0


def update_job(db: Database, *, job_id: str, status: str, reason: str | None = None) -> None:
    """Set the job's status, and its reason unless ``reason`` is None (the old one is kept)."""
    sql = "UPDATE jobs SET status = ?, reason = COALESCE(?, reason), updated_at = ? WHERE job_id = ?"
    db.execute(sql, (status, reason, now_iso(), job_id))


def get_job(db: Database, *, job_id: str) -> dict[str, Any] | None:
    row = db.fetch_one("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
    return {**row, "spec": json.loads(row["spec"])} if row else None


def list_jobs(db: Database, *, status: str | None = None, owner: str | None = None) -> list[dict[str, Any]]:
    """Jobs in creation order, ``spec`` decoded; ``status`` / ``owner`` None: of any."""
    sql = "SELECT * FROM jobs WHERE (?1 IS NULL OR status = ?1) AND (?2 IS NULL OR owner = ?2) ORDER BY created_at"
    return [{**row, "spec": json.loads(row["spec"])} for row in db.fetch_all(sql, (status, owner))]


def job_owner(db: Database, *, job_id: str) -> str | None:
    row = db.fetch_one("SELECT owner FROM jobs WHERE job_id = ?", (job_id,))
    return row["owner"] if row else None


def active_jobs(db: Database, *, owner: str, states: Iterable[str]) -> list[dict[str, Any]]:
    """The owner's jobs in one of ``states``, ``spec`` decoded."""
    states = tuple(states)
    sql = f"SELECT * FROM jobs WHERE owner = ? AND status IN ({', '.join('?' * len(states))})"
    return [{**row, "spec": json.loads(row["spec"])} for row in db.fetch_all(sql, (owner, *states))]


# --- requests ----------------------------------------------------------------------------------
def update_request(db: Database, *, request_id: str, outcome: dict[str, Any]) -> None:
    """Write a request's ``outcome``: status, error, result (JSON text), result_path and updated_at."""
    columns = ("status", "error", "result", "result_path", "updated_at")
    db.execute(
        f"UPDATE requests SET {', '.join(f'{c} = ?' for c in columns)} WHERE request_id = ?",
        (*(outcome[c] for c in columns), request_id),
    )


def get_request(db: Database, *, request_id: str) -> dict[str, Any] | None:
    """The request's row, ``result`` left as its JSON text (to splice into an answer)."""
    row = db.fetch_one("SELECT * FROM requests WHERE request_id = ?", (request_id,))
    if row is not None:
        row["op_metadata"] = json.loads(row["op_metadata"])
    return row


def recent_failed_requests(db: Database, *, job_id: str, limit: int) -> list[dict[str, Any]]:
    """The job's last ``limit`` failed requests, newest first, without their results."""
    return db.fetch_all(
        "SELECT request_id, sub_job_id, op, error, updated_at FROM requests WHERE job_id = ? AND status = 'failed'"
        " ORDER BY updated_at DESC LIMIT ?",
        (job_id, limit),
    )


# --- idempotency -------------------------------------------------------------------------------
def get_idempotent_response(db: Database, *, route: str, caller: str, key: str, ttl_s: float) -> dict[str, Any] | None:
    """The saved reply of ``key`` on ``route`` for this caller, unless older than ``ttl_s``."""
    return db.fetch_one(
        "SELECT * FROM idempotency WHERE route = ? AND caller = ? AND key = ? AND created_at >= ?",
        (route, caller, key, iso_ago(ttl_s)),
    )


def purge_expired(db: Database, *, idempotency_ttl_s: float) -> int:
    """Delete Idempotency-Key records older than the TTL and expired download links; returns how many."""
    removed = db.execute("DELETE FROM idempotency WHERE created_at < ?", (iso_ago(idempotency_ttl_s),))
    return removed + db.execute("DELETE FROM file_links WHERE expires_at < ?", (time.time(),))


# --- checkpoints -------------------------------------------------------------------------------
def upsert_checkpoint(
    db: Database,
    *,
    job_id: str,
    checkpoint_id: str,
    global_steps: int,
    avg_loss: float | None,
    checkpoint_type: str,
    path: str,
) -> None:
    row = {"job_id": job_id, "checkpoint_id": checkpoint_id, "global_steps": global_steps, "avg_loss": avg_loss}
    row |= {"created_at": now_iso(), "checkpoint_type": checkpoint_type, "path": path}
    db.insert("checkpoints", row, verb="INSERT OR REPLACE")


def list_checkpoints(db: Database, *, job_id: str) -> list[dict[str, Any]]:
    return db.fetch_all("SELECT * FROM checkpoints WHERE job_id = ? ORDER BY global_steps, created_at", (job_id,))


def get_checkpoint(db: Database, *, job_id: str, checkpoint_id: str) -> dict[str, Any] | None:
    return db.fetch_one("SELECT * FROM checkpoints WHERE job_id = ? AND checkpoint_id = ?", (job_id, checkpoint_id))


def find_checkpoints(db: Database, *, checkpoint_id: str) -> list[dict[str, Any]]:
    """Every job's checkpoint of that id (a create-time source given without its job)."""
    return db.fetch_all("SELECT * FROM checkpoints WHERE checkpoint_id = ?", (checkpoint_id,))


def delete_checkpoint(db: Database, *, job_id: str, checkpoint_id: str) -> bool:
    return db.execute("DELETE FROM checkpoints WHERE job_id = ? AND checkpoint_id = ?", (job_id, checkpoint_id)) > 0


def owned_tinker_checkpoints(db: Database, *, owner: str | None, limit: int, offset: int) -> list[dict[str, Any]]:
    """The Tinker checkpoints of the owner's runs (every owner's: None), newest first, each with its
    ``run_id``; a page of ``limit`` from ``offset``."""
    sql = (
        "SELECT c.*, r.run_id FROM checkpoints c JOIN tinker_runs r ON r.job_id = c.job_id AND r.kind = 'model' "
        "JOIN jobs j ON j.job_id = c.job_id WHERE c.checkpoint_id LIKE 'tinker-%' "
        "AND c.checkpoint_id NOT LIKE 'tinker-snapshot-%' AND (?1 IS NULL OR j.owner = ?1) "
        "ORDER BY c.created_at DESC LIMIT ?2 OFFSET ?3"
    )
    return db.fetch_all(sql, (owner, limit, offset))


def owned_training_checkpoints(db: Database, *, owner: str | None, limit: int) -> list[dict[str, Any]]:
    """The checkpoints of the owner's training-API jobs (every owner's: None; no Tinker run's), newest first."""
    sql = (
        "SELECT c.* FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id WHERE (?1 IS NULL OR j.owner = ?1) "
        "AND NOT EXISTS (SELECT 1 FROM tinker_runs r WHERE r.job_id = c.job_id) ORDER BY c.created_at DESC LIMIT ?2"
    )
    return db.fetch_all(sql, (owner, limit))


def count_tinker_checkpoints(db: Database, *, owner: str | None) -> int:
    sql = (
        "SELECT COUNT(*) AS n FROM checkpoints c JOIN tinker_runs r ON r.job_id = c.job_id AND r.kind = 'model' "
        "JOIN jobs j ON j.job_id = c.job_id WHERE c.checkpoint_id LIKE 'tinker-%' "
        "AND c.checkpoint_id NOT LIKE 'tinker-snapshot-%' AND (?1 IS NULL OR j.owner = ?1)"
    )
    row = db.fetch_one(sql, (owner,))
    return row["n"] if row else 0


# --- Tinker sessions and runs ------------------------------------------------------------------
def insert_tinker_session(db: Database, *, session_id: str, owner: str) -> None:
    row = {"session_id": session_id, "owner": owner, "status": "active", "created_at": (now := now_iso())}
    db.insert("tinker_sessions", {**row, "updated_at": now})


def finish_tinker_session(db: Database, *, session_id: str) -> None:
    db.execute(
        "UPDATE tinker_sessions SET status = 'finished', updated_at = ? WHERE session_id = ?", (now_iso(), session_id)
    )


def finish_active_tinker_sessions(db: Database) -> int:
    """Mark the sessions a previous service process left active finished (their jobs failed with it)."""
    sql = "UPDATE tinker_sessions SET status = 'finished', updated_at = ? WHERE status = 'active'"
    return db.execute(sql, (now_iso(),))


def get_tinker_session(db: Database, *, session_id: str) -> dict[str, Any] | None:
    return db.fetch_one("SELECT * FROM tinker_sessions WHERE session_id = ?", (session_id,))


def list_tinker_sessions(db: Database, *, owner: str | None, limit: int, offset: int) -> list[str]:
    """A page of the owner's session ids (every owner's: None), newest first."""
    sql = "SELECT session_id FROM tinker_sessions WHERE (?1 IS NULL OR owner = ?1) "
    rows = db.fetch_all(sql + "ORDER BY created_at DESC, rowid DESC LIMIT ?2 OFFSET ?3", (owner, limit, offset))
    return [row["session_id"] for row in rows]


def session_tinker_runs(db: Database, *, session_id: str) -> list[dict[str, Any]]:
    """The models and sampling sessions of one session, oldest first."""
    sql = "SELECT run_id, kind FROM tinker_runs WHERE session_id = ? ORDER BY created_at, rowid"
    return db.fetch_all(sql, (session_id,))


def insert_tinker_run(
    db: Database, *, run_id: str, kind: str, session_id: str, job_id: str, base_model: str,
    lora_rank: int | None, model_path: str | None,
) -> None:  # fmt: skip
    """Record a model (``kind`` 'model') or a sampling session ('sampler') and the job behind it."""
    row = {"run_id": run_id, "kind": kind, "session_id": session_id, "job_id": job_id, "base_model": base_model}
    db.insert("tinker_runs", {**row, "lora_rank": lora_rank, "model_path": model_path, "created_at": now_iso()})


def get_tinker_run(db: Database, *, run_id: str) -> dict[str, Any] | None:
    """The run with its session's ``owner`` and its job's ``status`` and ``updated_at``."""
    return db.fetch_one(
        "SELECT r.*, s.owner, j.status, j.updated_at FROM tinker_runs r JOIN tinker_sessions s "
        "ON s.session_id = r.session_id JOIN jobs j ON j.job_id = r.job_id WHERE r.run_id = ?",
        (run_id,),
    )


def list_tinker_runs(db: Database, *, owner: str | None, limit: int, offset: int) -> tuple[list[dict[str, Any]], int]:
    """A page of the owner's models (every owner's: None), newest first, as :func:`get_tinker_run`
    answers each; and how many there are in all."""
    where = "FROM tinker_runs r JOIN tinker_sessions s ON s.session_id = r.session_id "
    where += "JOIN jobs j ON j.job_id = r.job_id WHERE r.kind = 'model' AND (?1 IS NULL OR s.owner = ?1)"
    rows = db.fetch_all(
        f"SELECT r.*, s.owner, j.status, j.updated_at {where} ORDER BY r.created_at DESC LIMIT ?2 OFFSET ?3",
        (owner, limit, offset),
    )
    total = db.fetch_one(f"SELECT COUNT(*) AS n {where}", (owner,))
    return rows, total["n"] if total else 0


# --- download links ----------------------------------------------------------------------------
def insert_file_link(db: Database, *, token: str, path: str, expires_at: float) -> None:
    db.execute("DELETE FROM file_links WHERE expires_at < ?", (time.time(),))  # indexed: cheap while few expire
    db.execute("INSERT INTO file_links (token, path, expires_at) VALUES (?, ?, ?)", (token, path, expires_at))


def get_file_link(db: Database, *, token: str) -> dict[str, Any] | None:
    return db.fetch_one("SELECT * FROM file_links WHERE token = ?", (token,))


# --- per-step job metrics ----------------------------------------------------------------------
def put_job_metrics(db: Database, *, job_id: str, step: int, values: dict[str, float], at: float) -> None:
    """Set ``values`` (name -> value) at ``step`` of the job; a name already there is overwritten."""
    if not values:
        return
    rows = ", ".join(["(?, ?, ?, ?, ?)"] * len(values))  # one statement: one commit for the whole step
    params = [field for name, value in values.items() for field in (job_id, step, name, value, at)]
    db.execute(f"INSERT OR REPLACE INTO job_metrics (job_id, step, name, value, time) VALUES {rows}", params)


def job_metrics(db: Database, *, job_id: str, after_step: int, limit: int) -> list[dict[str, Any]]:
    """The job's first ``limit`` rows ``{step, name, value, time}`` past ``after_step``, in step order."""
    sql = "SELECT step, name, value, time FROM job_metrics WHERE job_id = ? AND step > ? ORDER BY step LIMIT ?"
    return db.fetch_all(sql, (job_id, after_step, limit))


def job_metric_names_at(db: Database, *, job_id: str, step: int) -> set[str]:
    """The names that have a value at ``step`` of the job."""
    rows = db.fetch_all("SELECT name FROM job_metrics WHERE job_id = ? AND step = ?", (job_id, step))
    return {row["name"] for row in rows}


def reported_job_metrics(db: Database, *, job_id: str) -> dict[str, int]:
    """Each name the job's client reported -> how many values of it the job keeps.

    Counted as reports arrive, so a report is checked against the job's bounds without reading its series
    (a job from before this table counts from its first report since)."""
    rows = db.fetch_all("SELECT name, points FROM job_reported_metrics WHERE job_id = ?", (job_id,))
    return {row["name"]: row["points"] for row in rows}


def count_reported_job_metrics(db: Database, *, job_id: str, names: Iterable[str]) -> None:
    """Add one kept value to each of ``names`` of the job."""
    params = [field for name in names for field in (job_id, name)]
    if params:
        rows = ", ".join(["(?, ?, 1)"] * (len(params) // 2))
        db.execute(
            f"INSERT INTO job_reported_metrics (job_id, name, points) VALUES {rows} "
            "ON CONFLICT (job_id, name) DO UPDATE SET points = points + 1",
            params,
        )


def latest_job_metrics(db: Database, *, job_id: str | None = None) -> dict[str, dict[str, tuple[int, float]]]:
    """Per job (every job, or only ``job_id``), each metric's value at the last step that has it:
    job id -> name -> (step, value)."""
    # SQLite takes a bare column (value) from the row that holds the MAX().
    where, params = ("WHERE job_id = ?", (job_id,)) if job_id is not None else ("", ())
    sql = f"SELECT job_id, name, MAX(step) AS step, value FROM job_metrics {where} GROUP BY job_id, name"
    latest: dict[str, dict[str, tuple[int, float]]] = {}
    for row in db.fetch_all(sql, params):
        latest.setdefault(row["job_id"], {})[row["name"]] = (row["step"], row["value"])
    return latest
