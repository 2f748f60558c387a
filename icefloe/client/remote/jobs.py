"""Jobs on the service: the capability probe, the create body, waiting for ``running``, sub-job ids.

``icefloe serve`` advertises its ops and extensions at ``GET {prefix}/capabilities``; the managed
endpoint has no such route, so a 4xx there means "managed", with its fixed op set.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from icefloe import protocol as api
from icefloe.client.remote.http import Call, Http
from icefloe.client.remote.polling import Backoff
from icefloe.config import ClientConfig

__all__ = [
    "MANAGED_OPS",
    "JobRef",
    "ServiceInfo",
    "export_checkpoint",
    "job_create_body",
    "job_object",
    "list_checkpoints",
    "probe_service",
    "sub_jobs_of",
    "wait_running",
]

_log = logging.getLogger("icefloe.client.remote")

MANAGED_OPS: Final = api.OPS - api.MEMORY_OPS - {api.OP_FORWARD}  # what the managed endpoint executes
# Capability names that differ from the op constants.
_CAPABILITY_ALIASES: Final = {"export-checkpoint": api.OP_GET_CHECKPOINT}
_ENGINE_KWARGS_SET_BY_API: Final = ("max_model_len", "tensor_parallel_size")  # the API sets these itself


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """What the service at the other end offers: its ops, extensions (docs/service.md) and limits."""

    managed: bool  # True = the managed endpoint (no /capabilities)
    ops: frozenset[str]
    extensions: frozenset[str] = frozenset()  # those advertised as true: "long_poll", "inline_wait", ...
    max_post_bytes: int | None = None
    max_long_poll_s: float | None = None
    lease_ttl_s: float | None = None  # a job nobody renews for this long is cancelled (POST {job}:heartbeat)


@dataclass(frozen=True, slots=True)
class JobRef:
    """A job and its sub-job ids by type (``training``, ``sampling``, ``log_probability``)."""

    job_id: str
    sub_jobs: dict[str, list[str]] = field(default_factory=dict)

    def first(self, job_type: str) -> str | None:
        return next(iter(self.sub_jobs.get(job_type) or ()), None)


async def probe_service(http: Http) -> ServiceInfo:
    reply = await http.send(Call("GET", "/capabilities", "capabilities", accept=frozenset({400, 404, 405})))
    body = reply.body if isinstance(reply.body, Mapping) else None
    if reply.status_code >= 400 or body is None or "ops" not in body:
        return ServiceInfo(managed=True, ops=MANAGED_OPS)
    ops = frozenset(_CAPABILITY_ALIASES.get(str(op), str(op)) for op in body.get("ops") or ())
    extensions = frozenset(name for name, on in (body.get("extensions") or {}).items() if on)
    limits = body.get("limits") or {}
    return ServiceInfo(
        managed=False,
        ops=ops,
        extensions=extensions,
        max_post_bytes=int(limits["max_post_bytes"]) if limits.get("max_post_bytes") else None,
        max_long_poll_s=float(limits["max_long_poll_s"]) if limits.get("max_long_poll_s") else None,
        lease_ttl_s=limits["lease_ttl_ms"] / 1000 if "leases" in extensions and limits.get("lease_ttl_ms") else None,
    )


def job_create_body(config: ClientConfig, experiment_name: str | None = None) -> dict[str, Any]:
    """The create-job body: sampling / log_probability sub-jobs first, training last (the NCCL root)."""
    _warn_unmapped_knobs(config)
    common = {"model_name": config.model, "seed": config.seed, "dtype": config.dtype}
    inference = {"max_seq_len": config.max_seq_len}
    engine_kwargs = {k: v for k, v in config.sampling.engine_kwargs.items() if k not in _ENGINE_KWARGS_SET_BY_API}
    # LoRA on the trainer and the samplers (a weight sync moves adapters). A LoRA trainer is its own
    # reference policy (the base with the adapters disabled), so no log_probability sub-job is asked for.
    peft = {"peft_config": config.lora.to_peft_config()} if config.lora is not None else {}
    subs: list[dict[str, Any]] = []
    if config.num_sampling_workers > 0:
        sampling = {**inference, "n_gpus": config.num_sampling_workers, **peft}
        if engine_kwargs:
            sampling["vllm_config"] = engine_kwargs
        subs.append({"job_type": "sampling", **common, "inference_config": sampling})
    if gpus := _reference_gpus(config):
        subs.append({"job_type": "log_probability", **common, "inference_config": {**inference, "n_gpus": gpus}})
    adamw = config.training.optimizer.model_dump(mode="json", include={"lr", "betas", "eps", "weight_decay"})
    training = {
        "optimizer": {"name": "AdamW", **adamw},
        "max_seq_len": config.max_seq_len,
        "train_batch_size": config.num_training_workers,  # one sequence per rank per micro-step; batches vary
        "n_gpus": config.num_training_workers,
        "gradient_clipping": config.training.grad_clip,
    }
    if config.training.peak_memory_log:
        training["step_peak_memory_log"] = True
    if config.training.micro_batch_tokens is not None:
        training["mb_spec"] = {"max_tokens_per_mb": config.training.micro_batch_tokens}
    if config.training.gradient_checkpointing:
        training["activation_checkpointing"] = True
    training.update(peft)
    subs.append({"job_type": "training", **common, "training_config": training})
    body: dict[str, Any] = {"sub_job_configs": subs}
    if experiment_name:
        body["experiment_name"] = experiment_name
    return body


def _reference_gpus(config: ClientConfig) -> int:
    """GPUs of the log_probability sub-job (0: none); LoRA needs none, its trainer scores the reference."""
    return config.num_log_prob_workers if config.lora is None else 0


def _warn_unmapped_knobs(config: ClientConfig) -> None:
    """The training API has no field for these; say so instead of ignoring them silently."""
    ignored = ["training.checkpoint_dir"] if config.training.checkpoint_dir is not None else []
    ignored += ["sampling.engine"] if config.sampling.engine != "auto" else []
    if ignored:
        _log.warning("backend.type='remote' ignores %s: the training API has no such field", ", ".join(ignored))


def job_object(body: Any) -> dict[str, Any]:
    """A job from a job answer, unwrapped where a front door wraps it in ``{"job": ...}``."""
    if isinstance(body, Mapping) and isinstance(body.get("job"), Mapping) and "status" not in body:
        return dict(body["job"])
    return dict(body) if isinstance(body, Mapping) else {}


def sub_jobs_of(job_id: str, job: Mapping[str, Any], config: ClientConfig) -> dict[str, list[str]]:
    """Sub-job ids by type from a job object; those ``config`` asks for and the job lacks follow
    ``{job_id}:{segment}:{index}``."""
    found: dict[str, list[str]] = {}
    for sub in job.get("sub_jobs") or ():
        if isinstance(sub, Mapping) and sub.get("sub_job_id"):
            found.setdefault(api.normalize_job_type(sub.get("job_type")), []).append(str(sub["sub_job_id"]))
    expected = {
        "training": 1,
        "sampling": int(config.num_sampling_workers > 0),
        "log_probability": int(_reference_gpus(config) > 0),
    }
    for job_type, count in expected.items():
        if count and not found.get(job_type):
            found[job_type] = [f"{job_id}:{api.SEGMENT_BY_JOB_TYPE[job_type]}:{i}" for i in range(count)]
    return found


async def wait_running(http: Http, job_id: str, *, backoff: Backoff, timeout_s: float) -> dict[str, Any]:
    """Poll ``GET /{job_id}`` until ``running``, logging why a job waits (the ``reason`` while placing).

    Raises:
        JobFailedError: a terminal state, with the job's ``reason`` and every sub-job's status.
        IcefloeTimeoutError: not running after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    sleeps = backoff.sleeps(deadline)
    status, shown = "unknown", ""
    while True:
        reply = await http.send(Call("GET", f"/{job_id}", "wait for job"))
        job = job_object(reply.body)
        status = api.normalize_job_state(job.get("status", "unknown"))
        reason = str(job.get("reason") or "") if status in ("pending", "placing") else ""
        if reason and reason != shown:
            _log.warning("job %s is %s: %s", job_id, status, reason)
            shown = reason
        if status == "running":
            return job
        if status in api.JOB_TERMINAL_STATES:
            sub_status = {
                str(sub.get("sub_job_id")): api.normalize_job_state(sub.get("status", "unknown"))
                for sub in job.get("sub_jobs") or ()
                if isinstance(sub, Mapping)
            }
            raise api.JobFailedError(job_id, status, str(job.get("reason") or ""), sub_status)
        if time.monotonic() >= deadline:
            why = f" ({reason})" if reason else ""
            raise api.IcefloeTimeoutError(
                f"job {job_id} is still {status} after {timeout_s:g} s{why}; a service starts a job once its "
                "slots are free (a managed endpoint also cold-starts for minutes): free slots, or raise "
                "job_ready_timeout_s to wait longer"
            )
        await asyncio.sleep(next(sleeps))


async def list_checkpoints(http: Http, job_id: str) -> list[dict[str, Any]]:
    """Checkpoint records of a job, also after the job ended."""
    reply = await http.send(Call("GET", f"/{job_id}/checkpoints", "list checkpoints"))
    return list((reply.body if isinstance(reply.body, Mapping) else {}).get("checkpoints") or [])


async def export_checkpoint(http: Http, job_id: str, checkpoint_id: str) -> dict[str, Any]:
    """Short-lived download URLs: ``{checkpoint_id, files: [{filename, url, size_bytes}], expires_at}``."""
    path = f"/{job_id}/checkpoints/{checkpoint_id}:export"
    reply = await http.send(Call("POST", path, "export checkpoint", idempotency_key=str(uuid.uuid4())))
    return dict(reply.body or {})
