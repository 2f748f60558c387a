"""Named dependencies, so a route's signature lists what it needs.

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency on its thread pool,
and that hop alone cost about a millisecond per call on a loaded machine. The bearer token is
not one of them: :class:`icefloe.service.middleware.RequireToken` checks it before any body is read.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from icefloe.service.jobs import JobManager
from icefloe.service.settings import ServeSettings
from icefloe.service.store import Database

__all__ = ["JobsDep", "OctetBody", "SettingsDep", "StoreDep"]


async def _settings(request: Request) -> ServeSettings:
    return request.app.state.settings


async def _jobs(request: Request) -> JobManager:
    return request.app.state.jobs


async def _store(request: Request) -> Database:
    return request.app.state.db


async def _octet_body(request: Request) -> bytes:
    return await request.body()  # the size cap is enforced while reading (see middleware.BodyLimit)


SettingsDep = Annotated[ServeSettings, Depends(_settings)]
JobsDep = Annotated[JobManager, Depends(_jobs)]
StoreDep = Annotated[Database, Depends(_store)]
OctetBody = Annotated[bytes, Depends(_octet_body)]
