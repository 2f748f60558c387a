"""A real ``icefloe serve`` (uvicorn on a loopback port, tmp data dir) shared by one test module."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastapi  # noqa: F401 (the dev extra installs it: fail, never skip)
import pytest
import torch

from icefloe.config import ClientConfig
from icefloe.service.app import ServerThread, create_app
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.settings import ServeSettings


@dataclass
class Service:
    """A running service: its URL and its own SQLite store (to count what it executed)."""

    base_url: str
    app: Any
    data_dir: Path

    def request_counts(self, job_id: str) -> dict[str, int]:
        rows = self.app.state.db.fetch_all(
            "SELECT op, COUNT(*) AS n FROM requests WHERE job_id = ? GROUP BY op", (job_id,)
        )
        return {row["op"]: row["n"] for row in rows}

    def config(self, **backend: Any) -> ClientConfig:
        fast = {
            "poll_interval_s": 0.02,
            "poll_max_interval_s": 0.2,
            "retry_initial_s": 0.01,
            "retry_max_s": 0.05,
        }
        return ClientConfig.build(
            {
                "model": "tiny:arith",
                "seed": 0,
                "backend": {"type": "remote", "base_url": self.base_url, **fast, **backend},
            }
        )


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def serve(tmp_path_factory: pytest.TempPathFactory, **settings: Any) -> Iterator[Service]:
    """Run a service (``settings``: ServeSettings fields) for the fixture that yields from this."""
    data_dir = tmp_path_factory.mktemp("serve")
    app = create_app(ServeSettings(data_dir=data_dir, **settings), pool=SlotPool("cpu", 16))
    with ServerThread(app) as base_url:
        yield Service(base_url, app, data_dir)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from serve(tmp_path_factory)
