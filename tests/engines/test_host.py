"""The engine host: strict FIFO order per role, merging of batchable items, the sync gate, lifecycle."""

from __future__ import annotations

import threading
import time

import pytest

from icefloe.engines.host import EngineHost, Lane, SyncGate, Worker
from icefloe.protocol import ClientClosedError, InvalidRequestError


def _lane(name: str, *, linger_s: float = 0.002) -> Lane:
    """A lane on a worker of its own (close it with ``lane.worker.close()``)."""
    return Worker(name, linger_s=linger_s).lane(name)


@pytest.fixture
def worker():
    lane = _lane("test", linger_s=0.0)
    yield lane
    lane.worker.close()


def _blocked(worker: Lane) -> threading.Event:
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
    worker = _lane("linger", linger_s=30.0)
    batches: list[list[int]] = []
    first = worker.submit_batchable("k", 1, lambda items: batches.append(list(items)) or items)
    second = worker.submit_batchable("k", 2, lambda items: batches.append(list(items)) or items)
    stopper = worker.submit(lambda: "done")
    assert stopper.result(10) == "done"
    assert first.result(10) == 1 and second.result(10) == 2
    assert batches == [[1, 2]]
    worker.worker.close()


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
    worker = _lane("closing", linger_s=0.0)
    release = _blocked(worker)
    queued = worker.submit(lambda: "queued")
    release.set()
    worker.worker.close()
    worker.worker.close()
    assert queued.result(0) == "queued"
    assert worker.worker.closed
    with pytest.raises(ClientClosedError, match="worker 'closing' is closed"):
        worker.submit(lambda: None)
    with pytest.raises(ClientClosedError):
        worker.submit_batchable("k", 1, lambda items: items)


def test_sync_gate_copies_between_earlier_and_later_work():
    source, target = _lane("source"), _lane("target")
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
        source.worker.close()
        target.worker.close()


def test_sync_gate_abandons_instead_of_hanging():
    source = _lane("source")
    reason: list[str] = []
    try:
        gate = SyncGate(1, abandoned=lambda: reason[0] if reason else None, tick_s=0.01)
        waiting = source.submit(gate.run, lambda: "never")
        reason.append("job stopped")
        with pytest.raises(ClientClosedError, match="job stopped"):
            waiting.result(5)
    finally:
        source.worker.close()


def test_a_parked_gate_copies_after_earlier_work_on_every_worker_and_before_later_work():
    workers = {name: _lane(name, linger_s=0.0) for name in ("train", "a", "b")}
    events: list[str] = []
    release = threading.Event()
    try:
        workers["a"].submit(lambda: (release.wait(5), events.append("a-earlier")))
        for name in ("b", "train"):
            workers[name].submit(events.append, f"{name}-earlier")
        gate = SyncGate.parked([workers["a"], workers["b"]], source=workers["train"])
        copied = gate.submit(lambda: events.append("copy") or "copied")
        later = [worker.submit(events.append, f"{name}-later") for name, worker in workers.items()]
        release.set()
        assert copied.result(5) == "copied"
        for future in later:
            future.result(5)
    finally:
        for worker in workers.values():
            worker.worker.close()
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


def test_lanes_of_one_worker_take_turns():
    """A lane with a long queue does not hold back another lane's work: they alternate."""
    worker = Worker("turns", linger_s=0.0)
    busy, quiet = worker.lane("busy"), worker.lane("quiet")
    order: list[str] = []
    try:
        release = _blocked(busy)
        for i in range(5):
            busy.submit(order.append, f"busy{i}")
        done = [quiet.submit(order.append, f"quiet{i}") for i in range(2)]
        release.set()
        for future in done:
            future.result(10)
        busy.submit(lambda: None).result(10)
    finally:
        worker.close()
    assert order[:4] == ["quiet0", "busy0", "quiet1", "busy1"]


