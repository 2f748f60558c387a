"""``icefloe serve --engines process``: each model host's engines in a child process of their own.

In the service process the engines would share one GIL with the HTTP loop; a child also contains a
crash (a CUDA fault, the OOM killer ends one host, never the service). The child runs a
:class:`LocalEngineHost`; each of the host's workers talks to it over a :class:`Pipe` of its own (a
socket pair; :func:`serve` on a thread answers at the far end): one per sub-job on a dedicated host,
one for a shared base and every run on it. A call and its answer are each one message, pickled with
their CPU tensors out of band: a large tensor's memory goes to the socket as it is and arrives in
memory of its own, never copied into or out of the pickle (multiprocessing's pickler would move each
tensor through a shared-memory segment). What the engines log (and warn) while they run a call crosses the
pipe with its answer, to the logs of the jobs whose op it is; what a dedicated job's engines log
while loading, the child writes into the job's log itself. Children fork from a forkserver that
imported torch once, so a tiny host starts in about 0.2 s.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from icefloe.protocol import ClientClosedError, InvalidRequestError
from icefloe.service.hosts.seam import BaseModel, ForwardedEngines, stop_check
from icefloe.service.joblog import ENGINE_LOGGER, JobLogRouter, Recorder, relay
from icefloe.service.specs import SubJobSpec

__all__ = [
    "SHARED_CHANNEL",
    "EngineProcessDied",
    "Pipe",
    "ProcessEngineHost",
    "portable",
    "serve",
    "warm_forkserver",
]

_log = logging.getLogger("icefloe.service.hosts.process")

# Imported once by the forkserver, so each job's child starts with them loaded: the engines, and
# the model code of common architectures (transformers imports it lazily; Qwen3 alone took 1.7 s,
# most of a tiny job's start). A module this transformers lacks is skipped.
_PRELOAD = [
    "icefloe.service.hosts.process",
    "icefloe.service.hosts.seam",
    "icefloe.engines.training",
    "icefloe.engines.sampling",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.llama.modeling_llama",
]
_START_TIMEOUT_S = 600.0  # a model download or a cold CUDA start can take minutes
_START_TICK_S = 0.05  # while it waits for the engine process to start, a job checks this often for a stop
_EXIT_TIMEOUT_S = 3.0  # after its pipes close, a child still running by then is killed


SHARED_CHANNEL = "shared"  # the one channel of a shared host: its base and every run on it


class EngineProcessDied(RuntimeError):
    """The host's engine process exited mid-call: every job on it has lost its engines."""


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


# A message on a pipe: this header (how many out-of-band buffers, the length of the head), each buffer's
# size (8 bytes), the head (the pickle of everything but the buffers), then the buffers.
_HEADER = struct.Struct("<IQ")
_SIZE_BYTES = 8
_PIECES_PER_SEND = 512  # sendmsg takes at most IOV_MAX (1024 on Linux) pieces at once
_IN_BAND_BYTES = 16 << 10  # a smaller buffer rides in the head: copying it costs less than a read of its own


class Pipe:
    """One end of a socket pair that carries messages to a :class:`Pipe` at the other end: each a pickle
    whose CPU tensors (see :class:`_Pickler`) travel out of band, from :data:`_IN_BAND_BYTES` up: written
    to the socket from their own memory and read into fresh memory there.

    One exchange at a time: a caller writes its message and reads the answer under the pipe's lock,
    so this end never writes a large message while the other writes a large answer (on full sockets
    both would wait for good). Concurrent callers take turns; the service calls a sub-job from one worker.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._socket = sock
        self._lock = threading.Lock()

    def exchange(self, message: Any = None) -> Any:
        """Send ``message`` (None: nothing), then return the next message that arrives.

        Raises ``pickle.PicklingError`` when ``message`` does not pickle (nothing was sent),
        ``pickle.UnpicklingError`` when what arrived does not unpickle (it was read whole: the pipe
        still works), and EOFError or OSError when the pipe is broken or shut."""
        with self._lock:
            if message is not None:
                buffers: list[pickle.PickleBuffer] = []
                head = io.BytesIO()
                try:
                    _Pickler(head, protocol=5, buffer_callback=_set_aside(buffers)).dump(message)
                except Exception as exc:
                    raise pickle.PicklingError(str(exc)) from exc
                _write(self._socket, head.getbuffer(), buffers)
            arrived, memory = _read(self._socket)
        try:
            return pickle.loads(arrived, buffers=memory)
        except Exception as exc:
            raise pickle.UnpicklingError(str(exc)) from exc

    def shut(self) -> None:
        """Break the pipe both ways now: an exchange waiting on it fails at once, and so does every later one."""
        with contextlib.suppress(OSError):  # already closed
            self._socket.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Shut the pipe, let an exchange in flight fail, release the socket. Idempotent."""
        self.shut()
        with self._lock:
            self._socket.close()


