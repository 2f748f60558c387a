"""The engine host: strict FIFO order per role, merging of batchable items, the sync gate, lifecycle."""

from __future__ import annotations

import threading

import pytest

from icefloe.engines.host import EngineHost, RoleWorker, SyncGate
from icefloe.protocol import ClientClosedError, InvalidRequestError


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


def test_a_parked_gate_copies_after_earlier_work_on_every_worker_and_before_later_work():
    workers = {name: RoleWorker(name, linger_s=0.0) for name in ("train", "a", "b")}
    events: list[str] = []
    release = threading.Event()
    try:
        workers["a"].submit(lambda: (release.wait(5), events.append("a-earlier")))
        for name in ("b", "train"):
            workers[name].submit(events.append, f"{name}-earlier")
        gate = SyncGate.parked([workers["a"], workers["b"]])
        copied = workers["train"].submit(gate.run, lambda: events.append("copy") or "copied")
        later = [worker.submit(events.append, f"{name}-later") for name, worker in workers.items()]
        release.set()
        assert copied.result(5) == "copied"
        for future in later:
            future.result(5)
    finally:
        for worker in workers.values():
            worker.close()
    assert events.index("copy") > max(events.index(e) for e in ("a-earlier", "b-earlier", "train-earlier"))
    assert events.index("copy") < min(events.index(e) for e in ("a-later", "b-later", "train-later"))


def test_engine_host_answers_bad_requests_on_the_future_without_blocking(tmp_path):
    from icefloe.protocol import OP_FORWARD, OP_GENERATE, OP_LIST_CHECKPOINTS, TARGET_REFERENCE, Request

    host = EngineHost({"training": object(), "sampling": None}, checkpoint_root=tmp_path)
    try:
        generate = host.submit(Request(OP_GENERATE, "sampling", {"prompts": [[1]], "sampling_params": {}}))
        with pytest.raises(InvalidRequestError, match="generate needs a sampling role; set num_sampling_workers"):
            generate.result(0)
        reference = host.submit(Request(OP_FORWARD, TARGET_REFERENCE, {"batch": {}}))
        with pytest.raises(InvalidRequestError, match="num_log_prob_workers=1"):
            reference.result(0)
        assert host.submit(Request(OP_LIST_CHECKPOINTS, "job", {})).result(0) == {"checkpoints": []}
    finally:
        host.close()
