"""The client API: ``Client`` and ``AsyncClient`` over the local, Ray and remote transports."""

from icefloe.client.batch import build_batch, to_canonical
from icefloe.client.client import AsyncClient, Client

__all__ = ["AsyncClient", "Client", "build_batch", "to_canonical"]