def _set_aside(buffers: list[pickle.PickleBuffer]) -> Callable[[pickle.PickleBuffer], bool]:
    """A pickler's ``buffer_callback`` that puts each large buffer into ``buffers``, out of band, and keeps
    a small one in the head (pickle's rule: the callback answered true)."""

    def set_aside(buffer: pickle.PickleBuffer) -> bool:
        if buffer.raw().nbytes < _IN_BAND_BYTES:
            return True
        buffers.append(buffer)
        return False

    return set_aside


def _write(sock: socket.socket, head: memoryview, buffers: list[pickle.PickleBuffer]) -> None:
    """One message: its header, head and buffers, gathered into as few sends as the system allows."""
    raw = [buffer.raw() for buffer in buffers]
    sizes = struct.pack(f"<{len(raw)}Q", *(piece.nbytes for piece in raw))
    pieces = [memoryview(_HEADER.pack(len(raw), head.nbytes) + sizes), head, *raw]
    while pieces:
        sent = sock.sendmsg(pieces[:_PIECES_PER_SEND])
        while pieces and sent >= pieces[0].nbytes:
            sent -= pieces.pop(0).nbytes
        if pieces:
            pieces[0] = pieces[0][sent:]


def _read(sock: socket.socket) -> tuple[memoryview, list[np.ndarray]]:
    """The next message's head, and its buffers, each read into memory of its own."""
    count, head_bytes = _HEADER.unpack(_read_into(sock, bytearray(_HEADER.size)))
    sized = _read_into(sock, bytearray(count * _SIZE_BYTES + head_bytes))
    sizes = struct.unpack_from(f"<{count}Q", sized)
    memory = [_read_into(sock, np.empty(size, dtype=np.uint8)) for size in sizes]
    return memoryview(sized)[count * _SIZE_BYTES :], memory


def _read_into(sock: socket.socket, memory: Any) -> Any:
    """``memory`` filled from the socket; EOFError when the other end closed (or this one was shut)."""
    view = memoryview(memory)
    while view.nbytes:
        got = sock.recv_into(view, 0, socket.MSG_WAITALL)
        if not got:
            raise EOFError("the pipe was closed")
        view = view[got:]
    return memory


