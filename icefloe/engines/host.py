"""The one engine host: lanes -> workers -> weight-sync gate, and the op table.

Every op for a role (an engine, or a service sub-job) runs on that role's :class:`Lane`, an
ordered queue: requests to it run strictly in the order they were handed in. A :class:`Worker` is
the one thread that runs the lanes of one engine (or of one shared base model and every run on
it), so an engine is only ever touched by one thread. Lanes take turns, so no run waits behind
another's long queue, and batchable work queued at the same time in several lanes (generates)
runs as one engine batch. A weight copy from a trainer to its samplers goes through a
:class:`SyncGate`: it runs after all work queued earlier on every lane it touches and before any
work queued later.

The service keeps one lane per sub-job on its model host's workers and a gate per weight-sync.
:class:`EngineHost` maps roles to lanes and routes the op table (``protocol.ENGINE_CALLS``), for
the transports whose roles are engine objects with the engine method names (``local``: torch
engines; ``ray``: actor groups).
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icefloe import protocol
from icefloe.protocol import ENGINE_CALLS, ClientClosedError, InvalidRequestError, NotFoundError, Request

__all__ = ["EngineHost", "Lane", "SyncGate", "Work", "Worker"]

_BLOCKED_TICK_S = 0.05  # how often a worker re-checks work held by a gate whose state another thread changes
# Lanes (and groups) whose use of a worker differs by less than a turn take plain turns; one a turn
# or more behind goes first, but counts as at most _CATCH_UP_S behind the busiest lane with work.
_TURN_S = 0.025
_CATCH_UP_S = 1.0


@dataclass
class Work:
    """One entry of a lane: a call to run (``fn``), a batchable item (``key``, ``item``, ``run_batch``), or
    a marker that only holds its place; its result or exception lands on ``future``."""

    future: Future = field(default_factory=Future)
    fn: Callable[..., Any] | None = None  # None: a marker that only holds its place
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    key: Hashable | None = None  # set: a batchable item
    item: Any = None
    run_batch: Callable[[list[Any]], Sequence[Any] | Generator[Any, None, Any]] | None = None
    ready: Callable[[], bool] | None = None  # None: runnable once at the head of its lane
    lane: Lane | None = None  # set when queued


@dataclass
class _Suspended:
    """Work that returned a generator, between two of its slices: the jobs it runs and those not yet settled."""

    steps: Generator[Any, None, Any]
    jobs: list[Work]
    settled: set[int] = field(default_factory=set)
    finished: bool = False

    def pending_lanes(self) -> list[Lane]:
        lanes = [job.lane for index, job in enumerate(self.jobs) if index not in self.settled]
        return list(dict.fromkeys(lane for lane in lanes if lane is not None))


class Lane:
    """One ordered queue of a :class:`Worker`: its items run strictly in submission order.

    ``group``: lanes of one group (a tenant) share one turn among the worker's groups."""

    def __init__(self, worker: Worker, name: str, group: Hashable = None) -> None:
        self.worker = worker
        self.name = name
        self.group = group
        self.queue: deque[Work] = deque()
        self.busy = False  # an item of this lane is running
        self.used_s = 0.0  # the worker's time this lane's work took (a batch's shared by its lanes)
        self.held: _Suspended | None = None  # a suspended item of this lane waits for its next slice
        self.resume: _Suspended | None = None  # ... and this lane's turn runs that slice
        self.closed = False

    def put(self, work: Work) -> Future:
        """Queue ``work`` (see :meth:`submit`, :meth:`submit_when`, :meth:`submit_batchable`); returns its future."""
        worker = self.worker
        with worker._cond:
            if worker._closed:
                raise ClientClosedError(f"worker {worker.name!r} is closed; no new work is accepted")
            if self.closed:
                raise ClientClosedError(f"lane {self.name!r} is closed; no new work is accepted")
            work.lane = self
            self.queue.append(work)
            worker._cond.notify_all()
        return work.future

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Queue ``fn(*args, **kwargs)``; its result or exception lands on the returned future.

        If ``fn`` returns a generator, each ``next()`` is one slice of its work: between slices the
        worker runs the other lanes' work (this lane's next item waits), and the generator's return
        value is the result."""
        return self.put(Work(fn=fn, args=args, kwargs=kwargs))

    def submit_when(self, ready: Callable[[], bool], fn: Callable[..., Any], /, *args: Any) -> Future:
        """Queue ``fn(*args)`` as :meth:`submit` does, to start only once ``ready()`` holds when it heads
        the lane (other lanes run meanwhile); ``ready`` is polled under the worker's lock: keep it a quick read."""
        return self.put(Work(fn=fn, args=args, ready=ready))

    def submit_batchable(
        self, key: Hashable, item: Any, run_batch: Callable[[list[Any]], Sequence[Any] | Generator[Any, None, Any]]
    ) -> Future:
        """Queue ``item``; items with the same ``key`` queued right behind it, or heading other lanes of
        the worker, run in one ``run_batch(items)`` call, which returns one result per item, in order.
        The key must name what ``run_batch`` does: any item's ``run_batch`` may run the whole batch.

        ``run_batch`` may instead return a generator that runs the batch a slice per ``next()``: each
        yields ``{index: result}`` for the items that finished meanwhile (settled at once, and their
        lanes go on), and it returns the list of all results (those not yielded are settled from it)."""
        return self.put(Work(key=key, item=item, run_batch=run_batch))

    def close(self) -> None:
        """Refuse new work and wait until what is queued has run. Idempotent."""
        self.worker._close_lane(self)


