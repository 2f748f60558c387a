"""The one engine host: roles -> ordered workers -> weight-sync gate, and the op table.

Every op for a role (an engine, or a service sub-job) runs on that role's :class:`RoleWorker`,
one thread with a FIFO queue, so an engine is only ever touched by one thread and requests to it
run strictly in the order they were handed in. Generate calls that sit next to each other in a
sampler's queue run as one engine batch. A weight copy from a trainer to its samplers goes
through a :class:`SyncGate`: it runs after all work queued earlier on every role it touches and
before any work queued later.

The service keeps one worker per sub-job and a gate per weight-sync. :class:`EngineHost` maps
roles to workers and adds the op table, for the transports whose roles are engine objects with the
engine method names (``local``: torch engines; ``ray``: actor groups).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icefloe import protocol
from icefloe.protocol import ClientClosedError, InvalidRequestError, Request

__all__ = ["ENGINE_CALLS", "EngineHost", "RoleWorker", "SyncGate"]


@dataclass
class _Job:
    future: Future
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    key: Hashable | None = None  # set: a batchable item
    item: Any = None
    run_batch: Callable[[list[Any]], Sequence[Any]] | None = None


class RoleWorker:
    """A daemon thread that runs its queue strictly in submission order.

    Args:
        name: names the thread (``icefloe-<name>``) and appears in errors.
        linger_s: how long a batchable item waits for same-key company when nothing is queued
            behind it; 0 = never wait.
    """

    def __init__(self, name: str, *, linger_s: float = 0.002) -> None:
        self.name = name
        self.linger_s = linger_s
        self._queue: deque[_Job] = deque()
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

    def submit_batchable(self, key: Hashable, item: Any, run_batch: Callable[[list[Any]], Sequence[Any]]) -> Future:
        """Queue ``item``; adjacent queued items with the same ``key`` run in one ``run_batch(items)``
        call, which must return one result per item, in order."""
        return self._put(_Job(Future(), key=key, item=item, run_batch=run_batch))

    def close(self) -> None:
        """Refuse new work, finish what is queued, stop the thread. Idempotent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _put(self, job: _Job) -> Future:
        with self._cond:
            if self._closed:
                raise ClientClosedError(f"worker {self.name!r} is closed; no new work is accepted")
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                job = self._queue.popleft()
            if job.run_batch is None:
                _run_one(job)
            else:
                _run_batch([job, *self._same_key_followers(job.key)])

    def _same_key_followers(self, key: Hashable) -> list[_Job]:
        """Take the queued items right behind the head that share its key (after a short linger)."""
        followers: list[_Job] = []
        deadline = time.monotonic() + self.linger_s
        with self._cond:
            while True:
                while self._queue and self._queue[0].run_batch is not None and self._queue[0].key == key:
                    followers.append(self._queue.popleft())
                remaining = deadline - time.monotonic()
                if self._queue or self._closed or remaining <= 0:
                    return followers
                self._cond.wait(remaining)


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


def _run_batch(jobs: list[_Job]) -> None:
    jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]
    if not jobs:
        return
    assert jobs[0].run_batch is not None
    try:
        results = list(jobs[0].run_batch([job.item for job in jobs]))
        if len(results) != len(jobs):
            raise RuntimeError(f"run_batch returned {len(results)} results for {len(jobs)} items")
    except BaseException as exc:
        for job in jobs:
            job.future.set_exception(exc)
        return
    for job, result in zip(jobs, results, strict=True):
        job.future.set_result(result)