def test_batchable_items_heading_several_lanes_run_as_one_batch():
    worker = Worker("gather", linger_s=0.0)
    lanes = [worker.lane(f"run{i}") for i in range(3)]
    batches: list[list[str]] = []

    def run_batch(items):
        batches.append(list(items))
        return [item.upper() for item in items]

    try:
        release = _blocked(lanes[0])
        futures = [lane.submit_batchable("generate", f"r{i}", run_batch) for i, lane in enumerate(lanes)]
        behind = lanes[1].submit_batchable("generate", "r1b", run_batch)
        after = lanes[2].submit(lambda: "plain")
        release.set()
        assert [f.result(10) for f in futures] == ["R0", "R1", "R2"]
        assert behind.result(10) == "R1B" and after.result(10) == "plain"
    finally:
        worker.close()
    assert batches == [["r1", "r1b", "r0", "r2"]]  # the lane whose turn it is first, then the others' heads


def test_a_key_with_a_linger_of_its_own_waits_for_company_on_an_idle_worker():
    """Sample calls sent one by one to an idle host decoded one at a time: the key lingers, others do not."""
    worker = Worker("linger", linger_s=0.0, lingers={"sample": 30.0})
    lanes = [worker.lane(f"run{i}") for i in range(2)]
    batches: list[list[str]] = []

    def run_batch(items):
        batches.append(list(items))
        return items

    try:
        first = lanes[0].submit_batchable("sample", "s0", run_batch)
        second = lanes[1].submit_batchable("sample", "s1", run_batch)  # arrives while the first lingers
        lanes[1].submit(lambda: None).result(10)  # other work queued: the linger ends at once
        assert (first.result(10), second.result(10)) == ("s0", "s1")
        alone = lanes[0].submit_batchable("fwd_bwd", "f0", run_batch)  # no linger of its own: runs at once
        assert alone.result(10) == "f0"
    finally:
        worker.close()
    assert batches == [["s0", "s1"], ["f0"]]


def test_quick_items_go_first_so_that_the_batchable_ones_behind_them_batch():
    """Each run syncs, then generates: the syncs run first and the generates run as one batch, not
    each alone as its run's sync frees it."""
    worker = Worker("quick-first", linger_s=0.0)
    lanes = [worker.lane(f"run{i}") for i in range(3)]
    order: list[str] = []

    def run_batch(items):
        order.append("+".join(items))
        return items

    try:
        release = _blocked(lanes[0])  # lanes[1] has the next turn, and its generate is ready
        futures = [lanes[1].submit_batchable("generate", "g1", run_batch)]
        for i in (2, 0):
            lanes[i].submit(order.append, f"sync{i}")
            futures.append(lanes[i].submit_batchable("generate", f"g{i}", run_batch))
        release.set()
        assert [f.result(10) for f in futures] == ["g1", "g2", "g0"]
    finally:
        worker.close()
    assert order == ["sync2", "sync0", "g1+g0+g2"]  # the lane whose turn it is first, then the others in order


def test_a_ready_batchable_item_waits_at_most_one_turn_per_lane():
    worker = Worker("bounded", linger_s=0.0)
    busy, other, batching = worker.lane("busy"), worker.lane("other"), worker.lane("batching")
    order: list[str] = []
    try:
        release = _blocked(busy)
        for i in range(10):
            busy.submit(order.append, f"busy{i}")
            other.submit(order.append, f"other{i}")
        done = batching.submit_batchable("generate", "g", lambda items: [order.append(items[0])])
        release.set()
        done.result(10)
        busy.submit(lambda: None).result(10)
        other.submit(lambda: None).result(10)
    finally:
        worker.close()
    assert order.index("g") <= 3  # passed over by one item of each lane (three lanes), then it runs


