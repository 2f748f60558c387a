"""SkyRL integration: SkyRL keeps its trainer loop, generator and environments; icefloe runs the compute.

Two ways in, both ending in :mod:`icefloe.integrations.skyrl.entrypoint`::

    python -m icefloe.integrations.skyrl <SkyRL overrides>      # installs the driver shims first
    python -m skyrl.train.entrypoints.main_base \\
        trainer.override_entrypoint=icefloe.integrations.skyrl.entrypoint <SkyRL overrides>

Nothing here imports SkyRL, torch or Ray at import time; SkyRL itself needs Python 3.12.
"""

from __future__ import annotations

__all__ = ["SHIM_MARKER", "install_driver_shims"]

# Attribute set on every function this package installs into SkyRL, so a second install is a no-op.
SHIM_MARKER = "_icefloe_shimmed"


def install_driver_shims() -> bool:
    """Make SkyRL's GPU peer-access probe answer ``False``, so a CPU-only driver does not hang.

    ``prepare_runtime_environment`` probes CUDA peer access whenever more than one GPU per node is
    configured; without a local GPU the probe starts Ray and waits forever for a two-GPU placement
    group. The answer only matters to SkyRL's own engines, which never run under icefloe.
    Idempotent: returns ``True`` when this call installed the shim, ``False`` when it was there.
    """
    from skyrl.train.utils import utils as skyrl_utils

    if getattr(skyrl_utils.peer_access_supported, SHIM_MARKER, False):
        return False

    def peer_access_supported(max_num_gpus_per_node: int) -> bool:
        return False

    setattr(peer_access_supported, SHIM_MARKER, True)
    skyrl_utils.peer_access_supported = peer_access_supported
    return True
