"""Fixtures: SkyRL stand-ins in ``sys.modules``, a clean backend environment, a parsed SkyRL config."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from . import skyrl_standins

# Integration modules that import SkyRL at module level: re-imported against each test's stand-ins.
_SKYRL_BOUND = (
    "icefloe.integrations.skyrl.entrypoint",
    "icefloe.integrations.skyrl.generator",
    "icefloe.integrations.skyrl.trainer",
)


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A caller's shell must not reroute the backend mid-suite."""
    for name in list(os.environ):
        if name.startswith(("ICEFLOE_", "ARCTIC_")):
            monkeypatch.delenv(name)


@pytest.fixture
def install_skyrl(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., dict[str, Any]]]:
    """Install the stand-ins of one SkyRL generation (``legacy_inference`` keeps ``remote_urls``)."""

    def install(*, legacy_inference: bool = False) -> dict[str, Any]:
        for name in _SKYRL_BOUND:
            monkeypatch.delitem(sys.modules, name, raising=False)
        modules = skyrl_standins.build_modules(legacy_inference=legacy_inference)
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return modules

    yield install


@pytest.fixture
def skyrl(install_skyrl: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """The current SkyRL generation's stand-ins."""
    return install_skyrl()


@pytest.fixture
def make_cfg(skyrl: dict[str, Any]) -> Callable[..., Any]:
    """Parse SkyRL overrides with the integration's extended config class, as the entrypoint does."""

    def make(*overrides: str) -> Any:
        from icefloe.integrations.skyrl.config import IcefloeSection
        from icefloe.integrations.skyrl.entrypoint import skyrl_config_class

        cfg = skyrl_config_class().from_cli_overrides(list(overrides))
        if cfg.trainer.icefloe is None:
            cfg.trainer.icefloe = IcefloeSection()
        return cfg

    return make
