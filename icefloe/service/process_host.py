"""``icefloe serve --engines process``: each job's engines in a child process of their own.

Inside the service process the engines share one GIL with the HTTP loop, so every request the loop
parses stalls the step running beside it; on a small CPU box that made a remote step half again as
slow as a local one. A child process also contains a crash: a CUDA fault or the OOM killer ends
one job (``failed``, with the exit code as its reason), never the service and its other jobs.

The child runs a :class:`LocalEngineHost`. The service talks to it over one pipe per sub-job, each
served by its own thread in the child, so sub-jobs still run side by side as their FIFO workers
expect. Calls and replies are pickled by hand (``send_bytes``), not by multiprocessing's pickler,
which would move every small tensor through a shared-memory segment of its own. Log records the
engines emit during a call travel back with its reply and are re-emitted on the caller's thread,
so they land in the job's log exactly as in-process ones do. Children fork from a forkserver that
imported torch and common model code once, so a tiny job starts in about 0.2 s rather than
re-importing the stack (2 s).
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from icefloe.protocol import SamplingParams
from icefloe.service.specs import SubJobSpec

__all__ = ["EngineProcessDied", "ProcessEngineHost", "warm_forkserver"]

_log = logging.getLogger("icefloe.service.process_host")

# Imported once by the forkserver, so each job's child starts with them loaded: the engines, and
# the model code of common architectures (transformers imports it lazily; Qwen3 alone took 1.7 s,
# most of a tiny job's start). A module this transformers lacks is skipped.
_PRELOAD = [
    "icefloe.service.process_host",
    "icefloe.service.runtime",
    "icefloe.engines.training",
    "icefloe.engines.sampling",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
]
_START_TIMEOUT_S = 600.0  # a model download or a cold CUDA start can take minutes


class EngineProcessDied(RuntimeError):
    """The job's engine process exited mid-call: the job has lost its engines."""


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def warm_forkserver() -> None:
    """Start the forkserver (and its torch import) now, so the first job does not wait for it."""
    from multiprocessing import forkserver

    try:
        _context()
        forkserver.ensure_running()
    except Exception as exc:  # the first job starts it again and reports the cause as its failure
        _log.info("could not start the engine forkserver ahead of time: %s", exc)


