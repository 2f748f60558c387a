"""What this service offers beyond the managed endpoint, and how much compute it has."""

from __future__ import annotations

from icefloe import protocol as p
from icefloe.service.results import MAX_EVENTS_CAP
from icefloe.service.routes import JobsDep, SettingsDep, api_router
from icefloe.service.schemas import Capabilities, Capacity

__all__ = ["SUPPORTED_OPERATIONS", "router"]

router = api_router("capabilities")

# operation_type values POST {job}/operation executes (an op of the engine table with no route of its
# own among them); the others answer 501.
SUPPORTED_OPERATIONS = (p.OP_FORWARD, p.OP_WEIGHT_SYNC, *sorted(p.ENGINE_OPERATIONS), "cancel-request", "tail-logs")
# Every op but sleep / wake (the client answers those itself) and get-checkpoint (no route reads one checkpoint).
_NOT_SERVED = {p.OP_GET_CHECKPOINT, p.OP_SLEEP_TRAINING, p.OP_WAKE_TRAINING, p.OP_SLEEP_INFERENCE, p.OP_WAKE_INFERENCE}


@router.get("/capabilities", response_model=Capabilities)
async def capabilities(settings: SettingsDep) -> dict:
    return {
        "ops": [*sorted(p.OPS - _NOT_SERVED), "export-checkpoint"],  # export: a route with no op of its own
        "operations": list(SUPPORTED_OPERATIONS),
        "extensions": {
            "long_poll": True,
            "idempotency_keys": True,
            "forward": True,
            "inline_wait": True,
            "sequenced_submit": True,
            "batch_requests": True,  # POST {prefix}/requests:batch: several numbered POSTs in one (service/batches.py)
            "leases": bool(settings.lease_ttl_s),  # renew with POST {job}:heartbeat well within lease_ttl_ms
            "job_metrics": True,  # POST {job}/metrics takes client-reported scalars; GET {job}/metrics the series
        },
        "limits": {
            "max_post_bytes": settings.max_post_bytes,
            "max_events": MAX_EVENTS_CAP,
            "max_long_poll_s": int(settings.max_long_poll_s),
            "lease_ttl_ms": int(settings.lease_ttl_s * 1000),
        },
    }


@router.get("/capacity", response_model=Capacity)
async def capacity(jobs: JobsDep) -> dict:
    return jobs.capacity()