class Worker:
    """A daemon thread that runs the items of its lanes, each lane strictly in submission order.

    Turns go round the lanes' groups (tenants), and within a group round its lanes (runs), so each
    gets a fair share of the thread: work that comes as slices (see :meth:`Lane.submit`) takes one
    slice per turn, so a small item of one lane waits for about one slice of each other's. Turns
    count time: a group (and within it a lane) that has used a turn (:data:`_TURN_S`) less of the
    thread than another goes first, so a run of small ops gets as much time as a run of long slices, not one op
    per slice.

    Args:
        name: names the thread (``icefloe-<name>``) and appears in errors.
        linger_s: how long a batchable item waits for same-key company when nothing else is
            queued; 0 = never wait.
        lingers: the linger of these batch keys, in place of ``linger_s``.
        anticipate_s: how long a lane whose item just finished, and which is behind in time, keeps
            the worker waiting for its next item before the next slice of another's long op runs (a
            client that sends its next op once the last is answered); 0 = never wait.
    """

    def __init__(
        self,
        name: str,
        *,
        linger_s: float = 0.002,
        lingers: Mapping[Hashable, float] | None = None,
        anticipate_s: float = 0.0,
    ) -> None:
        self.name = name
        self.linger_s = linger_s
        self.lingers = dict(lingers or {})
        self.anticipate_s = anticipate_s
        self._group_used: dict[Hashable, float] = {}  # the worker's time each group's work took
        self._answered: dict[Lane, float] = {}  # lanes left empty by their last item, and when
        self._wake_at: float | None = None  # when an anticipated lane stops holding the worker
        self._lanes: list[Lane] = []
        self._last_group: Hashable = None  # the group served last: the search for ready work starts after it
        self._last_lane: dict[Hashable, Lane] = {}  # per group, its lane served last
        self._passed = 0  # items taken in a row ahead of a ready batchable one
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"icefloe-{name}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def lane(self, name: str, *, group: Hashable = None) -> Lane:
        """A new lane of this worker, in ``group`` (lanes of one group share a turn)."""
        with self._cond:
            if self._closed:
                raise ClientClosedError(f"worker {self.name!r} is closed; no new work is accepted")
            lane = Lane(self, name, group)
            self._lanes.append(lane)
            return lane

    def close(self) -> None:
        """Refuse new work, finish what is queued on every lane, stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            for lane in self._lanes:
                lane.closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def poke(self) -> None:
        """Re-check held work now (a gate it waits on changed)."""
        with self._cond:
            self._cond.notify_all()

    def _close_lane(self, lane: Lane) -> None:
        with self._cond:
            lane.closed = True
            self._cond.notify_all()
            if threading.current_thread() is self._thread:
                return
            while lane.queue or lane.busy or lane.held is not None:
                if not self._thread.is_alive():
                    return
                self._cond.wait(_BLOCKED_TICK_S)
            if lane in self._lanes:
                self._lanes.remove(lane)

    def _run(self) -> None:
        while True:
            with self._cond:
                while (taken := self._take()) is None:
                    if self._closed and not any(lane.queue or lane.held for lane in self._lanes):
                        return  # closed and drained
                    held = any(lane.queue for lane in self._lanes)  # only work held by a gate is left
                    timeout = _BLOCKED_TICK_S if held else None
                    if self._wake_at is not None:  # an anticipated lane holds the worker until then
                        left = max(0.0, self._wake_at - time.monotonic())
                        timeout, self._wake_at = min(left, timeout if timeout is not None else left), None
                    self._cond.wait(timeout)
            suspended = None
            started = time.monotonic()
            try:
                if isinstance(taken, _Suspended):
                    suspended = _step(taken)
                elif taken[0].run_batch is None:
                    suspended = _run_one(taken[0])
                else:
                    suspended = _settle_batch(taken)
            finally:
                with self._cond:
                    for lane in self._lanes:
                        lane.busy = False
                        if lane.held is suspended:  # its slice ran: held again below while it has more
                            lane.held = lane.resume = None
                    if suspended is not None and not suspended.finished:
                        # Its unsettled jobs' lanes wait for its next slice, which the first of them runs at its turn.
                        pending = suspended.pending_lanes()
                        for lane in pending:
                            lane.held = suspended
                        pending[0].resume = suspended
                    jobs = taken.jobs if isinstance(taken, _Suspended) else taken
                    self._charge([job.lane for job in jobs if job.lane is not None], started)
                    self._cond.notify_all()

    def _charge(self, lanes: list[Lane], started: float) -> None:
        """Count the time since ``started`` to ``lanes`` (and their groups), in equal shares; note the ones
        left with nothing to run. Called under the lock."""
        lanes = list(dict.fromkeys(lanes))
        now = time.monotonic()
        share = (now - started) / max(1, len(lanes))
        for lane in lanes:
            lane.used_s += share
            self._group_used[lane.group] = self._group_used.get(lane.group, 0.0) + share
            if self.anticipate_s and not lane.queue and lane.held is None:
                self._answered[lane] = now

    def _take(self) -> list[Work] | _Suspended | None:
        """The next ready work in fair turns (with its batch company), or a suspended item's next slice;
        None: none ready.

        Ready items that cannot batch go first (a step or a weight sync is quick, and the batchable
        item it holds back then joins the next batch), but a ready batchable item or a slice is passed
        over at most once per lane before it runs. Called under the lock."""
        standing = self._standings()
        ready = sorted(
            (lane for lane in self._fair_order() if lane.resume is not None or _head_ready(lane)), key=standing
        )  # stable: lanes of one standing keep their turn order
        if not ready or (ready[0].resume is not None and self._anticipating(standing, standing(ready[0]))):
            return None  # none ready, or a long op's next slice waits a moment for a run behind it
        lanes = self._lanes
        lane = ready[0]
        if self._passed < len(lanes):
            lane = next((lane for lane in ready if _quick(lane)), lane)
        others_wait = any(not _quick(other) for other in ready if other is not lane)
        self._passed = self._passed + 1 if others_wait and _quick(lane) else 0
        self._last_group, self._last_lane[lane.group] = lane.group, lane
        lane.busy = True
        if lane.resume is not None:
            return lane.resume
        head = lane.queue.popleft()
        if head.run_batch is None:
            return [head]
        return [head, *self._company(lane, head.key)]

    def _standings(self) -> Callable[[Lane], tuple[int, int]]:
        """How far ahead in time a lane's group, then the lane itself, is, in turns of :data:`_TURN_S`
        (lower goes first); never more than :data:`_CATCH_UP_S` behind the busiest with work, so one
        that idled a long time gets back a fair share, not the whole worker. Called under the lock."""
        active = [lane for lane in self._lanes if lane.queue or lane.held is not None or lane.busy]
        top_lane = max((lane.used_s for lane in active), default=0.0) - _CATCH_UP_S
        top_group = max((self._group_used.get(lane.group, 0.0) for lane in active), default=0.0) - _CATCH_UP_S

        def standing(lane: Lane) -> tuple[int, int]:
            group = max(self._group_used.get(lane.group, 0.0), top_group)
            return int(group // _TURN_S), int(max(lane.used_s, top_lane) // _TURN_S)

        return standing

    def _anticipating(self, standing: Callable[[Lane], tuple[int, int]], first: tuple[int, int]) -> bool:
        """Whether a lane behind ``first`` (the standing of the work that would run) was left empty by its
        item less than ``anticipate_s`` ago: then its next item is awaited that long. Called under the lock."""
        now = time.monotonic()
        for lane, at in list(self._answered.items()):
            if now - at >= self.anticipate_s or lane.queue or lane.held is not None or lane.closed:
                del self._answered[lane]
            elif not self._closed and standing(lane) < first:
                self._wake_at = at + self.anticipate_s
                return True
        return False

    def _fair_order(self) -> list[Lane]:
        """The lanes in turn order: groups round-robin from the one after the group served last, and in
        each group its lanes from the one after its lane served last."""
        groups: dict[Hashable, list[Lane]] = {}
        for lane in self._lanes:
            groups.setdefault(lane.group, []).append(lane)
        names = list(groups)
        first = names.index(self._last_group) + 1 if self._last_group in groups else 0
        order: list[Lane] = []
        for group in names[first:] + names[:first]:
            members = groups[group]
            last = self._last_lane.get(group)
            start = members.index(last) + 1 if last in members else 0
            order += members[start:] + members[:start]
        return order

    def _company(self, first: Lane, key: Hashable) -> list[Work]:
        """Items with ``key`` right behind the head of ``first`` and heading the other free lanes (after
        a short linger when nothing else is queued). Called under the lock."""
        company: list[Work] = []
        deadline = time.monotonic() + self.lingers.get(key, self.linger_s)
        while True:
            for lane in [first, *(other for other in self._lanes if other is not first and other.held is None)]:
                while lane.queue and lane.queue[0].key == key and lane.queue[0].run_batch is not None:
                    if not _head_ready(lane):
                        break
                    company.append(lane.queue.popleft())
                    lane.busy = True
            remaining = deadline - time.monotonic()
            waiting = any(lane.queue or lane.resume is not None for lane in self._lanes)  # no linger then
            if waiting or self._closed or remaining <= 0:
                return company
            self._cond.wait(remaining)


def _head_ready(lane: Lane) -> bool:
    """The lane is not held by a suspended item, and its head may start (``ready``, where it has one, holds)."""
    return lane.held is None and bool(lane.queue) and (lane.queue[0].ready is None or lane.queue[0].ready())


def _quick(lane: Lane) -> bool:
    """The lane's turn would run a fresh item that cannot batch (not a batchable one, nor a slice)."""
    return lane.resume is None and lane.queue[0].run_batch is None