def test_a_gate_within_one_worker_copies_between_earlier_and_later_work_of_every_lane():
    """Trainer and sampler lanes of a shared base sit on one worker: the copy waits for the sampler's
    earlier work without parking the thread it needs itself."""
    worker = Worker("shared", linger_s=0.0)
    train, sample = worker.lane("train"), worker.lane("sample")
    events: list[str] = []
    try:
        release = _blocked(train)
        sample.submit(events.append, "sample-earlier")
        gate = SyncGate.parked([sample], source=train)
        copied = gate.submit(lambda: events.append("copy") or "copied")
        later = [lane.submit(events.append, f"{lane.name}-later") for lane in (sample, train)]
        release.set()
        assert copied.result(10) == "copied"
        for future in later:
            future.result(10)
    finally:
        worker.close()
    assert events.index("copy") > events.index("sample-earlier")
    assert events.index("copy") < min(events.index("sample-later"), events.index("train-later"))


def test_closing_a_lane_waits_for_its_work_and_leaves_the_worker_running():
    worker = Worker("close-lane", linger_s=0.0)
    first, second = worker.lane("first"), worker.lane("second")
    try:
        release = _blocked(first)
        queued = first.submit(lambda: "ran")
        threading.Timer(0.05, release.set).start()
        first.close()
        assert queued.result(0) == "ran"
        with pytest.raises(ClientClosedError, match="lane 'first' is closed"):
            first.submit(lambda: None)
        assert second.submit(lambda: "still running").result(10) == "still running"
    finally:
        worker.close()


def _sliced(order: list[str], name: str, num_slices: int):
    """Work in ``num_slices`` slices, each noted in ``order``; returns ``name``."""
    for index in range(num_slices):
        order.append(f"{name}{index}")
        yield
    return name


def test_work_in_slices_lets_another_lanes_item_run_after_one_slice():
    """A long op held the worker to its end: a small op of another run waited for all of it."""
    worker = Worker("slices", linger_s=0.0)
    long, small = worker.lane("long"), worker.lane("small")
    order: list[str] = []
    try:
        release = _blocked(small)  # the long lane has the next turn
        done = long.submit(_sliced, order, "long", 5)
        answered = small.submit(order.append, "small")
        release.set()
        assert done.result(10) == "long" and answered.result(10) is None
    finally:
        worker.close()
    assert order == ["long0", "small", "long1", "long2", "long3", "long4"]


def test_a_lanes_next_item_waits_for_its_sliced_item_to_finish():
    worker = Worker("order", linger_s=0.0)
    lane = worker.lane("run")
    order: list[str] = []
    try:
        release = _blocked(lane)
        first = lane.submit(_sliced, order, "first", 3)
        second = lane.submit(order.append, "second")
        release.set()
        assert first.result(10) == "first" and second.result(10) is None
    finally:
        worker.close()
    assert order == ["first0", "first1", "first2", "second"]


def test_a_batch_in_slices_answers_each_item_when_it_finishes_and_frees_its_lane():
    """A small sample that joined a long decode batch was answered, and its run went on, only at the batch's end."""
    worker = Worker("batch-slices", linger_s=0.0)
    big, small = worker.lane("big"), worker.lane("small")
    order: list[str] = []

    def run_batch(items):
        assert sorted(items) == ["big", "small"]  # the small lane leads: the batch is its to resume first
        order.append("slice0")
        yield {items.index("small"): "SMALL"}  # the small item's rows end in the first slice
        for index in range(1, 4):
            order.append(f"slice{index}")
            yield None
        return [item.upper() if item == "big" else "settled already" for item in items]

    try:
        release = _blocked(big)
        futures = [lane.submit_batchable("generate", lane.name, run_batch) for lane in (big, small)]
        after = small.submit(order.append, "small-next")
        release.set()
        assert futures[1].result(10) == "SMALL" and futures[0].result(10) == "BIG"
        after.result(10)
    finally:
        worker.close()
    assert order.index("small-next") < order.index("slice3")


