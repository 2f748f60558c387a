"""verl plugin: importing this module registers the backend name ``icefloe`` with verl.

Loaded by ``VERL_USE_EXTERNAL_MODULES=icefloe.integrations.verl`` or the ``verl.plugins`` entry
point. It registers three things: the backend class (eagerly; it is light), and zero-argument
loaders for the forwarder worker and the rollout replica, so torch, icefloe's engines and verl's
worker machinery load only in processes that build one. V1 is detected by probing
``verl.trainer.ppo.v1.trainer_remote_backend``. On a verl without the remote-backend seam (the
PyPI releases) only the replica is registered; see ``icefloe.integrations.verl.launch``.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

__all__ = ["NAME", "V1_PROBE", "config_dir", "load_replica", "load_worker", "register", "seam_version"]

logger = logging.getLogger(__name__)

NAME = "icefloe"
V1_PROBE = "verl.trainer.ppo.v1.trainer_remote_backend"
_SEAM_MODULE = "verl.remote_backend.base"


def seam_version() -> str:
    """``"v1"`` when verl carries the V1 remote-backend trainer, else ``"v0"``."""
    try:
        importlib.import_module(V1_PROBE)
    except ImportError:
        return "v0"
    return "v1"


def load_worker() -> type:
    """The forwarder worker class for the installed verl (imports verl's worker machinery)."""
    if seam_version() == "v1":
        from icefloe.integrations.verl.worker_v1 import IcefloeV1ActorRolloutRefWorker

        return IcefloeV1ActorRolloutRefWorker
    from icefloe.integrations.verl.worker_v0 import IcefloeActorRolloutRefWorker

    return IcefloeActorRolloutRefWorker


def load_replica() -> type:
    """The rollout replica class (imports Ray only when it launches its server, never vLLM)."""
    from icefloe.integrations.verl.rollout import IcefloeReplica

    return IcefloeReplica


def config_dir() -> str:
    """The folder to add to Hydra's search path (``hydra.searchpath=[file://<this>]``)."""
    return str(Path(__file__).resolve().parent / "config")


def register() -> list[str]:
    """Register ``icefloe`` in verl's registries; returns what was registered.

    Same objects twice is a no-op (verl's rule). Without verl installed nothing is registered, so
    the helper modules of this package stay importable on their own.
    """
    try:
        from verl.workers.rollout.replica import RolloutReplicaRegistry
    except ImportError:
        logger.debug("verl is not installed: the icefloe plugin registered nothing")
        return []
    RolloutReplicaRegistry.register(NAME, load_replica)
    try:
        seam = importlib.import_module(_SEAM_MODULE)
    except ImportError:
        logger.debug("verl has no %s: only the icefloe rollout replica was registered", _SEAM_MODULE)
        return ["replica"]
    from icefloe.integrations.verl.backend import IcefloeBackend

    abc_base = getattr(seam, "RemoteBackend", None)
    if abc_base is not None and hasattr(abc_base, "register") and not issubclass(IcefloeBackend, abc_base):
        abc_base.register(IcefloeBackend)  # virtual subclass: isinstance checks pass, no abstract stubs needed
    seam.RemoteBackendRegistry.register(NAME)(IcefloeBackend)
    seam.RemoteBackendRegistry.register_worker(NAME, load_worker)
    return ["backend", "worker", "replica"]


register()