def _run_one(job: Work) -> _Suspended | None:
    if not job.future.set_running_or_notify_cancel():
        return None
    try:
        result = job.fn(*job.args, **job.kwargs) if job.fn is not None else None
    except BaseException as exc:
        job.future.set_exception(exc)
        return None
    if inspect.isgenerator(result):
        return _step(_Suspended(result, [job]))
    job.future.set_result(result)
    return None


def _settle_batch(jobs: list[Work]) -> _Suspended | None:
    """Run ``jobs`` as one batch (those cancelled before they started never run); a batch refused for a
    caller's input runs again job by job, so the bad input fails only its own caller, with a message in
    that caller's terms (its own ``prompts[i]``). Returns the batch if it came as a generator and has
    slices left."""
    # A job already running is one run again alone.
    jobs = [job for job in jobs if job.future.running() or job.future.set_running_or_notify_cancel()]
    if not jobs:
        return None
    assert jobs[0].run_batch is not None
    try:
        outcome = jobs[0].run_batch([job.item for job in jobs])
        if inspect.isgenerator(outcome):
            return _step(_Suspended(outcome, jobs))
        results = list(outcome)
        if len(results) != len(jobs):
            raise RuntimeError(f"run_batch returned {len(results)} results for {len(jobs)} items")
    except InvalidRequestError as exc:
        if len(jobs) == 1:
            jobs[0].future.set_exception(exc)
        else:
            for job in jobs:
                _settle_batch([job])
        return None
    except BaseException as exc:
        for job in jobs:
            job.future.set_exception(exc)
        return None
    for job, result in zip(jobs, results, strict=True):
        job.future.set_result(result)
    return None