def test_an_error_in_a_later_slice_fails_the_items_not_yet_answered():
    worker = Worker("slice-error", linger_s=0.0)
    lanes = [worker.lane(name) for name in ("a", "b")]

    def run_batch(items):
        yield {items.index("a"): "a-done"}
        raise RuntimeError("the engine crashed")

    try:
        release = _blocked(lanes[0])
        futures = [lane.submit_batchable("generate", lane.name, run_batch) for lane in lanes]
        release.set()
        assert futures[0].result(10) == "a-done"
        with pytest.raises(RuntimeError, match="the engine crashed"):
            futures[1].result(10)
        assert lanes[1].submit(lambda: "goes on").result(10) == "goes on"
    finally:
        worker.close()


def test_turns_go_round_tenants_then_each_tenants_lanes():
    """One tenant with two runs gets half of the worker, the other tenant's one run the other half."""
    worker = Worker("tenants", linger_s=0.0)
    first = worker.lane("first", group="tenant-a")
    second = worker.lane("second", group="tenant-a")
    other = worker.lane("other", group="tenant-b")
    blocker = worker.lane("blocker", group="tenant-z")
    order: list[str] = []
    try:
        release = _blocked(blocker)
        futures = [lane.submit(_sliced, order, lane.name, 4) for lane in (first, second, other)]
        release.set()
        for future in futures:
            future.result(10)
    finally:
        worker.close()
    assert [name.rstrip("0123456789") for name in order[:8]] == ["first", "other", "second", "other"] * 2


def _slow_sliced(order: list[str], name: str, num_slices: int, slice_s: float):
    """:func:`_sliced` with slices that take ``slice_s`` each."""
    for index in range(num_slices):
        order.append(f"{name}{index}")
        time.sleep(slice_s)
        yield
    return name


def test_a_run_of_small_items_gets_as_much_time_as_a_run_of_long_slices():
    """Turns counted items, not time: each small op of one run waited for a whole slice of another's."""
    worker = Worker("time", linger_s=0.0)
    long, small = worker.lane("long", group="a"), worker.lane("small", group="b")
    blocker = worker.lane("blocker", group="z")
    order: list[str] = []
    try:
        release = _blocked(blocker)
        done = long.submit(_slow_sliced, order, "long", 3, 0.1)  # slices of four turns each
        # batchable, as a forward-backward is (a quick item would go first anyway); keys that never batch
        answered = [small.submit_batchable(i, f"small{i}", lambda items: [order.extend(items)] * len(items))
                    for i in range(3)]  # fmt: skip
        release.set()
        for future in [done, *answered]:
            future.result(10)
    finally:
        worker.close()
    assert order == ["long0", "small0", "small1", "small2", "long1", "long2"]


def test_a_run_behind_in_time_is_awaited_a_moment_for_its_next_item():
    """A client that sends its next small op once the last is answered found another run's slice
    started in between, and waited for all of it, every time."""
    worker = Worker("anticipate", linger_s=0.0, anticipate_s=5.0)
    long, small = worker.lane("long", group="a"), worker.lane("small", group="b")
    order: list[str] = []
    try:
        done = long.submit(_slow_sliced, order, "long", 20, 0.06)
        while not order:  # the long op ran a slice: the small run is behind in time
            time.sleep(0.005)
        small.submit(order.append, "small0").result(10)
        time.sleep(0.02)  # the client reads the answer, then sends its next op
        small.submit(order.append, "small1").result(10)
        done.result(10)
    finally:
        worker.close()
    assert order.index("small1") == order.index("small0") + 1


def test_a_gate_waits_for_a_target_lane_whose_sliced_work_is_unfinished():
    """A weight copy must not land between two decode steps of a sample on its target."""
    worker = Worker("gate-slices", linger_s=0.0)
    train, sample = worker.lane("train"), worker.lane("sample")
    order: list[str] = []
    try:
        release = _blocked(train)
        rollout = sample.submit(_sliced, order, "decode", 4)
        gate = SyncGate.parked([sample], source=train)
        copied = gate.submit(lambda: order.append("copy"))
        release.set()
        rollout.result(10)
        copied.result(10)
    finally:
        worker.close()
    assert order == ["decode0", "decode1", "decode2", "decode3", "copy"]
