"""RoleWorker: strict FIFO order, coalescing of batchable items, errors, lifecycle."""

from __future__ import annotations

import threading
import time

import pytest

from icefloe.engines.worker import RoleWorker
from icefloe.protocol import ClientClosedError


@pytest.fixture
def worker():
    w = RoleWorker("test", linger_s=0.0)
    yield w
    w.close()


def _blocked(worker: RoleWorker) -> threading.Event:
    """Occupy the worker until the returned event is set, so later submissions queue up."""
    release, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(10)

    worker.submit(hold)
    assert started.wait(10)
    return release


def test_submit_runs_in_submission_order(worker):
    seen: list[int] = []
    futures = [worker.submit(lambda i=i: seen.append(i) or i * i) for i in range(50)]
    assert [f.result(10) for f in futures] == [i * i for i in range(50)]
    assert seen == list(range(50))


def test_submit_batchable_coalesces_consecutive_items_with_the_same_key(worker):
    calls: list[tuple[str, list[int]]] = []

    def run(tag):
        def run_batch(items):
            calls.append((tag, list(items)))
            return [item * 10 for item in items]

        return run_batch

    release = _blocked(worker)
    gen = [worker.submit_batchable("generate", i, run("g")) for i in range(4)]
    plain = worker.submit(lambda: "between")
    more = [worker.submit_batchable("generate", i, run("g")) for i in (7, 8)]
    other = worker.submit_batchable("other-key", 5, run("o"))
    release.set()
    assert [f.result(10) for f in gen] == [0, 10, 20, 30]
    assert plain.result(10) == "between"
    assert [f.result(10) for f in more] == [70, 80]
    assert other.result(10) == 50
    assert calls == [("g", [0, 1, 2, 3]), ("g", [7, 8]), ("o", [5])]


def test_submit_batchable_caps_the_batch_size():
    worker = RoleWorker("capped", linger_s=0.0, max_batch_items=2)
    sizes: list[int] = []
    release = _blocked(worker)
    futures = [worker.submit_batchable("k", i, lambda items: sizes.append(len(items)) or items) for i in range(5)]
    release.set()
    assert [f.result(10) for f in futures] == list(range(5))
    assert sizes == [2, 2, 1]
    worker.close()


def test_linger_collects_items_that_arrive_just_after_the_first():
    """With a long linger the first item waits for company until a different item queues behind it."""
    worker = RoleWorker("linger", linger_s=30.0)
    batches: list[list[int]] = []
    first = worker.submit_batchable("k", 1, lambda items: batches.append(list(items)) or items)
    second = worker.submit_batchable("k", 2, lambda items: batches.append(list(items)) or items)
    stopper = worker.submit(lambda: "done")
    assert stopper.result(10) == "done"
    assert first.result(10) == 1 and second.result(10) == 2
    assert batches == [[1, 2]]
    worker.close()


def test_exceptions_reach_the_futures(worker):
    def boom():
        raise ValueError("bad input")

    def bad_batch(items):
        raise RuntimeError(f"failed {len(items)}")

    assert isinstance(worker.submit(boom).exception(10), ValueError)
    release = _blocked(worker)
    futures = [worker.submit_batchable("k", i, bad_batch) for i in range(3)]
    release.set()
    assert [str(f.exception(10)) for f in futures] == ["failed 3"] * 3
    short = worker.submit_batchable("k", 1, lambda items: [])
    assert "returned 0 results for 1 items" in str(short.exception(10))
    assert worker.submit(lambda: "still alive").result(10) == "still alive"


def test_close_finishes_queued_work_is_idempotent_and_refuses_new_work():
    worker = RoleWorker("closing", linger_s=0.0)
    release = _blocked(worker)
    queued = worker.submit(lambda: "queued")
    release.set()
    worker.close()
    worker.close()
    assert queued.result(0) == "queued"
    assert worker.closed
    with pytest.raises(ClientClosedError, match="worker 'closing' is closed"):
        worker.submit(lambda: None)
    with pytest.raises(ClientClosedError):
        worker.submit_batchable("k", 1, lambda items: items)