def _step(work: _Suspended) -> _Suspended:
    """Run one slice of ``work`` and settle the jobs it finished; a generator's error fails every job
    it has not settled (its batch is not run again job by job: some of it has run)."""
    batch = work.jobs[0].run_batch is not None
    try:
        done = next(work.steps)
    except StopIteration as stop:
        work.finished = True
        results = list(stop.value) if batch else [stop.value]
        for index, job in enumerate(work.jobs):
            if index not in work.settled:
                job.future.set_result(results[index] if index < len(results) else None)
    except BaseException as exc:
        work.finished = True
        for index, job in enumerate(work.jobs):
            if index not in work.settled:
                job.future.set_exception(exc)
    else:
        for index, result in (done or {}).items() if batch else ():
            if index not in work.settled:
                work.settled.add(index)
                work.jobs[index].future.set_result(result)
    return work


class SyncGate:
    """Lines a copy from a source lane up with its target lanes.

    The copy runs after all work queued earlier on the source and every target and before any work
    queued later, and no target runs anything while the copy reads or writes its engine. A target
    on another worker parks that worker's thread (:meth:`park`); a target on the source's own
    worker holds its lane with a marker, and the copy starts once every marker heads its lane.

    Args:
        num_targets: how many ``park`` calls ``run`` waits for.
        abandoned: polled while waiting; a non-empty string (the reason) stops the wait, so a job
            that is shutting down never leaves a worker parked forever.
    """

    def __init__(
        self, num_targets: int, *, abandoned: Callable[[], str | None] = lambda: None, tick_s: float = _BLOCKED_TICK_S
    ) -> None:
        self._num_targets = num_targets
        self._abandoned = abandoned
        self._tick_s = tick_s
        self._num_parked = 0
        self._cond = threading.Condition()
        self._released = threading.Event()
        self._source: Lane | None = None
        self._markers: list[tuple[Lane, Work]] = []

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
            reason = self._abandoned()
            if reason:
                raise ClientClosedError(f"weight sync abandoned: {reason}")
            return copy()
        finally:
            self.release()

    def release(self) -> None:
        """Free the targets without copying (the copy could not be queued), or after it."""
        self._released.set()
        if self._source is not None:
            self._source.worker.poke()

    def submit(self, copy: Callable[[], Any]) -> Future:
        """Queue ``self.run(copy)`` on the source lane given to :meth:`parked` (see there)."""
        assert self._source is not None, "use SyncGate.parked(..., source=lane)"
        return self._source.submit_when(self.may_start, self.run, copy)

    def may_start(self) -> bool:
        """Every target on the source's worker holds its place at the head of its lane (or the job stopped)."""
        return all(
            lane.held is None and lane.queue and lane.queue[0] is marker for lane, marker in self._markers
        ) or bool(self._abandoned())

    @classmethod
    def parked(
        cls, targets: Sequence[Lane], *, source: Lane, abandoned: Callable[[], str | None] = lambda: None
    ) -> SyncGate:
        """A gate whose targets are held in place; queue the copy next with ``gate.submit(copy)``, or
        call ``gate.release()`` if that fails."""
        others = [lane for lane in targets if lane.worker is not source.worker]
        gate = cls(len(others), abandoned=abandoned)
        gate._source = source
        for lane in others:
            lane.submit(gate.park)
        for lane in targets:
            if lane.worker is source.worker:
                marker = Work(ready=lambda: gate._released.is_set() or bool(gate._abandoned()))
                lane.put(marker)
                gate._markers.append((lane, marker))
        return gate


