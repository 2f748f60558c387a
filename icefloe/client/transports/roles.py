"""The transports whose roles are engine objects, ``local`` and ``ray``, over the one engine host.

Routing, per-role ordering, generate merging and the weight-sync gate live in
:class:`icefloe.engines.host.EngineHost`; this class adds the transport lifecycle. A subclass says
how the role objects come to exist and go away:

- ``_start()``: set ``self.training`` (and ``self.sampling``, ``self.reference`` when the config
  has them) to engines or actor groups with the engine method names. It may instead set
  ``self.host`` to a live host to share (a twin re-attaching in the same process); then closing
  this transport leaves that host running.
- ``_stop()``: release what ``_start`` created; called once, after the role workers drained.
- ``_sync_weights(body) -> Future`` (optional): copy trainer weights to the samplers after earlier
  training work and before later sampling work, queueing on ``self._worker(role)``; the default is
  an in-memory copy through the gate.
"""

from __future__ import annotations

import abc
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from icefloe.client.transports.base import Transport
from icefloe.config import ClientConfig
from icefloe.protocol import OPS, ClientClosedError, Request

__all__ = ["RoleTransport"]


class RoleTransport(Transport):
    """Delivers each request to the engine host that owns this transport's role objects."""

    capabilities = OPS

    def __init__(self, config: ClientConfig, *, session: str, checkpoint_root: Path) -> None:
        self.config = config
        self.checkpoint_root = Path(checkpoint_root)
        self._session = session
        self._lock = threading.Lock()
        self._closed = False
        self.training: Any = None
        self.sampling: Any = None
        self.reference: Any = None
        self.host: Any = None  # an EngineHost once open
        self._owns_host = False

    #: Optional ``(body) -> Future`` that moves weights another way than the host's in-memory copy.
    _sync_weights: Any = None

    def open(self) -> None:
        with self._lock:
            if self._closed:
                raise ClientClosedError(f"this {self.config.backend.type} transport was closed; build a new client")
            if self.host is not None:
                return
            self._start()
            if self.host is None:
                from icefloe.engines.host import EngineHost

                engines = {"training": self.training, "sampling": self.sampling, "reference": self.reference}
                self.host = EngineHost(
                    engines,
                    checkpoint_root=self.checkpoint_root,
                    sync_weights=self._sync_weights,
                    abandoned=self._abandoned,
                    lora_reference=self.config.lora is not None,
                )
                self._owns_host = True

    def handle(self, request: Request) -> Future:
        if self._closed:
            error = ClientClosedError(f"cannot run {request.op!r}: the client was shut down; build a new client")
            return _failed(error)
        if self.host is None:
            return _failed(RuntimeError(f"cannot run {request.op!r}: call open() before handle()"))
        return self.host.submit(request)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.host is None:
                return
            if self._owns_host:
                self.host.close()
            self._stop()

    def _abandoned(self) -> str | None:
        return "the client was shut down" if self._closed else None

    @abc.abstractmethod
    def _start(self) -> None:
        """Create or attach the role objects (called once, under the lock)."""

    @abc.abstractmethod
    def _stop(self) -> None:
        """Release what ``_start`` created (called once, under the lock, after the workers drained)."""

    def _worker(self, role: str) -> Any:
        """The ordered worker of ``role``, for a subclass's ``_sync_weights``."""
        return self.host.lanes[role]


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future