class ProcessEngineHost:
    """The engines of one job, in a child process; the :class:`EngineHost` methods forward to it."""

    def __init__(self, specs: Sequence[SubJobSpec], devices: dict[str, str], checkpoints: dict[str, Path]) -> None:
        self._specs = {s.sub_job_id: s for s in specs}
        self._devices = devices
        self._checkpoints = checkpoints
        self._process: Any = None
        self._control: Connection | None = None
        self._pipes: dict[str, Connection] = {}
        # Sends and receives lock apart: a send that waits for room in the pipe (ops handed over
        # ahead fill it) must not keep the reply of the op in front of it from being read.
        self._send_locks = {sub_job_id: threading.Lock() for sub_job_id in self._specs}
        self._receive_locks = {sub_job_id: threading.Lock() for sub_job_id in self._specs}
        # Per sub-job: calls sent and replies read so far. Replies come in send order, so ticket n's
        # reply is the n-th read; one whose request was dropped unread is skipped over.
        self._sent = dict.fromkeys(self._specs, 0)
        self._read = dict.fromkeys(self._specs, 0)
        self._death = threading.Lock()
        self._exit_code: int | None = None
        self._pid: int | None = None
        self._closed = False
        self._interrupted = False

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self, on_progress: Callable[[str], None]) -> None:
        context = _context()
        control, child_control = context.Pipe()
        ends = {sub_job_id: context.Pipe() for sub_job_id in self._specs}
        self._control = control
        self._pipes = {sid: parent for sid, (parent, _) in ends.items()}
        process = context.Process(
            target=_child_main,
            args=(child_control, {sid: child for sid, (_, child) in ends.items()}, list(self._specs.values())),
            kwargs={"devices": self._devices, "checkpoints": self._checkpoints},
            name="icefloe-engines",
            daemon=True,
        )
        try:
            process.start()
        finally:  # the child holds its own copies now (or never will): ours would only keep fds open
            child_control.close()
            for _, child in ends.values():
                child.close()
        self._process, self._pid = process, process.pid
        on_progress(f"engines run in process {self._process.pid}")
        while True:
            if not control.poll(_START_TIMEOUT_S):
                raise TimeoutError(f"the engine process did not finish loading within {_START_TIMEOUT_S:.0f} s")
            kind, value, records = self._receive(control, "start")
            _replay(records)
            if kind == "progress":
                on_progress(value)
            elif kind == "ready":
                return
            else:
                raise value

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # The job's workers have stopped, so no thread reads these pipes any more. On EOF the child's
        # serving threads return, and it releases its engines and exits.
        for pipe in [*self._pipes.values(), *([self._control] if self._control is not None else [])]:
            pipe.close()
        process = self._process
        if process is not None:
            process.join(timeout=60)
            if process.is_alive():
                _log.warning("engine process %s did not exit within 60 s; killing it", process.pid)
                process.kill()
                process.join(timeout=10)
        if process is not None and not process.is_alive():
            self._exit_code = process.exitcode
            process.close()  # its sentinel and the pipe to the forkserver

    @property
    def exit_code(self) -> int | None:
        """The child's exit status once it has ended (negative: the signal that ended it)."""
        if self._exit_code is not None:
            return self._exit_code
        return self._process.exitcode if self._process is not None and not self._closed else None

    @property
    def pid(self) -> int | None:
        return self._pid

    # --- calls --------------------------------------------------------------------------------
    def _receive(self, pipe: Connection, what: str) -> tuple[str, Any, list[logging.LogRecord]]:
        try:
            return _loads(pipe.recv_bytes())
        except (EOFError, OSError):
            raise self._died(what) from None

    def interrupt(self) -> None:
        """Break every pipe now (the job is stopping): a thread blocked sending or reading on one
        returns at once, and the engine process exits after the op it is running. Without this a
        stopping job could hang: the engine blocks writing replies nobody reads any more (its ops
        are skipped), so it stops reading, and the service blocks sending the ops queued behind."""
        self._interrupted = True
        for pipe in list(self._pipes.values()):
            _shut(pipe)

    def _died(self, what: str) -> Exception:
        if self._interrupted:
            from icefloe.protocol import ClientClosedError

            return ClientClosedError(f"the job is stopping; {what} was not completed")
        with self._death:  # one thread reaps the child; the others read the code it left
            code = self.exit_code
            if code is None and self._process is not None and not self._closed:
                self._process.join(timeout=5)
                code = self._exit_code = self._process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return EngineProcessDied(f"the engine process {self.pid} {how} during {what}")

    def _pipe(self, sub_job_id: str) -> Connection:
        pipe = self._pipes.get(sub_job_id)
        if pipe is None:
            from icefloe.protocol import InvalidRequestError

            raise InvalidRequestError(f"sub-job {sub_job_id!r} has no engine in this job")
        return pipe

    def send(self, sub_job_id: str, method: str, *args: Any) -> int:
        """Queue ``method(*args)`` in the sub-job's engine process; returns the ticket :meth:`wait` takes."""
        pipe = self._pipe(sub_job_id)
        with self._send_locks[sub_job_id]:
            try:
                pipe.send_bytes(_dumps((method, args)))
            except (BrokenPipeError, OSError):
                raise self._died(method) from None
            self._sent[sub_job_id] += 1
            return self._sent[sub_job_id]

    def wait(self, sub_job_id: str, ticket: int, what: str = "a call") -> Any:
        """The result of the call behind ``ticket`` (its exception raised here)."""
        pipe = self._pipe(sub_job_id)
        with self._receive_locks[sub_job_id]:
            while True:
                kind, value, records = self._receive(pipe, what)
                self._read[sub_job_id] += 1
                if self._read[sub_job_id] >= ticket:
                    break
        _replay(records)
        if kind == "error":
            raise value
        return value

    def _call(self, sub_job_id: str, method: str, *args: Any) -> Any:
        return self.wait(sub_job_id, self.send(sub_job_id, method, *args), method)

    def fwd_bwd(self, sub_job_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        return self._call(sub_job_id, "fwd_bwd", sub_job_id, batch)

    def forward(self, sub_job_id: str, batch: dict[str, Any]) -> dict[str, Any]:
        return self._call(sub_job_id, "forward", sub_job_id, batch)

    def step(self, sub_job_id: str, learning_rate: float | None) -> dict[str, Any]:
        return self._call(sub_job_id, "step", sub_job_id, learning_rate)

    def save(self, sub_job_id: str, root: Path, kind: str) -> dict[str, Any]:
        return self._call(sub_job_id, "save", sub_job_id, root, kind)

    def load(self, sub_job_id: str, path: Path) -> dict[str, Any]:
        return self._call(sub_job_id, "load", sub_job_id, path)

    def generate(
        self, sub_job_id: str, prompts: list[list[int] | str], params: list[SamplingParams]
    ) -> list[dict[str, Any]]:
        return self._call(sub_job_id, "generate", sub_job_id, prompts, params)

    def generate_json(self, sub_job_id: str, prompts: list[list[int] | str], params: list[SamplingParams]) -> list[Any]:
        return self._call(sub_job_id, "generate_json", sub_job_id, prompts, params)

    def sync_weights(self, source_sub_job_id: str, target_sub_job_id: str) -> dict[str, Any]:
        # Runs on the source's thread in the child; the caller's SyncGate keeps the target idle meanwhile.
        return self._call(source_sub_job_id, "sync_weights", source_sub_job_id, target_sub_job_id)

    def reset_prefix_cache(self, sub_job_id: str) -> dict[str, Any]:
        return self._call(sub_job_id, "reset_prefix_cache", sub_job_id)

    def max_seq_len(self, sub_job_id: str) -> int:
        return self._specs[sub_job_id].config.max_seq_len


class _TensorPickler(pickle.Pickler):
    """Pickles CPU tensors as their raw bytes: a third of the cost of torch's own reduction."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if type(obj) is not torch.Tensor or obj.device.type != "cpu":
            return NotImplemented
        flat = obj.detach().contiguous().reshape(-1)
        return _tensor_from_bytes, (flat.view(torch.uint8).numpy().tobytes(), str(flat.dtype), tuple(obj.shape))


def _shut(pipe: Connection) -> None:
    """Shut a pipe's socket down both ways; a thread blocked on it gets an error or EOF at once."""
    with contextlib.suppress(OSError, ValueError):  # already closed
        probe = socket.socket(fileno=os.dup(pipe.fileno()))
        try:
            probe.shutdown(socket.SHUT_RDWR)
        finally:
            probe.close()


def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    kind = getattr(torch, dtype.removeprefix("torch."))
    if not data:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)


