"""The job state table (icefloe.service.lifecycle) on a real SQLite store and job log."""

from __future__ import annotations

import pytest

from icefloe.protocol import ConflictError
from icefloe.service import store
from icefloe.service.joblog import JobLog
from icefloe.service.lifecycle import JobState


@pytest.fixture
def job(tmp_path):
    db = store.Database(tmp_path / "db.sqlite3")
    store.insert_job(db, job_id="j", status="pending", spec={}, owner="default")
    log = JobLog(tmp_path / "logs", ["j:training:0"])
    yield JobState("j", db, log), db, log
    db.close()


def _recorded(db, log) -> tuple[str, str, list[str]]:
    row = store.get_job(db, job_id="j")
    entries = log.tail("j:training:0", cursor=None, max_lines=100)["entries"]
    return row["status"], row["reason"], [e["msg"] for e in entries]


def test_a_cancelled_job_walks_to_terminated_and_every_move_is_recorded(job):
    state, db, log = job
    assert state.advance("placing") and state.advance("initializing") and state.advance("running")
    assert state.cancel() == "cancelling" and state.cancel() == "cancelling"  # idempotent
    assert not state.advance("running")  # the job's thread sees the stop instead
    state.finish()
    status, _, messages = _recorded(db, log)
    assert status == state.status == "terminated"
    assert messages == [f"job is {s}" for s in ("placing", "initializing", "running", "cancelling", "cancelled",
                                                 "terminated")]  # fmt: skip


def test_a_failure_from_any_state_ends_failed_with_its_reason(job):
    state, db, log = job
    state.advance("placing")
    state.fail("initializing failed: OSError: no such model")
    state.cancel()  # a cancel after the failure changes nothing
    state.finish()
    assert _recorded(db, log)[:2] == ("failed", "initializing failed: OSError: no such model")


def test_a_finished_job_refuses_a_cancel_naming_its_state(job):
    state, _, _ = job
    state.fail("crashed")
    state.finish()
    with pytest.raises(ConflictError, match="job j is failed"):
        state.cancel()


def test_a_shutdown_stops_the_job_and_records_nothing(job):
    state, db, log = job
    state.advance("placing")
    state.shut_down()
    state.fail("too late")  # the shutdown came first: its outcome stands
    state.finish()
    assert state.stop.is_set() and _recorded(db, log)[0] == "placing"
