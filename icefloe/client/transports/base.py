"""The transport seam: deliver a ``Request``, get a future of the backend's answer.

A transport knows nothing of op semantics beyond routing; ``icefloe.client.ops`` builds requests
and parses answers. Three verbs: ``open`` (blocking, idempotent: load engines, create or re-attach
a job), ``handle`` (returns a ``concurrent.futures.Future`` at once; the op's place in line is fixed
by this call) and ``close`` (idempotent). ``Client`` blocks on the future; ``AsyncClient`` awaits it
with ``asyncio.wrap_future`` and opens with ``asyncio.to_thread``.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from typing import Any

from icefloe.protocol import Request

__all__ = ["Transport", "finished"]


class Transport(abc.ABC):
    """Delivers requests to one backend. Constructors do no I/O; ``open`` does."""

    #: The ops this backend executes; the client turns the others into clear errors or no-ops.
    capabilities: frozenset[str] = frozenset()

    @abc.abstractmethod
    def open(self) -> None:
        """Attach: load engines or create/re-attach the job. Blocking; idempotent."""

    @abc.abstractmethod
    def handle(self, request: Request) -> Future:
        """Queue one request in call order; never blocks. A request refused outright raises here."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything this transport opened. Idempotent."""

    def probe_capabilities(self) -> frozenset[str]:
        """The ops this backend executes, learned without creating a job or loading engines.

        Integrations call it before building a client, to refuse settings the backend cannot serve.
        """
        return self.capabilities

    def log_metrics(self, metrics: dict[str, float], step: int) -> Future:
        """Add client-side scalars (already checked) to the job's per-step series on the backend.

        Only a service keeps such a series; this default (the local and Ray backends) sends nothing
        and returns a finished future of None: their metrics go to the client's own trackers.
        """
        return finished(None)

    @abc.abstractmethod
    def handle_info(self) -> dict[str, Any]:
        """JSON-safe data another process (or actor) needs to re-attach; never a secret."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, when this backend can provide one locally."""
        return None


def finished(result: Any) -> Future:
    """A future that already holds ``result``: an answer known when the op is called."""
    done: Future = Future()
    done.set_result(result)
    return done