class ProcessEngineHost(ForwardedEngines):
    """The engines of one model host, in a child process: each op runs on the child's :class:`LocalEngineHost`.

    ``log_dir``: a dedicated job's log folder, where the child writes what its engines log (None: nowhere).
    """

    def __init__(
        self,
        specs: Sequence[SubJobSpec],
        devices: dict[str, str],
        checkpoints: dict[str, Path],
        log_dir: Path | None = None,
        *,
        base: BaseModel | None = None,
    ) -> None:
        super().__init__(specs, devices, checkpoints, base=base)
        self._pipes: dict[str, Pipe] = {}
        self._log_dir = log_dir
        self._process: Any = None
        self._control: Connection | None = None
        self._control_lock = threading.Lock()  # the service's side writes cancels to it from any thread
        self._reaping = threading.Lock()
        self.pid: int | None = None
        self.exit_code: int | None = None  # once the child ended; negative: the signal that ended it
        self._stopping = False  # calls cut short from now on were cancelled, not lost to a crash

    def start(self, on_progress: Callable[[str], None], stop: threading.Event) -> None:
        context = _context()
        control, child_control = context.Pipe()
        groups = [SHARED_CHANNEL] if self._base is not None else list(self._specs)
        pairs = {group: socket.socketpair() for group in groups}
        self._control = control
        process = context.Process(
            target=_child_main,
            args=(child_control, {group: far for group, (_, far) in pairs.items()}, list(self._specs.values())),
            kwargs={
                "devices": self._devices, "checkpoints": self._checkpoints, "log_dir": self._log_dir, "base": self._base
            },
            name="icefloe-engines",
            daemon=True,
        )  # fmt: skip
        try:
            process.start()
        finally:  # the child holds its own copies now (or never will): ours would only keep fds open
            child_control.close()
            for _, far in pairs.values():
                far.close()
        self._process, self.pid = process, process.pid
        # each worker's engines, as far as this process sees them: the pipe to them
        self._pipes = {group: Pipe(near) for group, (near, _) in pairs.items()}
        on_progress(f"engines run in process {process.pid}")
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            while not control.poll(_START_TICK_S):  # a stopping job gives up; its close ends the process
                stop_check(stop)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the engine process did not finish loading within {_START_TIMEOUT_S:.0f} s")
            try:
                kind, value = pickle.loads(control.recv_bytes())
            except (EOFError, OSError):
                raise self._lost("start") from None
            if kind == "progress":
                on_progress(value)
            elif kind == "ready":
                return
            else:
                raise value

    def cancel(self, sub_job_id: str, tags: list[str]) -> None:
        """Over the control pipe: the sub-job's own pipe is busy with the generate to be cut short."""
        with self._control_lock, contextlib.suppress(OSError, ValueError):  # the child is gone: nothing runs
            if self._control is not None:
                self._control.send_bytes(pickle.dumps(("cancel", (sub_job_id, tags))))

    @property
    def killable(self) -> str:
        return f"the engine process {self.pid}"

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, TypeError):  # gone already, or never started
            os.kill(self.pid, signal.SIGKILL)  # type: ignore[arg-type]

    def interrupt(self) -> None:
        """The job is stopping: every call waiting on the engine process fails now, as cancelled,
        and so does any later one; the process exits after the op it is running."""
        self._stopping = True
        for pipe in self._pipes.values():
            pipe.shut()

    def close(self) -> None:
        """Interrupt, let the child release its engines and exit; kill it after a few seconds."""
        self.interrupt()
        for pipe in self._pipes.values():
            pipe.close()
        if self._control is not None:
            with self._control_lock:
                self._control.close()  # the child's EOF: it releases its engines and exits
        if self._process is not None and self._reap(_EXIT_TIMEOUT_S) is None:
            _log.warning("engine process %s did not exit within %.0f s; killing it", self.pid, _EXIT_TIMEOUT_S)
            self._process.kill()
            self._reap(10)
        if self.exit_code is not None and self._process is not None:
            self._process.close()  # its sentinel and the pipe to the forkserver
            self._process = None

    def _reap(self, timeout_s: float) -> int | None:
        with self._reaping:  # one thread joins the child; the others read the code it left
            if self.exit_code is None and self._process is not None:
                self._process.join(timeout_s)
                self.exit_code = self._process.exitcode
        return self.exit_code

    def _lost(self, what: str) -> BaseException:
        if self._stopping:
            return ClientClosedError(f"the job is stopping; {what} was not completed")
        return EngineProcessDied(f"{self._ended(self._reap(5))} during {what}")

    def died(self) -> str | None:
        if self._process is None or self._stopping or self._process.is_alive():
            return None
        return self._ended(self._reap(5))

    def _ended(self, code: int | None) -> str:
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"the engine process {self.pid} {how}"

    def _forward(self, sub_job_id: str | None, method: str, *args: Any, what: str | None = None) -> Any:
        """One exchange with the engine process, over the pipe of the worker that serves ``sub_job_id``.
        What the engines logged meanwhile goes to :func:`~icefloe.service.joblog.relay` on this thread."""
        try:
            kind, value, logged = self._pipe(sub_job_id).exchange((method, args))
        except pickle.UnpicklingError as exc:  # a reply this side cannot read fails its call only
            raise RuntimeError(f"the reply to {what or method} could not be read: {exc}") from None
        except (EOFError, OSError):
            raise self._lost(what or method) from None
        relay(logged)
        if kind == "error":
            raise value
        return value

    def _pipe(self, sub_job_id: str | None) -> Pipe:
        pipe = self._pipes.get(SHARED_CHANNEL if self._base is not None else sub_job_id)
        if pipe is None:
            raise InvalidRequestError(f"sub-job {sub_job_id!r} has no engine on this host")
        return pipe


