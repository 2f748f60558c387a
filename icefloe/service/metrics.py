"""What the service measures: each job's per-step series, and the Prometheus registry behind ``/metrics``.

A job's series is kept in SQLite (:func:`store.put_job_metrics`), so it survives a restart. Engine
values come from the results of the training ops as they finish: the ``forward-backward`` calls
since the last ``step`` add up into that step's point (``loss`` token-weighted, ``num_tokens``
summed), and the ``step`` writes it with ``lr``, ``grad_norm``, ``step_time_s`` (since the previous
step ended, or since the step's first forward-backward began) and ``tokens_per_s``. A weight sync
adds ``policy_version`` to the step whose weights it moved. Engine points are numbered by the
``global_step`` the step's result reports (1 after the first step), the number every client shows; the
client numbers the values it reports (``POST {job}/metrics``) itself.

The Prometheus metrics live in a registry of the app's own, so several apps in one process (the
tests) never share counters. Queue depth, jobs by state and chunk-store bytes are read when
scraped; the rest are counted as requests finish.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from icefloe.protocol import OP_FWD_BWD, OP_STEP, OP_WEIGHT_SYNC, ConflictError, InvalidRequestError, checked_metrics
from icefloe.service import store

__all__ = ["MAX_REPORTED_NAMES_PER_JOB", "SERIES_PAGE_VALUES", "ServiceMetrics", "check_reported"]

_log = logging.getLogger("icefloe.service.jobs")
# What a job keeps of its client's reports; engine values are one point per optimizer step, so its work bounds them.
MAX_REPORTED_NAMES_PER_JOB = 256
SERIES_PAGE_VALUES = 8192  # values in one page of GET {job}/metrics: a few MiB at most, even with 256-character names
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


def check_reported(body: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """The step and values of a client report, or :class:`InvalidRequestError` naming the bad field."""
    unknown = sorted(set(body) - {"step", "metrics"})
    if unknown:
        raise InvalidRequestError(f"body has unknown keys {unknown}; send {{'step': int, 'metrics': {{name: number}}}}")
    values = checked_metrics(body.get("step"), body.get("metrics"))
    return body["step"], values


def _points(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One point per step of ``rows`` (in step order); a point's ``time`` is that of its latest value."""
    points: dict[int, dict[str, Any]] = {}
    for row in rows:
        point = points.setdefault(row["step"], {"step": row["step"], "time": row["time"]})
        point["time"] = max(point["time"], row["time"])
        point[row["name"]] = row["value"]
    return list(points.values())


@dataclass
class _Pending:
    """What the forward-backward calls since a sub-job's last step added up to."""

    loss_x_tokens: float = 0.0
    tokens: int = 0
    started: float | None = None  # time.monotonic() when the first of them began