class SyncGate:
    """Lines a source worker up with its target workers for one copy between engines.

    :meth:`park` runs on every target worker and :meth:`run` on the source worker: the copy then
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
        """Free parked targets without copying (the copy could not be queued)."""
        self._released.set()

    @classmethod
    def parked(cls, targets: Sequence[RoleWorker], *, abandoned: Callable[[], str | None] = lambda: None) -> SyncGate:
        """A gate with :meth:`park` queued on every target; queue ``gate.run(copy)`` on the source
        next, or call ``gate.release()`` if that fails."""
        gate = cls(len(targets), abandoned=abandoned)
        for target in targets:
            target.submit(gate.park)
        return gate


@dataclass(frozen=True)
class EngineCall:
    """How an op reaches an engine: the role that runs it, the engine method, its arguments."""

    role: str
    method: str
    args: Callable[[dict[str, Any]], tuple[Any, ...]] = lambda body: ()
    optional: bool = False  # the role may be absent: the op then answers {}


#: The op table: every op that is one call of an engine method. Engines and Ray actor groups share
#: these method names. The ops not here are answered by :class:`EngineHost` itself (generate merges
#: adjacent calls, weight-sync crosses roles, checkpoints name folders, cancel has nothing to do).
ENGINE_CALLS: dict[str, EngineCall] = {
    protocol.OP_FWD_BWD: EngineCall("training", "fwd_bwd", lambda body: (body["batch"],)),
    protocol.OP_FORWARD: EngineCall("training", "forward", lambda body: (body["batch"],)),
    protocol.OP_STEP: EngineCall("training", "step", lambda body: (body.get("learning_rate"),)),
    protocol.OP_SLEEP_TRAINING: EngineCall("training", "sleep"),
    protocol.OP_WAKE_TRAINING: EngineCall("training", "wake"),
    protocol.OP_SLEEP_INFERENCE: EngineCall("sampling", "sleep", lambda body: (body.get("level", 1),), True),
    protocol.OP_WAKE_INFERENCE: EngineCall("sampling", "wake", optional=True),
    protocol.OP_RESET_PREFIX_CACHE: EngineCall("sampling", "reset_prefix_cache", optional=True),
}

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
        self.workers = {role: RoleWorker(role) for role in self.engines}
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
        for worker in self.workers.values():
            worker.close()

    def _route(self, op: str, target: str, body: dict[str, Any]) -> Future:
        call = ENGINE_CALLS.get(op)
        if call is not None:
            role = "reference" if op == protocol.OP_FORWARD and target == protocol.TARGET_REFERENCE else call.role
            if role == "reference" and role not in self.engines and self._lora_reference:
                trainer = self.engines["training"]
                return self.workers["training"].submit(trainer.forward, *call.args(body), reference=True)
            if role not in self.engines and call.optional:
                return _done({})
            method = getattr(self._engine(role, op), call.method)
            return self.workers[role].submit(method, *call.args(body))
        if op == protocol.OP_GENERATE:
            self._engine("sampling", op)
            prompts, params = body["prompts"], body["sampling_params"]
            item = (prompts, params if isinstance(params, list) else [params] * len(prompts))
            return self.workers["sampling"].submit_batchable(op, item, self._generate)
        if op == protocol.OP_WEIGHT_SYNC:
            self._engine("sampling", "sync_weights")
            return self._sync_weights(body)
        if op == protocol.OP_SAVE:
            save, kind = self.engines["training"].save_checkpoint, body.get("checkpoint_type", "resumable")
            return self.workers["training"].submit(save, self.checkpoint_root, kind=kind)
        if op == protocol.OP_LOAD:
            return self.workers["training"].submit(self._load, body["checkpoint_id"])
        if op == protocol.OP_DELETE_CHECKPOINT:
            return self.workers["training"].submit(self._delete, body["checkpoint_id"])
        if op == protocol.OP_LIST_CHECKPOINTS:
            return _done({"checkpoints": self._list()})
        if op == protocol.OP_GET_CHECKPOINT:
            return _done(self._get(body["checkpoint_id"]))
        if op == protocol.OP_CANCEL:
            return _done({})
        raise AssertionError(f"unreachable: op {op!r} is in OPS but not routed")

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
        out, start = [], 0
        for _, params in items:
            count = sum(p.n for p in params)
            out.append(samples[start : start + count])
            start += count
        return out

    def _sync_in_memory(self, body: dict[str, Any]) -> Future:
        from icefloe.engines.weight_sync import sync_weights_local

        training, sampling = self.engines["training"], self.engines["sampling"]
        gate = SyncGate.parked([self.workers["sampling"]], abandoned=self._abandoned)
        weight_format = body.get("weight_format")
        return self.workers["training"].submit(gate.run, lambda: sync_weights_local(training, sampling, weight_format))

    # --- checkpoints: folders under checkpoint_root ------------------------------------------------
    def _folder(self, checkpoint_id: str) -> Path:
        if not checkpoint_id or "/" in checkpoint_id or checkpoint_id.startswith("."):
            raise InvalidRequestError(f"checkpoint_id must be a name like 'global_step12'; got {checkpoint_id!r}")
        path = self.checkpoint_root / checkpoint_id
        if not path.is_dir():
            known = [c["checkpoint_id"] for c in self._list()]
            raise InvalidRequestError(f"checkpoint {checkpoint_id!r} does not exist; saved checkpoints: {known}")
        return path

    def _load(self, checkpoint_id: str) -> dict[str, Any]:
        return self.engines["training"].load_checkpoint(self._folder(checkpoint_id))

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
