"""Transports, one module per backend; ``make_transport`` is the only map from backend type to class."""

from __future__ import annotations

import importlib.util
from typing import Any

from icefloe.client.transports.base import Transport
from icefloe.config import ClientConfig

__all__ = ["Transport", "make_transport", "probe_capabilities"]


def make_transport(config: ClientConfig, handle: dict[str, Any] | None = None) -> Transport:
    """Build (not open) the transport for ``config.backend.type``; heavy imports happen here, lazily."""
    kind = config.backend.type
    if kind == "local":
        if importlib.util.find_spec("torch") is None:  # the light install: fail here, not at the first op
            raise ImportError("backend.type='local' runs the engines in this process: pip install 'icefloe[torch]'")
        from icefloe.client.transports.local import LocalTransport

        return LocalTransport(config, handle=handle)
    if kind == "remote":
        from icefloe.client.transports.remote import RemoteTransport

        return RemoteTransport(config, handle=handle)
    if kind == "ray":
        try:
            from icefloe.client.transports.ray import RayTransport
        except ModuleNotFoundError as exc:
            if exc.name == "ray":
                raise ImportError("backend.type='ray' needs Ray: pip install 'icefloe[ray]'") from None
            raise
        return RayTransport(config, handle=handle)
    raise AssertionError(f"unreachable: backend type {kind!r} passed validation")


def probe_capabilities(config: ClientConfig) -> frozenset[str]:
    """The ops ``config``'s backend executes, asked before any job is created or engine loaded."""
    transport = make_transport(config)
    try:
        return transport.probe_capabilities()
    finally:
        transport.close()
