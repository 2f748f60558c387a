"""Apps and clients for the service tests: ASGI in-process, or a real uvicorn on a loopback port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from icefloe.service.app import ServerThread, create_app
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.settings import ServeSettings


def make_app(data_dir: Path, *, slots: int = 4, **settings):
    return create_app(ServeSettings(data_dir=data_dir, **settings), pool=SlotPool("cpu", slots))


@contextlib.asynccontextmanager
async def asgi_client(app) -> AsyncIterator[httpx.AsyncClient]:
    """httpx straight into the ASGI app, with its lifespan entered (ASGITransport does not)."""
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://icefloe.test", timeout=60) as client,
    ):
        yield client


@contextlib.asynccontextmanager
async def uvicorn_client(app, **client_kwargs) -> AsyncIterator[httpx.AsyncClient]:
    """A real uvicorn on a free loopback port, in a thread, and a keep-alive client to it."""
    with ServerThread(app) as base_url:
        async with httpx.AsyncClient(base_url=base_url, timeout=60, **client_kwargs) as client:
            yield client


@contextlib.asynccontextmanager
async def client_for(app, transport: str) -> AsyncIterator[httpx.AsyncClient]:
    opener = asgi_client if transport == "asgi" else uvicorn_client
    async with opener(app) as client:
        yield client


def wrap_engine_method(monkeypatch, method: str, wrapper) -> None:
    """Route every engine call of ``method`` in this process through ``wrapper(run, sub_job_id, *args)``,
    where ``run()`` makes the real call: a fault or a probe on one engine method."""
    from icefloe.service.hosts.seam import LocalEngineHost

    original = LocalEngineHost.call

    def call(self, sub_job_id, name, args=(), kwargs=None):
        if name != method:
            return original(self, sub_job_id, name, args, kwargs)
        return wrapper(lambda: original(self, sub_job_id, name, args, kwargs), sub_job_id, *args)

    monkeypatch.setattr(LocalEngineHost, "call", call)
