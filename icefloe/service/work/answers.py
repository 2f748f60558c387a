"""How a finished item's result becomes the stored answer of the API that asked.

The training API answers in its own envelope (``job_id``, ``global_steps``, public checkpoint paths);
the Tinker API stores the engine's result as it is (tensors as a DSSST1 frame, never JSON lists) and
renders it when its future is polled (:mod:`icefloe.service.tinker.convert`). One function per API,
picked by the door's ``api``: no route hands the worker a callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from icefloe.service.results import JsonText
from icefloe.service.work.items import FwdBwd, Load, Sample, Save, Step

if TYPE_CHECKING:
    from icefloe.service.settings import ServeSettings

__all__ = ["TINKER", "TRAINING", "render"]

TRAINING: Final = "training"
TINKER: Final = "tinker"


def render(api: str, settings: ServeSettings, job: Any, item: Any, result: Any) -> Any:
    """``result`` of ``item`` (run on ``job``) as ``api`` stores it."""
    if api == TINKER:
        if isinstance(item, Save):  # the answer names no server folder
            return {key: value for key, value in result.items() if key != "path"}
        return result
    shape = _TRAINING.get(type(item))
    return shape(settings, job, item, result) if shape is not None else result


def _fwd_bwd(settings: ServeSettings, job: Any, item: FwdBwd, result: dict[str, Any]) -> dict[str, Any]:
    job.last_avg_loss[item.sub_job_id] = float(result["avg_loss"])  # a save records it with the checkpoint
    return {"job_id": job.job_id, **result, "post_process_outputs": {}}


def _sample(settings: ServeSettings, job: Any, item: Sample, samples: list[Any]) -> Any:
    if item.as_json:  # each sample is JSON text already: spliced in
        return JsonText.object({"job_id": job.job_id}, results=samples)
    return {"job_id": job.job_id, "results": samples}  # a generate-stream event


def _step(settings: ServeSettings, job: Any, item: Step, result: dict[str, Any]) -> dict[str, Any]:
    return {"job_id": job.job_id, "global_steps": result["global_step"], "last_lr": result["lr"], **result}


def _save(settings: ServeSettings, job: Any, item: Save, result: dict[str, Any]) -> dict[str, Any]:
    path, tag = settings.public_path(result["path"]), result["checkpoint_id"]
    return {"job_id": job.job_id, "checkpoint_path": path, "checkpoint_tag": tag, **result, "path": path}


def _load(settings: ServeSettings, job: Any, item: Load, result: dict[str, Any]) -> dict[str, Any]:
    if "path" in result:  # the answer names no server folder
        result = {**result, "path": settings.public_path(result["path"])}
    return {"job_id": job.job_id, **result}


_TRAINING: dict[type, Callable[..., Any]] = {FwdBwd: _fwd_bwd, Sample: _sample, Step: _step, Save: _save, Load: _load}