def _dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _TensorPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return pickle.loads(data)


def _replay(records: list[logging.LogRecord]) -> None:
    """Emit the child's log records as if they came from this thread (the job log routes by thread)."""
    thread = threading.current_thread()
    for record in records:
        record.threadName, record.thread = thread.name, thread.ident
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)


# --- the child process -----------------------------------------------------------------------------
class _CallRecords(logging.Handler):
    """Collects the records each serving thread emits during one call, to send back with its reply."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self._local = threading.local()

    def start(self) -> None:
        self._local.records = []

    def take(self) -> list[logging.LogRecord]:
        records, self._local.records = getattr(self._local, "records", []), []
        return records

    def emit(self, record: logging.LogRecord) -> None:
        records = getattr(self._local, "records", None)
        if records is None:
            return
        # A plain copy: args and ``extra=`` attributes may not pickle.
        plain = logging.makeLogRecord(
            {
                "name": record.name,
                "levelno": record.levelno,
                "levelname": record.levelname,
                "msg": record.getMessage(),
                "created": record.created,
                "msecs": record.msecs,
                "pathname": record.pathname,
                "lineno": record.lineno,
                "funcName": record.funcName,
                "exc_text": self.format(record) if record.exc_info else None,
            }
        )
        records.append(plain)


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives a pickle round trip, else a RuntimeError with its type and message."""
    if not isinstance(exc, Exception):  # an exit or interrupt inside an op must not re-raise as one in the service
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _child_main(
    control: Connection,
    pipes: dict[str, Connection],
    specs: list[SubJobSpec],
    *,
    devices: dict[str, str],
    checkpoints: dict[str, Path],
) -> None:
    from icefloe.service.runtime import LocalEngineHost

    # Ctrl-C reaches the whole process group: the service shuts down and closes the pipes, and
    # that (not the signal) ends this process, after any op in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _quiet_progress_bars()
    records = _CallRecords()
    logging.getLogger("icefloe").addHandler(records)
    logging.getLogger("icefloe").setLevel(logging.INFO)
    host = LocalEngineHost(specs, devices, checkpoints)

    def tell(kind: str, value: Any) -> None:
        control.send_bytes(_dumps((kind, value, records.take())))

    records.start()
    try:
        host.start(lambda message: tell("progress", message))
    except BaseException as exc:
        tell("failed", _portable(exc))
        return
    tell("ready", None)
    threads = [
        threading.Thread(target=_serve, args=(host, pipe, records), name=f"icefloe-{sub_job_id}", daemon=True)
        for sub_job_id, pipe in pipes.items()
    ]
    for thread in threads:
        thread.start()
    with contextlib.suppress(EOFError, OSError):
        control.recv_bytes()  # nothing is ever sent: this returns (EOF) when the service closes the host or dies
    for pipe in pipes.values():
        pipe.close()
    for thread in threads:
        thread.join(timeout=30)
    host.close()
    os._exit(0)  # skip interpreter teardown: engine threads may still hold torch state