class ServiceMetrics:
    """Per-step job series and the app's Prometheus registry; thread-safe."""

    def __init__(
        self,
        db: store.Database,
        *,
        open_requests: Callable[[], Iterable[dict[str, Any]]],
        chunk_bytes: Callable[[], Mapping[str, int]],
        hosts: Callable[[], Iterable[tuple[dict[str, Any], list[str]]]] = lambda: (),
        max_reported_values: int = 250_000,
    ) -> None:
        self.db = db
        self.max_reported_values = max_reported_values
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(
            "icefloe_requests", "Requests finished, by op and outcome.", ["op", "outcome"], registry=reg
        )

        def seconds(name: str, doc: str, *labels: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_SECONDS_BUCKETS, registry=reg)

        self.request_seconds = seconds(
            "icefloe_request_seconds",
            "Seconds from a request's acceptance to its outcome (queue wait included), by op.",
            "op",
        )
        self.engine_seconds = seconds(
            "icefloe_engine_seconds",
            "Seconds an engine ran one op (a batch of merged requests counts once), by op.",
            "op",
        )
        self.sync_seconds = seconds("icefloe_weight_sync_seconds", "Seconds one weight sync took.")
        self.sync_bytes = Counter("icefloe_weight_sync_bytes", "Bytes weight syncs moved.", registry=reg)
        self._open_requests = open_requests
        self._chunk_bytes = chunk_bytes
        self._hosts = hosts
        reg.register(self)  # its collect(): the gauges read at scrape time
        self._pending: dict[str, _Pending] = {}  # sub-job id -> its forward-backward calls since its last step
        self._last_step_end: dict[str, float] = {}
        self._lock = threading.Lock()
        self._reports = threading.Lock()

    # --- requests and engine results -----------------------------------------------------------
    def request_finished(self, op: str, outcome: str, created_at: str) -> None:
        accepted = datetime.fromisoformat(created_at)  # "...Z" is UTC
        self.requests.labels(op, outcome).inc()
        self.request_seconds.labels(op).observe(max(0.0, (datetime.now(UTC) - accepted).total_seconds()))

    def engine_ran(
        self, job_id: str, sub_job_id: str, op: str, started: float, result: Mapping[str, float] | None
    ) -> None:
        """Called once the engine ran ``op``; ``started`` is its ``time.monotonic()`` start. ``result``: the
        numbers of a result that is a dict (its fields that are one number; its tensors stay with the
        request), None for another."""
        now = time.monotonic()
        self.engine_seconds.labels(op).observe(now - started)
        if result is None:
            return
        try:
            if op == OP_FWD_BWD:
                self._add_fwd_bwd(sub_job_id, result, started)
            elif op == OP_STEP and isinstance(result.get("global_step"), int):
                self._end_step(job_id, sub_job_id, result, now)
            elif op == OP_WEIGHT_SYNC and isinstance(result.get("policy_version"), int):
                self.sync_seconds.observe(float(result.get("seconds", now - started)))
                self.sync_bytes.inc(int(result.get("bytes", 0)))
                version = result["policy_version"]
                if version > 0:  # the weights of global_step == version
                    self.record(job_id, version, {"policy_version": float(version)})
        except Exception:  # a value that cannot be recorded must never fail the op that produced it
            _log.exception("job %s: recording the metrics of %s failed", job_id, op)

    def _add_fwd_bwd(self, sub_job_id: str, result: Mapping[str, float], started: float) -> None:
        loss, tokens = result.get("loss"), result.get("num_tokens")
        with self._lock:
            pending = self._pending.setdefault(sub_job_id, _Pending())
            if pending.started is None:
                pending.started = started
            if isinstance(loss, int | float) and isinstance(tokens, int) and math.isfinite(loss):
                pending.loss_x_tokens += float(loss) * tokens
                pending.tokens += tokens

    def _end_step(self, job_id: str, sub_job_id: str, result: Mapping[str, float], now: float) -> None:
        with self._lock:
            pending = self._pending.pop(sub_job_id, None) or _Pending()
            began = self._last_step_end.get(sub_job_id, pending.started)
            self._last_step_end[sub_job_id] = now
        step = result["global_step"]
        values = {k: float(result[k]) for k in ("lr", "grad_norm") if isinstance(result.get(k), int | float)}
        if pending.tokens:
            values["loss"] = pending.loss_x_tokens / pending.tokens
            values["num_tokens"] = float(pending.tokens)
        if began is not None and now > began:
            values["step_time_s"] = now - began
            if pending.tokens:
                values["tokens_per_s"] = pending.tokens / (now - began)
        self.record(job_id, step, {k: v for k, v in values.items() if math.isfinite(v)})
        loss = f"{values['loss']:.4f}" if "loss" in values else "-"
        _log.info("job %s step %d loss %s grad_norm %.3g", job_id, step, loss, values.get("grad_norm", math.nan))

    # --- series --------------------------------------------------------------------------------
    def record(self, job_id: str, step: int, values: dict[str, float]) -> None:
        if values:
            store.put_job_metrics(self.db, job_id=job_id, step=step, values=values, at=time.time())

    def report(self, job_id: str, step: int, values: dict[str, float]) -> None:
        """Keep a client's values at ``step``, or :class:`ConflictError` naming the job's bound they would pass."""
        with self._reports:  # checked and counted as one, so concurrent reports cannot pass a bound together
            kept = store.reported_job_metrics(self.db, job_id=job_id)
            added = values.keys() - store.job_metric_names_at(self.db, job_id=job_id, step=step)
            self._check_room(job_id, kept, added)
            self.record(job_id, step, values)
            store.count_reported_job_metrics(self.db, job_id=job_id, names=added)

    def _check_room(self, job_id: str, kept: dict[str, int], added: set[str]) -> None:
        names = len(kept.keys() | added)
        if names > MAX_REPORTED_NAMES_PER_JOB:
            new = sorted(added - kept.keys())
            raise ConflictError(
                f"job {job_id} keeps at most {MAX_REPORTED_NAMES_PER_JOB} metric names its client reports, and "
                f"this report's new names ({', '.join(new[:3])}{', ...' if len(new) > 3 else ''}) would make "
                f"{names}: report under names the job already has, or start a new job"
            )
        values = sum(kept.values()) + len(added)
        if values > self.max_reported_values:
            raise ConflictError(
                f"job {job_id} keeps at most {self.max_reported_values:,} values its client reports "
                f"(--max-job-metric-values) and holds {values - len(added):,}: report fewer names or at fewer "
                "steps, log the rest with a client-side tracker, or start a new job"
            )

    def page(self, job_id: str, after_step: int) -> tuple[list[dict[str, Any]], int | None]:
        """The series' points past ``after_step``, one per step (``{step, time, <name>: value, ...}``, engine
        and client values merged), whole steps of at most :data:`SERIES_PAGE_VALUES` values in all; and
        the ``after_step`` of the next page, None when this one ends the series."""
        rows = store.job_metrics(self.db, job_id=job_id, after_step=after_step, limit=SERIES_PAGE_VALUES + 1)
        if len(rows) <= SERIES_PAGE_VALUES:
            return _points(rows), None
        cut = rows[SERIES_PAGE_VALUES]["step"]  # the step the page ends inside: it starts the next page
        whole = [row for row in rows if row["step"] < cut]
        if not whole:  # a step kept before the bounds existed holds more than a page: its first values only
            return _points(rows[:SERIES_PAGE_VALUES]), cut
        return _points(whole), whole[-1]["step"]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        """Jobs by state, queue depth per sub-job, chunk-store bytes per job and jobs per model host,
        read when scraped."""
        jobs = GaugeMetricFamily("icefloe_jobs", "Jobs by state.", labels=["state"])
        for row in self.db.fetch_all("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status"):
            jobs.add_metric([row["status"]], row["n"])
        queue = GaugeMetricFamily(
            "icefloe_queue_depth", "Requests pending or running, per sub-job.", labels=["job_id", "sub_job_id", "state"]
        )
        depth = Tally((row["job_id"], row["sub_job_id"], row["status"]) for row in self._open_requests())
        for key, count in sorted(depth.items()):
            queue.add_metric(list(key), count)
        chunks = GaugeMetricFamily(
            "icefloe_chunk_store_bytes", "Request-chunk bytes held for unfinished groups, per job.", labels=["job_id"]
        )
        for job_id, held in sorted(self._chunk_bytes().items()):
            chunks.add_metric([job_id], held)
        hosted = GaugeMetricFamily(
            "icefloe_host_jobs",
            "Jobs on each model host (a shared host: one LoRA adapter each).",
            labels=["host", "model"],
        )
        placed = GaugeMetricFamily(
            "icefloe_job_host", "1 for the model host each running job is on.", labels=["job_id", "host"]
        )
        for host, members in self._hosts():
            hosted.add_metric([host["host_id"], host["base_model"] or ""], host["num_jobs"])
            for job_id in members:
                placed.add_metric([job_id, host["host_id"]], 1)
        return [jobs, queue, chunks, hosted, placed]