class _Pickler(pickle.Pickler):
    """Pickles a CPU tensor as ``torch.from_numpy`` of a numpy view of its memory, whose own reduction
    hands that memory to the pipe as a buffer: the other end rebuilds it without icefloe code. A dtype
    numpy lacks (bfloat16) goes as a view of its bytes; a tensor that requires grad, as that flag on its data."""

    def reducer_override(self, obj: Any) -> Any:
        import torch

        if type(obj) is not torch.Tensor or obj.device.type != "cpu" or obj.layout != torch.strided:
            return NotImplemented
        if obj.requires_grad:
            return torch.Tensor.requires_grad_, (obj.detach(), True)
        dense = obj.resolve_conj().resolve_neg().contiguous()  # numpy() refuses a lazy conjugate or negation
        try:
            return torch.from_numpy, (dense.numpy(),)
        except TypeError:  # no numpy dtype for it
            return _tensor_from_bytes, (dense.reshape(-1).view(torch.uint8).numpy(), dense.dtype, tuple(dense.shape))


def _tensor_from_bytes(data: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> Any:
    import torch

    return torch.from_numpy(data).view(dtype).reshape(shape)


def serve(engines: Any, pipe: Pipe, router: JobLogRouter | None = None) -> None:
    """Answer the calls that come over ``pipe``, one at a time, until it closes.

    A call ``(method, args)`` runs ``engines.<method>(*args)``; its reply carries the result or
    the error (one that does not pickle as a RuntimeError naming it), and what ``router`` routed
    from this thread meanwhile. A result that cannot be sent, or a call that cannot be read, fails
    its call, never this loop.
    """
    reply = None
    while True:
        try:
            method, args = pipe.exchange(reply)
        except pickle.PicklingError as exc:  # nothing of the reply went: an error goes in its place
            reply = ("error", RuntimeError(f"{method} returned a result that cannot be sent: {exc}"), reply[2])
            continue
        except pickle.UnpicklingError as exc:  # the call was read whole: the next one is still in step
            reply = ("error", RuntimeError(f"the engine process could not read the call: {exc}"), [])
            continue
        except (EOFError, OSError):
            return
        recorder = Recorder()
        with router.serving([(recorder, None)]) if router is not None else contextlib.nullcontext():
            try:
                reply = ("ok", getattr(engines, method)(*args), recorder.entries)
            except BaseException as exc:  # the caller decides whether this is a user error or a crash
                reply = ("error", portable(exc), recorder.entries)


def portable(exc: BaseException) -> BaseException:
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
    sockets: dict[str, socket.socket],
    specs: list[SubJobSpec],
    *,
    devices: dict[str, str],
    checkpoints: dict[str, Path],
    log_dir: Path | None,
    base: BaseModel | None,
) -> None:
    from icefloe.service.hosts.seam import LocalEngineHost
    from icefloe.service.joblog import JobLog

    # Ctrl-C reaches the whole process group: the service shuts down and closes the pipes, and
    # that (not the signal) ends this process, after any op in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # No weight-loading bars: nobody reads this terminal, and tqdm's process-shared lock would
    # outlive the process as a leaked semaphore.
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    router = JobLogRouter()  # what the engines log in a call goes back with its answer (see serve)
    router.attach(logging.getLogger(ENGINE_LOGGER))
    if log_dir is not None:  # what a dedicated job's engines log while loading: job-wide, in its log
        router.bind(threading.current_thread().name, JobLog(log_dir, [spec.sub_job_id for spec in specs]), None)
    host = LocalEngineHost(specs, devices, checkpoints, base=base)

    def tell(kind: str, value: Any) -> None:
        control.send_bytes(pickle.dumps((kind, value)))

    try:
        host.start(lambda message: tell("progress", message), threading.Event())  # the service ends this process
    except BaseException as exc:
        tell("failed", portable(exc))
        return
    # The engines live until this process exits: leave them out of every later collection (a full
    # one walked the model's objects each time, pausing training for ~250 ms).
    gc.freeze()
    tell("ready", None)
    pipes = {group: Pipe(sock) for group, sock in sockets.items()}
    threads = [
        threading.Thread(target=serve, args=(host, pipe, router), name=f"icefloe-{group}", daemon=True)
        for group, pipe in pipes.items()
    ]
    for thread in threads:
        thread.start()
    while True:  # cancels, until EOF: the service closed the host, or died
        try:
            kind, value = pickle.loads(control.recv_bytes())
        except (EOFError, OSError):
            break
        if kind == "cancel":
            with contextlib.suppress(Exception):  # an unknown sub-job: nothing of it to stop
                host.cancel(*value)
    for pipe in pipes.values():
        pipe.close()
    for thread in threads:
        thread.join(timeout=_EXIT_TIMEOUT_S)
    host.close()
    os._exit(0)  # skip interpreter teardown: engine threads may still hold torch state