def _quiet_progress_bars() -> None:
    """No weight-loading bars from an engine process: nobody reads its terminal, and tqdm's
    process-shared lock would outlive the process as a leaked semaphore."""
    try:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - the engines need transformers
        pass


def _serve(host: Any, pipe: Connection, records: _CallRecords) -> None:
    """Run one sub-job's calls in order, reading each between ops (never competing with one for the GIL)."""
    replies = _Replies(pipe)
    try:
        while True:
            try:
                method, args = _loads(pipe.recv_bytes())
            except (EOFError, OSError):
                return
            records.start()
            try:
                kind, value = "ok", getattr(host, method)(*args)
            except BaseException as exc:  # the caller decides whether this is a user error or a crash
                kind, value = "error", _portable(exc)
            try:
                reply = _dumps((kind, value, records.take()))
            except Exception as exc:  # a result that does not pickle fails its request, never the thread
                reply = _dumps(("error", RuntimeError(f"{method} returned a result that cannot be sent: {exc}"), []))
            if not replies.send(reply):
                return
    finally:
        replies.close()


class _Replies:
    """Writes a sub-job's replies in order: small ones at once, large ones on a thread of its own.

    A large reply the service is not reading yet (it is busy writing the ops queued behind, just as
    large) would block the serving thread, which then stops reading those ops: both ends would wait
    on each other for good. A small one always fits the socket's buffer, and writing it inline
    saves a thread switch per op.
    """

    _INLINE_BYTES = 64 * 1024  # well under a unix socket's buffer (~200 KiB)

    def __init__(self, pipe: Connection) -> None:
        self._pipe = pipe
        self._queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._pending = 0  # replies handed to the writer and not yet written
        self._lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._broken = False

    def send(self, reply: bytes) -> bool:
        """False once the service is gone."""
        with self._lock:
            inline = self._pending == 0 and len(reply) <= self._INLINE_BYTES
            if not inline:
                self._pending += 1
        if not inline:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="icefloe-replies", daemon=True)
                self._writer.start()
            self._queue.put(reply)
            return not self._broken
        try:
            self._pipe.send_bytes(reply)
        except (BrokenPipeError, OSError):
            return False
        return True

    def _write(self) -> None:
        while (reply := self._queue.get()) is not None:
            try:
                if not self._broken:
                    self._pipe.send_bytes(reply)
            except (BrokenPipeError, OSError):
                self._broken = True
            finally:
                with self._lock:
                    self._pending -= 1

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=30)