def test_sync_gate_copies_between_earlier_and_later_work():
    from icefloe.engines.worker import SyncGate

    source, target = RoleWorker("source"), RoleWorker("target")
    events: list[str] = []
    try:
        release_first = threading.Event()
        target.submit(lambda: (release_first.wait(5), events.append("target-earlier")))
        gate = SyncGate(1)
        target.submit(gate.park)
        copied = source.submit(gate.run, lambda: events.append("copy") or "copied")
        later = target.submit(lambda: events.append("target-later"))
        release_first.set()
        assert copied.result(5) == "copied"
        later.result(5)
        assert events == ["target-earlier", "copy", "target-later"]
    finally:
        source.close()
        target.close()


def test_sync_gate_abandons_instead_of_hanging():
    from icefloe.engines.worker import SyncGate

    source = RoleWorker("source")
    reason: list[str] = []
    try:
        gate = SyncGate(1, abandoned=lambda: reason[0] if reason else None, tick_s=0.01)
        waiting = source.submit(gate.run, lambda: "never")
        reason.append("job stopped")
        with pytest.raises(ClientClosedError, match="job stopped"):
            waiting.result(5)
    finally:
        source.close()


def test_send_ahead_hands_the_next_op_over_while_the_one_before_runs_but_never_past_a_plain_job():
    events: list[tuple[str, str]] = []
    blocker, release = threading.Event(), threading.Event()
    worker = RoleWorker("ahead")

    def run(name: str) -> None:
        events.append(("run", name))

    def hold() -> None:
        blocker.set()
        release.wait(10)

    try:
        worker.submit(hold)  # keeps the queue below from being taken while it fills
        blocker.wait(10)
        ahead = {n: worker.submit_ahead(lambda n=n: events.append(("send", n)), run, n) for n in "ab"}
        plain = worker.submit(run, "c")  # a gate or a batch: nothing behind it goes early
        last = worker.submit_ahead(lambda: events.append(("send", "d")), run, "d")
        release.set()
        for future in [*ahead.values(), plain, last]:
            future.result(timeout=10)
    finally:
        worker.close()
    assert events == [
        ("send", "a"),
        ("send", "b"),  # while a runs
        ("run", "a"),
        ("run", "b"),
        ("run", "c"),
        ("send", "d"),
        ("run", "d"),
    ]


def test_ops_submitted_behind_ops_that_went_ahead_are_all_handed_over_at_once_in_order():
    """The engine must never wait for this thread between ops: with every job in front sent ahead,
    a new one is handed over when it is submitted, not when the job before it starts."""
    events: list[tuple[str, str]] = []
    running, release = threading.Event(), threading.Event()
    worker = RoleWorker("eager-ahead")

    def run(name: str) -> None:
        events.append(("run", name))
        if name == "a":
            running.set()
            release.wait(10)

    try:
        futures = [worker.submit_ahead(lambda: events.append(("send", "a")), run, "a")]
        running.wait(10)  # a computes; b, c, d come in now
        futures += [worker.submit_ahead(lambda n=n: events.append(("send", n)), run, n) for n in "bcd"]
        futures.append(worker.submit(run, "gate"))
        futures.append(worker.submit_ahead(lambda: events.append(("send", "e")), run, "e"))
        deadline = time.monotonic() + 10
        while ("send", "d") not in events and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events == [("send", "a"), ("run", "a"), ("send", "b"), ("send", "c"), ("send", "d")]
        release.set()
        for future in futures:
            future.result(timeout=10)
    finally:
        worker.close()
    assert events[5:] == [("run", "b"), ("run", "c"), ("run", "d"), ("run", "gate"), ("send", "e"), ("run", "e")]
