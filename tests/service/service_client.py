"""A small async client of the training API for the service tests (plain httpx + the wire codec)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from icefloe import wire

from .service_batches import small_batch

PREFIX = "/api/v2/databases/DB/schemas/SC/cortex-training"
TRAINING = {
    "job_type": "training",
    "model_name": "tiny:arith",
    "training_config": {"optimizer": {"name": "AdamW", "lr": 1e-3}, "max_seq_len": 64},
}
SAMPLING = {"job_type": "sampling", "model_name": "tiny:arith", "inference_config": {"max_seq_len": 64}}


class Api:
    """Calls under the training-API prefix; raises on any non-2xx unless ``check=False``."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.http = client

    async def call(self, method: str, path: str, *, check: bool = True, **kwargs: Any) -> httpx.Response:
        response = await self.http.request(method, PREFIX + path, **kwargs)
        if check and response.status_code >= 300:
            raise AssertionError(f"{method} {path} -> {response.status_code}: {response.text}")
        return response

    async def create(self, *sub_job_configs: dict[str, Any], **extra: Any) -> str:
        body = {"sub_job_configs": list(sub_job_configs or (TRAINING, SAMPLING)), **extra}
        return (await self.call("POST", "/", json=body)).json()["job_id"]

    async def running(self, *sub_job_configs: dict[str, Any]) -> str:
        """A new job (training only unless configs are given), once it runs."""
        job_id = await self.create(*(sub_job_configs or (TRAINING,)))
        await self.wait_status(job_id, "running")
        return job_id

    async def job(self, job_id: str) -> dict[str, Any]:
        return (await self.call("GET", f"/{job_id}")).json()

    async def wait_status(self, job_id: str, *wanted: str, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            job = await self.job(job_id)
            if job["status"] in wanted:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} stayed {job['status']} ({job['reason']}); wanted {wanted}")
            await asyncio.sleep(0.05)

    async def post_frame(
        self,
        job_id: str,
        endpoint: str,
        obj: Any,
        *,
        op_metadata: dict | None = None,
        check: bool = True,
        headers: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        frame = wire.encode(obj, op_metadata=op_metadata)
        return await self.call(
            "POST",
            f"/{job_id}/{endpoint}",
            content=frame,
            check=check,
            headers={"content-type": "application/octet-stream", **(headers or {})},
            **kwargs,
        )

    async def poll(self, job_id: str, request_id: str, *, wait: float = 30.0, **params: Any) -> dict[str, Any]:
        response = await self.call("GET", f"/{job_id}/requests/{request_id}", params={"wait": wait, **params})
        return response.json()

    async def result(self, job_id: str, request_id: str, *, timeout_s: float = 60.0) -> Any:
        """Wait for the request and decode its result in whichever form it came."""
        deadline = time.monotonic() + timeout_s
        events: list[dict[str, Any]] = []
        cursor = None
        while True:
            params = {"cursor": cursor} if cursor else {}
            body = await self.poll(job_id, request_id, **params)
            if body["status"] in ("failed", "cancelled"):
                raise AssertionError(f"request {request_id} {body['status']}: {body['error']}")
            events.extend(body["events"])
            if body["next_cursor"]:
                cursor = body["next_cursor"]
                continue
            if body["status"] == "done":
                if events:
                    return wire.decode(wire.join_result_events(events))
                if body["result"].get("wire_format") == "DSSST1":
                    return wire.decode_inline_result(body["result"])
                return body["result"]
            if time.monotonic() > deadline:
                raise AssertionError(f"request {request_id} still {body['status']}")

    async def fwd_bwd(self, job_id: str, seed: int = 0) -> Any:
        """A forward-backward of a small batch, done: what a step needs before it."""
        accepted = (await self.post_frame(job_id, "forward-backward", small_batch(seed))).json()
        return await self.result(job_id, accepted["request_id"])

    async def run(self, job_id: str, method: str, path: str, **kwargs: Any) -> Any:
        """POST a JSON op and wait for its result."""
        accepted = (await self.call(method, f"/{job_id}/{path}", **kwargs)).json()
        return await self.result(job_id, accepted["request_id"])
