"""Where jobs' engines live: the one seam between the service and the compute behind it.

A :class:`JobEngines` builds and owns the engines of one model host and runs ops on them by
sub-job id, called from the host's workers (:mod:`icefloe.service.hosts.pool`), so it need not lock.
A host is dedicated (the engines of one job, built at start) or shared (one base model, on which
the LoRA runs of many jobs attach and detach: :meth:`JobEngines.attach`). ``local`` keeps the
engines in this process, ``process`` in a child process, ``ray`` in actors (dedicated only).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icefloe.protocol import ClientClosedError, InvalidRequestError, SamplingParams
from icefloe.service.results import encode_json
from icefloe.service.specs import SubJobSpec

__all__ = ["SLICE_S", "BaseModel", "ForwardedEngines", "JobEngines", "LocalEngineHost", "Progress", "stop_check"]

# Engines of two jobs are never built at the same time in one process: transformers' lazy imports
# and the tiny-model cache (resolve_model) are not safe to enter from two threads at once.
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class BaseModel:
    """The base model a shared host holds: what ``resolve_model`` loads, on which device."""

    model: str
    seed: int  # a tiny:<preset> model's weights depend on it
    device: str


# (sub-job id, prompts, one params per prompt, whether its samples come back as JSON text, whether
# it reports Progress at each slice while it runs)
Call = tuple[str, Sequence[Any], Sequence[SamplingParams], bool, bool]
# A resumable op to start: what it is ("fwd_bwd" or "generate") and its calls (see JobEngines.slices).
NewOp = tuple[str, list[Any]]

# How long one slice of a resumable op (fwd_bwd, generate) runs before the worker may run another
# run's op, and how long a fwd_bwd pass (or a generate's prefill pass) is cut to: short enough that a
# small op waits little, long enough that a slice's round trip to an engine process is a small share of it.
SLICE_S = 0.025


@dataclass(frozen=True, slots=True)
class Progress:
    """A slice's news of a generate call that asked for it and still runs: per sample (in the order
    of its results), the tokens decoded since the last news (``token_ids``, and ``logprobs`` /
    ``topk_logprobs`` where asked). Only what is new crosses an engine process's pipe."""

    samples: list[dict[str, Any]]

    def then(self, later: Progress) -> Progress:
        """This news followed by ``later``'s, as one."""
        return Progress([{k: a[k] + b[k] for k in a} for a, b in zip(self.samples, later.samples, strict=True)])


@dataclass
class _Suspended:
    """A resumable op between slices: its steps (a pass or a decode step each) and its calls not yet answered."""

    steps: Iterator[dict[int, Any]]
    num_pending: int
    error: Exception | None = None  # what a step raised after others of its slice answered: the next advance's


