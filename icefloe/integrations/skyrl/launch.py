"""``python -m icefloe.integrations.skyrl``: install the driver shims, then run SkyRL's own entrypoint.

The launcher only edits the command line: it adds the override flag that routes SkyRL to
:mod:`icefloe.integrations.skyrl.entrypoint`, and the remote-inference settings SkyRL's validator
insists on although icefloe does the sampling. Which settings depends on the SkyRL generation:
commits that still have ``remote_urls`` assert ``num_engines == len(remote_urls)``; the newer
inference layer rejects ``remote_urls`` and wants ``external_server_urls`` instead.
"""

from __future__ import annotations

import dataclasses
import runpy
import sys
from collections.abc import Sequence

from icefloe.integrations.skyrl import install_driver_shims
from icefloe.protocol import ConfigError

__all__ = ["ENTRYPOINT", "OVERRIDE_FLAG", "PLACEHOLDER_URL", "main", "prepare_argv", "skyrl_has_remote_urls"]

ENTRYPOINT = "icefloe.integrations.skyrl.entrypoint"
OVERRIDE_FLAG = "trainer.override_entrypoint"
SKYRL_MAIN = "skyrl.train.entrypoints.main_base"
# Stands in for a sampling server SkyRL's validator wants to see; icefloe never lets SkyRL contact it.
PLACEHOLDER_URL = "http://icefloe-sampling"
_ENGINES = "generator.inference_engine"
# The newest SkyRL commit examples/skyrl/README.md lists as supported.
_SKYRL_GIT = "git+https://github.com/NovaSky-AI/SkyRL@a9564572"


def _overrides(argv: Sequence[str]) -> dict[str, str]:
    """``key=value`` arguments as a dict (the last occurrence wins, as in SkyRL's parser)."""
    found = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep:
            found[key.lstrip("+")] = value
    return found


def prepare_argv(argv: Sequence[str], *, legacy_remote_urls: bool) -> list[str]:
    """Return SkyRL arguments with the icefloe override flag and remote-inference settings added.

    Args:
        argv: the user's SkyRL overrides (without the program name).
        legacy_remote_urls: the installed SkyRL still has ``generator.inference_engine.remote_urls``.

    Raises:
        ConfigError: ``run_engines_locally=true`` was asked for; SkyRL's engines would sit unused.
    """
    args = list(argv)
    given = _overrides(args)
    if OVERRIDE_FLAG not in given:
        args.append(f"{OVERRIDE_FLAG}={ENTRYPOINT}")
    local = given.get(f"{_ENGINES}.run_engines_locally")
    if local is None:
        args.append(f"{_ENGINES}.run_engines_locally=false")
    elif local.strip().lower() not in ("false", "0"):
        raise ConfigError(
            f"{_ENGINES}.run_engines_locally={local} would start SkyRL's own inference engines, but icefloe does "
            "the sampling; remove the override"
        )
    try:
        num_engines = int(given.get(f"{_ENGINES}.num_engines", "1"))
    except ValueError:
        raise ConfigError(
            f"{_ENGINES}.num_engines must be an integer; got {given[f'{_ENGINES}.num_engines']!r}"
        ) from None
    urls = "[" + ",".join([PLACEHOLDER_URL] * max(num_engines, 1)) + "]"
    if legacy_remote_urls:
        if f"{_ENGINES}.remote_urls" not in given:
            args.append(f"{_ENGINES}.remote_urls={urls}")
    elif f"{_ENGINES}.external_server_urls" not in given and f"{_ENGINES}.external_proxy_url" not in given:
        args.append(f"{_ENGINES}.external_server_urls={urls}")
    return args


def skyrl_has_remote_urls() -> bool:
    """True when the installed SkyRL is a generation that validates ``remote_urls``."""
    from skyrl.train.config.config import InferenceEngineConfig

    return "remote_urls" in {field.name for field in dataclasses.fields(InferenceEngineConfig)}


def main(argv: Sequence[str] | None = None) -> None:
    """Install the shims, rewrite ``sys.argv`` and run SkyRL's entrypoint as ``__main__``."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        install_driver_shims()
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("skyrl"):
            raise
        raise ImportError(
            f"SkyRL is not installed; it needs Python 3.12 and a commit with trainer.override_entrypoint: "
            f"pip install 'skyrl[skyrl-train] @ {_SKYRL_GIT}' 'skyrl-gym @ {_SKYRL_GIT}#subdirectory=skyrl-gym' "
            "'icefloe[skyrl]' (examples/skyrl/README.md lists the supported commits)"
        ) from None
    sys.argv = [SKYRL_MAIN, *prepare_argv(args, legacy_remote_urls=skyrl_has_remote_urls())]
    runpy.run_module(SKYRL_MAIN, run_name="__main__", alter_sys=True)