_MISSING_ROLE = {
    "reference": "forward(reference=True) needs a reference role; set num_log_prob_workers=1 in the config",
    "sampling": "{op} needs a sampling role; set num_sampling_workers=1 in the config",
}


class EngineHost:
    """Routes each request to its role's engine through that role's ordered worker.

    Args:
        engines: role name -> engine (or actor group); a role that is None is absent.
        checkpoint_root: the folder checkpoints are saved in, listed from and loaded from.
        sync_weights: ``(body) -> Future`` for a weight-sync; default: an in-memory copy
            from ``training`` to ``sampling`` through the gate.
        abandoned: polled by a waiting weight sync; a reason stops it (see :class:`SyncGate`).
        lora_reference: the trainer trains LoRA adapters and is its own reference policy (the base
            with the adapters disabled): ``forward(reference=True)`` runs on it when there is no
            ``reference`` role.
    """

    def __init__(
        self,
        engines: dict[str, Any],
        *,
        checkpoint_root: Path,
        sync_weights: Callable[[dict[str, Any]], Future] | None = None,
        abandoned: Callable[[], str | None] = lambda: None,
        lora_reference: bool = False,
    ) -> None:
        self.engines = {role: engine for role, engine in engines.items() if engine is not None}
        self.checkpoint_root = Path(checkpoint_root)
        # A worker per engine, so training and sampling run side by side; one lane each.
        self._threads = {role: Worker(role) for role in self.engines}
        self.lanes = {role: worker.lane(role) for role, worker in self._threads.items()}
        self._sync_weights = sync_weights or self._sync_in_memory
        self._abandoned = abandoned
        self._lora_reference = lora_reference

    def submit(self, request: Request) -> Future:
        """Queue ``request`` on its role's worker; never blocks. Errors land on the future."""
        try:
            return self._route(request.op, request.target, request.body)
        except Exception as exc:
            return _done(exception=exc)

    def close(self) -> None:
        """Finish queued work and stop the workers. Idempotent."""
        for worker in self._threads.values():
            worker.close()

    def _route(self, op: str, target: str, body: dict[str, Any]) -> Future:
        """An op of ``protocol.ENGINE_CALLS`` runs that engine method on its role's worker; the few that
        are not one engine call are :data:`_NOT_ONE_CALL`."""
        call = ENGINE_CALLS.get(op)
        if call is None:
            return _NOT_ONE_CALL[op](self, body)
        role = call.role
        if op == protocol.OP_FORWARD and target == protocol.TARGET_REFERENCE:
            role = "reference"
            if role not in self.engines and self._lora_reference:  # the trainer with its adapters disabled
                role, body = "training", {**body, "reference": True}
        if role not in self.engines and call.optional:
            return _done({})
        if op in (protocol.OP_SAVE, protocol.OP_LOAD):  # a checkpoint is a folder under checkpoint_root
            body = {
                **body,
                "folder": self.checkpoint_root if op == protocol.OP_SAVE else self._folder(body["checkpoint_id"]),
            }
        engine = self._engine(role, op)
        method = getattr(engine, call.method, None) or functools.partial(engine.call, call.method)
        return self.lanes[role].submit(method, *call.args(body), **call.kwargs(body))

    def _submit_generate(self, body: dict[str, Any]) -> Future:
        self._engine("sampling", protocol.OP_GENERATE)
        prompts, params = body["prompts"], body["sampling_params"]
        item = (prompts, params if isinstance(params, list) else [params] * len(prompts))
        return self.lanes["sampling"].submit_batchable(protocol.OP_GENERATE, item, self._generate)

    def _submit_weight_sync(self, body: dict[str, Any]) -> Future:
        self._engine("sampling", "sync_weights")
        return self._sync_weights(body)

    def _submit_delete(self, body: dict[str, Any]) -> Future:
        return self.lanes["training"].submit(self._delete, body["checkpoint_id"])

    def _engine(self, role: str, op: str) -> Any:
        engine = self.engines.get(role)
        if engine is None:
            raise InvalidRequestError(_MISSING_ROLE.get(role, "{op} needs a {role} role").format(op=op, role=role))
        return engine

    def _generate(self, items: list[tuple[list[Any], list[Any]]]) -> list[list[dict[str, Any]]]:
        """Run merged generate calls as one engine batch and hand each caller its own slice."""
        samples = self.engines["sampling"].generate(
            [prompt for prompts, _ in items for prompt in prompts], [p for _, params in items for p in params]
        )
        return split_by_n(samples, [params for _, params in items])

    def _sync_in_memory(self, body: dict[str, Any]) -> Future:
        from icefloe.engines.weight_sync import sync_weights_local

        training, sampling = self.engines["training"], self.engines["sampling"]
        gate = SyncGate.parked([self.lanes["sampling"]], source=self.lanes["training"], abandoned=self._abandoned)
        weight_format = body.get("weight_format")
        return gate.submit(lambda: sync_weights_local(training, sampling, weight_format))

    # --- checkpoints: folders under checkpoint_root ------------------------------------------------
    def _folder(self, checkpoint_id: str) -> Path:
        if not checkpoint_id or "/" in checkpoint_id or checkpoint_id.startswith("."):
            raise InvalidRequestError(f"checkpoint_id must be a name like 'global_step12'; got {checkpoint_id!r}")
        path = self.checkpoint_root / checkpoint_id
        if not path.is_dir():
            known = [c["checkpoint_id"] for c in self._list()]
            raise NotFoundError(f"checkpoint {checkpoint_id!r} does not exist; saved checkpoints: {known}")
        return path

    def _delete(self, checkpoint_id: str) -> dict[str, Any]:
        shutil.rmtree(self._folder(checkpoint_id))
        return {}

    def _list(self) -> list[dict[str, Any]]:
        if not self.checkpoint_root.is_dir():
            return []
        # Hidden folders are checkpoints being written or replaced, not checkpoints.
        found = [p for p in self.checkpoint_root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        return sorted((_describe(path) for path in found), key=lambda entry: entry["global_step"])

    def _get(self, checkpoint_id: str) -> dict[str, Any]:
        path = self._folder(checkpoint_id)
        files = [
            {"filename": f.name, "url": f.resolve().as_uri(), "size_bytes": f.stat().st_size}
            for f in sorted(path.iterdir())
            if f.is_file()
        ]
        return {**_describe(path), "files": files}


# The ops that are not one engine call, each with what submits it.
_NOT_ONE_CALL: dict[str, Callable[[EngineHost, dict[str, Any]], Future]] = {
    protocol.OP_GENERATE: EngineHost._submit_generate,
    protocol.OP_WEIGHT_SYNC: EngineHost._submit_weight_sync,
    protocol.OP_DELETE_CHECKPOINT: EngineHost._submit_delete,
    protocol.OP_LIST_CHECKPOINTS: lambda host, body: _done({"checkpoints": host._list()}),
    protocol.OP_GET_CHECKPOINT: lambda host, body: _done(host._get(body["checkpoint_id"])),
    protocol.OP_CANCEL: lambda host, body: _done({}),
}


def split_by_n(samples: Sequence[Any], calls: Sequence[Sequence[Any]]) -> list[list[Any]]:
    """Samples of several generate calls run as one batch (prompt major, ``n`` per prompt), back to
    each call (``calls``: each call's sampling params, one per prompt)."""
    out, start = [], 0
    for params in calls:
        count = sum(p.n for p in params)
        out.append(list(samples[start : start + count]))
        start += count
    return out


def _describe(path: Path) -> dict[str, Any]:
    state_file = path / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    digits = path.name.removeprefix("global_step")
    step = state.get("global_step", int(digits) if digits.isdigit() else 0)
    kind = state.get("kind", "weights-only")
    return {
        "checkpoint_id": path.name,
        "global_step": step,
        "global_steps": step,
        "checkpoint_type": kind,
        "kind": kind,
        "path": str(path),
        "created_at": path.stat().st_mtime,
    }


def _done(value: Any = None, *, exception: BaseException | None = None) -> Future:
    future: Future = Future()
    if exception is not None:
        future.set_exception(exception)
    else:
        future.set_result(value)
    return future