class JobEngines:
    """The engines of one model host, addressed by sub-job id; each op is one :meth:`call` of an
    engine method (``protocol.ENGINE_CALLS`` names it) on ``self._engines[sid]``.

    A subclass fills ``_engines`` in ``start`` (slow; raise with the cause when an engine cannot be
    built, and give up soon once the ``stop`` event is set) and releases them in ``close``
    (idempotent), also after a start that failed or gave up. With ``base`` the host is shared:
    ``start`` loads the base model only, and each job's engines come and go with :meth:`attach`
    and :meth:`detach`.
    """

    def __init__(
        self,
        specs: Sequence[SubJobSpec],
        devices: dict[str, str],
        checkpoints: dict[str, Path],
        *,
        base: BaseModel | None = None,
    ) -> None:
        self._specs = {s.sub_job_id: s for s in specs}
        self._devices = devices
        self._checkpoints = checkpoints  # sub-job id -> checkpoint folder to start from
        self._base = base
        self._engines: dict[str, Any] = {}

    def sync_weights(self, source_sub_job_id: str, target_sub_job_id: str, weight_format: str | None = None) -> Any:
        """Copy the source trainer's weights (with LoRA: its adapter) into the target sampler."""
        raise NotImplementedError

    def attach(self, specs: Sequence[SubJobSpec], checkpoints: dict[str, Path]) -> None:
        """Build the engines of a job's sub-jobs on the shared base (a shared host only)."""
        raise NotImplementedError(f"{type(self).__name__} hosts one job; its engines are built at start")

    def detach(self, sub_job_ids: Sequence[str]) -> None:
        """Drop those sub-jobs' engines (their adapters and optimizer state); the base stays."""
        raise NotImplementedError(f"{type(self).__name__} hosts one job; close it instead")

    def generate_many(self, calls: Sequence[Call]) -> Iterator[dict[int, list[Any]]]:
        """Generate ``calls`` ``(sub_job_id, prompts, params, as_json, progress)`` as one batch where their
        samplers share a base, a slice per ``next()`` (see :meth:`slices`); each call's samples are
        encoded as JSON when its ``as_json``, so an answer splices them in as they are. A call with
        ``progress`` that has not finished by a slice's end has its :class:`Progress` in that slice."""
        return self.slices(calls[0][0], "generate", list(calls))

    def slices(self, sub_job_id: str, what: str, calls: list[Any]) -> Iterator[dict[int, Any]]:
        """Run the resumable op ``what`` for about :data:`SLICE_S` per ``next()``: ``fwd_bwd`` of calls
        ``(sub_job_id, batch)``, in shared passes where their runs share a base (each as it would run
        alone), or ``generate`` (see :meth:`generate_many`). Each ``next()`` yields the results of the
        calls that finished meanwhile, by call index, and every call's result comes once. Closing it
        early drops the op where the engines hold it."""
        op_id, done, finished = self.advance(sub_job_id, (what, calls), SLICE_S)
        try:
            yield done
            while not finished:
                op_id, done, finished = self.advance(sub_job_id, op_id, SLICE_S)
                yield done
        finally:
            if not finished:
                with contextlib.suppress(Exception):  # the engines died with it: nothing is left to drop
                    self.drop(sub_job_id, op_id)

    def advance(self, sub_job_id: str, op: int | NewOp, slice_s: float) -> tuple[int, dict[int, Any], bool]:
        """Run an op for about ``slice_s``, a new one (``(what, calls)``, see :meth:`slices`) or a suspended
        one (its id): ``(op id, results of the calls that finished meanwhile, finished)``. The engines of a
        Ray actor group run a new op whole."""
        if not isinstance(op, tuple):
            raise InvalidRequestError(f"no suspended op {op} on this host")
        what, calls = op
        if what == "fwd_bwd":
            results = [self.call(sid, "fwd_bwd", (batch,)) for sid, batch in calls]
        else:
            generated = [self.call(sid, "generate", (prompts, params)) for sid, prompts, params, *_ in calls]
            results = _encoded(calls, generated)
        return 0, dict(enumerate(results)), True

    def drop(self, sub_job_id: str, op_id: int) -> None:
        """Stop a suspended op and free what it holds (a fwd_bwd's runs not yet answered get back the
        gradients they had before it)."""

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        raise NotImplementedError

    def cancel(self, sub_job_id: str, tags: list[str]) -> None:
        """Stop the calls tagged so (``SamplingParams.tag``) of the sampler's generate at their next decode
        step, or as soon as it starts; returns at once, while that generate may still run."""
        self._engine(sub_job_id).cancel(tags)

    def interrupt(self) -> None:
        """Fail the calls waiting on the engines now (engines in this process have none to fail)."""

    #: What :meth:`kill` ends, in words; None = engines in this process, which nothing can stop.
    killable: str | None = None

    def kill(self) -> None:
        """End the engines now, whatever they are running (an op past its deadline)."""

    def died(self) -> str | None:
        """How the engines ended if they are gone without being closed (None: alive, or in this process)."""
        return None

    def close(self) -> None:
        raise NotImplementedError

    def call(self, sub_job_id: str, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """``method(*args, **kwargs)`` of the sub-job's engine (a method ``protocol.ENGINE_CALLS`` names);
        an actor group without a method of that name runs it on each actor."""
        engine = self._engine(sub_job_id)
        if hasattr(engine, method):
            return getattr(engine, method)(*args, **(kwargs or {}))
        return engine.call(method, *args, **(kwargs or {}))

    def _engine(self, sub_job_id: str) -> Any:
        try:
            return self._engines[sub_job_id]
        except KeyError:
            raise InvalidRequestError(f"sub-job {sub_job_id!r} has no engine on this host") from None


class ForwardedEngines(JobEngines):
    """Engines that another process runs on its own :class:`LocalEngineHost` (an engine process, a Ray
    actor): each op goes there as the host method's name and arguments, through :meth:`_forward`; a
    resumable op stays there between slices."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ops: dict[int, str] = {}  # op id -> what a suspended op there is, for an error to name

    def _forward(self, sub_job_id: str | None, method: str, *args: Any, what: str | None = None) -> Any:
        """``method(*args)`` on the far host, by way of what serves ``sub_job_id`` (None: the shared base);
        ``what`` names the op in an error when not ``method``."""
        raise NotImplementedError

    def attach(self, specs: Sequence[SubJobSpec], checkpoints: dict[str, Path]) -> None:
        self._forward(None, "attach", list(specs), checkpoints)

    def detach(self, sub_job_ids: Sequence[str]) -> None:
        self._forward(None, "detach", list(sub_job_ids))

    def sync_weights(self, source_sub_job_id: str, target_sub_job_id: str, weight_format: str | None = None) -> Any:
        return self._forward(source_sub_job_id, "sync_weights", source_sub_job_id, target_sub_job_id, weight_format)

    def advance(self, sub_job_id: str, op: int | NewOp, slice_s: float) -> tuple[int, dict[int, Any], bool]:
        """A generate's samples come as JSON where asked, encoded there: a JSON text pickles far faster
        than its sample."""
        what = op[0] if isinstance(op, tuple) else self._ops.get(op)
        op_id, done, finished = self._forward(sub_job_id, "advance", sub_job_id, op, slice_s, what=what)
        if finished:
            self._ops.pop(op_id, None)
        else:
            self._ops[op_id] = what or "op"
        return op_id, done, finished

    def drop(self, sub_job_id: str, op_id: int) -> None:
        self._forward(sub_job_id, "drop", sub_job_id, op_id, what=self._ops.pop(op_id, None))

    def call(self, sub_job_id: str, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        return self._forward(sub_job_id, "call", sub_job_id, method, tuple(args), kwargs, what=method)


class LocalEngineHost(JobEngines):
    """Engines in this process: one TrainingEngine or SamplingEngine per sub-job, on its slot's device;
    on a shared host, each a run's adapter (or the base itself) on the one base model."""

    _shared: Any = None  # the SharedBase of a shared host, once loaded

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._op_ids = itertools.count(1)
        self._suspended: dict[int, _Suspended] = {}  # op id -> a resumable op between slices

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        with _BUILD_LOCK:
            if self._base is not None:
                self._load_base(on_progress)
            self._build(self._specs.values(), self._checkpoints, on_progress, stop)
        on_progress("engines ready")

    def attach(self, specs: Sequence[SubJobSpec], checkpoints: dict[str, Path]) -> None:
        if self._base is None:
            super().attach(specs, checkpoints)
        with _BUILD_LOCK:
            self._build(specs, checkpoints, lambda message: None, threading.Event())

    def detach(self, sub_job_ids: Sequence[str]) -> None:
        for sub_job_id in sub_job_ids:
            engine = self._engines.pop(sub_job_id, None)
            if engine is not None and engine.lora is not None:
                engine.shared.remove(engine.adapter)

    def _load_base(self, on_progress: Callable[[str], None]) -> None:
        import torch

        from icefloe.engines.lora import SharedBase
        from icefloe.engines.models import load_causal_lm, load_tokenizer, resolve_model
        from icefloe.engines.training import resolve_device

        assert self._base is not None
        on_progress(f"loading the shared base {self._base.model!r} on {self._base.device}")
        folder = resolve_model(self._base.model, seed=self._base.seed)
        base = load_causal_lm(folder, dtype=torch.float32, device=resolve_device(self._base.device))
        self._shared = SharedBase(base.requires_grad_(False), model_dir=folder, tokenizer=load_tokenizer(folder))

    def _build(
        self,
        specs: Sequence[SubJobSpec] | Any,
        checkpoints: dict[str, Path],
        on_progress: Callable[[str], None],
        stop: threading.Event,
    ) -> None:
        from icefloe.engines.lora import read_adapter_checkpoint
        from icefloe.engines.sampling import SamplingEngine, build_sampling_engine
        from icefloe.engines.training import TrainingEngine

        shared = self._shared
        for spec in specs:
            sub_job_id = spec.sub_job_id
            stop_check(stop)  # an engine loading in this process cannot be cut short: give up between them
            start_from = checkpoints.get(sub_job_id)
            if shared is None:
                on_progress(f"loading {spec.config.model!r} for {sub_job_id} on {self._devices[sub_job_id]}")
            if spec.job_type == "sampling" and shared is not None:
                engine = SamplingEngine(spec.config, shared=shared)
                adapter = read_adapter_checkpoint(start_from, spec.config.lora) if start_from else None
                if adapter is not None:  # a weights-only LoRA checkpoint: the base with its adapter
                    engine.load_weights(adapter.items(), policy_version=0)
            elif spec.job_type == "sampling":
                engine = build_sampling_engine(spec.config, self._devices[sub_job_id], model_dir=start_from)
            else:
                role = "training" if spec.is_training else "reference"
                engine = TrainingEngine(
                    spec.config, device=self._devices.get(sub_job_id, "cpu"), role=role, shared=shared
                )
                if start_from is not None:
                    loaded = engine.load_checkpoint(start_from)
                    if spec.is_training and not spec.load_optimizer_states and engine.optimizer is not None:
                        engine.optimizer.state.clear()  # load_optimizer_states=false: weights only, fresh AdamW
                    on_progress(f"{sub_job_id} starts from {loaded['checkpoint_id']} ({loaded['kind']})")
            engine.owner = sub_job_id
            self._engines[sub_job_id] = engine

    def advance(self, sub_job_id: str, op: int | NewOp, slice_s: float) -> tuple[int, dict[int, Any], bool]:
        if isinstance(op, tuple):
            what, calls = op
            if what == "fwd_bwd":  # runs whose calls can share passes share them
                from icefloe.engines.training import fwd_bwd_steps

                steps = fwd_bwd_steps([(self._engine(sid), batch) for sid, batch in calls], SLICE_S)
            else:
                steps = self._generate_steps(calls)
            op_id = next(self._op_ids)
            suspended = self._suspended[op_id] = _Suspended(steps, len(calls))
        else:
            op_id = op
            suspended = self._suspended.get(op_id)
            if suspended is None:
                raise InvalidRequestError(f"no suspended op {op_id} on this host; it finished or was dropped")
            if suspended.error is not None:
                self.drop(sub_job_id, op_id)
                raise suspended.error
        done: dict[int, Any] = {}
        until = time.monotonic() + slice_s
        try:
            while suspended.num_pending:  # at least one step, however long it takes
                for index, result in next(suspended.steps).items():
                    earlier = done.get(index)
                    if isinstance(result, Progress):
                        done[index] = earlier.then(result) if isinstance(earlier, Progress) else result
                    else:
                        done[index] = result
                        suspended.num_pending -= 1
                if time.monotonic() >= until:
                    break
        except Exception as exc:
            if all(isinstance(result, Progress) for result in done.values()):
                self.drop(sub_job_id, op_id)
                raise
            # Calls this slice answered keep their answers (a run answered keeps its gradient: run again, it
            # would add it twice); the error fails the rest at the next advance.
            suspended.error = exc
            return op_id, done, False
        except BaseException:
            self.drop(sub_job_id, op_id)
            raise
        if not suspended.num_pending:
            self.drop(sub_job_id, op_id)
        return op_id, done, not suspended.num_pending

    def drop(self, sub_job_id: str, op_id: int) -> None:
        op = self._suspended.pop(op_id, None)
        if op is not None:
            op.steps.close()

    def _generate_steps(self, calls: Sequence[Call]) -> Iterator[dict[int, list[Any]]]:
        from icefloe.engines.sampling import SamplingEngine, generate_steps

        engines = [self._engine(sub_job_id) for sub_job_id, *_ in calls]
        if all(isinstance(engine, SamplingEngine) for engine in engines):
            watched = [i for i, call in enumerate(calls) if call[4]]
            together = [(engine, p, q) for engine, (_, p, q, *_) in zip(engines, calls, strict=True)]
            steps = generate_steps(together, watched, SLICE_S)
        else:  # vLLM batches by itself, a generate at a time
            steps = iter([({i: self.call(call[0], "generate", call[1:3]) for i, call in enumerate(calls)}, {})])
        for done, news in steps:
            step: dict[int, Any] = {i: Progress(samples) for i, samples in news.items()}
            step |= {i: [encode_json(s) for s in samples] if calls[i][3] else samples for i, samples in done.items()}
            yield step

    def sync_weights(
        self, source_sub_job_id: str, target_sub_job_id: str, weight_format: str | None = None
    ) -> dict[str, Any]:
        from icefloe.engines.weight_sync import sync_weights_local

        source, target = self._engine(source_sub_job_id), self._engine(target_sub_job_id)
        return sync_weights_local(source, target, weight_format)

    def close(self) -> None:
        import torch

        engines, self._engines = self._engines, {}
        for engine in engines.values():
            if callable(getattr(engine, "close", None)):
                engine.close()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _encoded(calls: Sequence[Call], results: list[list[Any]]) -> list[list[Any]]:
    """Each call's samples, as JSON text where the call asked for it."""
    return [
        [encode_json(s) for s in samples] if call[3] else samples for call, samples in zip(calls, results, strict=True)
    ]


def stop_check(stop: threading.Event) -> None:
    """Give up an engine start once the job is stopping."""
    if stop.is_set():
        raise ClientClosedError("the job stopped while its engines were starting")
