"""The transport seam: deliver a ``Request``, return the backend's answer.

A transport knows nothing of op semantics beyond routing; ``icefloe.client.ops`` builds requests
and parses answers. Each flavour has two verbs (``handle``/``close`` and ``handle_async``/``aclose``)
plus ``open``/``aopen`` for the I/O that attaching needs (loading engines, creating a job).
"""

from __future__ import annotations

import abc
from typing import Any

from icefloe.protocol import Request

__all__ = ["Transport"]


class Transport(abc.ABC):
    """Delivers requests to one backend. Constructors do no I/O; ``open`` does."""

    #: The ops this backend executes; the client turns the others into clear errors or no-ops.
    capabilities: frozenset[str] = frozenset()

    @abc.abstractmethod
    def open(self) -> None:
        """Attach: load engines or create/re-attach the job. Idempotent."""

    async def aopen(self) -> None:
        """Async ``open``; the default runs the blocking one in a thread."""
        import asyncio

        await asyncio.to_thread(self.open)

    @abc.abstractmethod
    def handle(self, request: Request) -> Any:
        """Deliver one request and block for its result."""

    @abc.abstractmethod
    async def handle_async(self, request: Request) -> Any:
        """Deliver one request without blocking the event loop."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything this transport opened. Idempotent."""

    async def aclose(self) -> None:
        """Async ``close``; the default runs the blocking one in a thread."""
        import asyncio

        await asyncio.to_thread(self.close)

    def probe_capabilities(self) -> frozenset[str]:
        """The ops this backend executes, learned without creating a job or loading engines.

        Integrations call it before building a client, to refuse settings the backend cannot serve.
        """
        return self.capabilities

    @abc.abstractmethod
    def handle_info(self) -> dict[str, Any]:
        """JSON-safe data another process (or actor) needs to re-attach; never a secret."""

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, when this backend can provide one locally."""
        return None
