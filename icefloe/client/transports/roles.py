"""Op routing shared by the backends whose roles are engine objects: ``local`` and ``ray``.

Each role (training, sampling, reference) owns one ``RoleWorker`` thread, so requests to a role
run strictly in submission order and the async client never blocks its event loop. Concurrent
``generate`` calls coalesce into one batch on the sampling worker. A subclass says how the role
objects come to exist (``_start``), how they go away (``_stop``), and how weights move from the
trainer to the samplers (``_sync_weights``); the routing of every other op lives here once.
"""

from __future__ import annotations

import abc
import json
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from icefloe.client.transports.base import Transport
from icefloe.config import ClientConfig
from icefloe.protocol import (
    OP_CANCEL,
    OP_DELETE_CHECKPOINT,
    OP_FORWARD,
    OP_FWD_BWD,
    OP_GENERATE,
    OP_GET_CHECKPOINT,
    OP_LIST_CHECKPOINTS,
    OP_LOAD,
    OP_RESET_PREFIX_CACHE,
    OP_SAVE,
    OP_SLEEP_INFERENCE,
    OP_SLEEP_TRAINING,
    OP_STEP,
    OP_WAKE_INFERENCE,
    OP_WAKE_TRAINING,
    OP_WEIGHT_SYNC,
    OPS,
    TARGET_REFERENCE,
    ClientClosedError,
    InvalidRequestError,
    Request,
    SamplingParams,
)

__all__ = ["RoleTransport"]


class RoleTransport(Transport):
    """Routes each op to a role object through that role's ordered worker."""

    capabilities = OPS

    def __init__(self, config: ClientConfig, *, session: str, checkpoint_root: Path) -> None:
        self.config = config
        self._session = session
        self._lock = threading.Lock()
        self._opened = False
        self._closed = False
        self.training: Any = None
        self.sampling: Any = None
        self.reference: Any = None
        self._workers: dict[str, Any] = {}
        self.checkpoint_root = Path(checkpoint_root)

    # --- lifecycle -------------------------------------------------------------------------------
    def open(self) -> None:
        with self._lock:
            if self._closed:
                raise ClientClosedError(f"this {self.config.backend.type} transport was closed; build a new client")
            if self._opened:
                return
            self._start()
            self._opened = True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._opened:
                self._stop()

    @abc.abstractmethod
    def _start(self) -> None:
        """Create or attach the role objects and their workers (called once, under the lock)."""

    @abc.abstractmethod
    def _stop(self) -> None:
        """Release what ``_start`` created (called once, under the lock)."""

    @abc.abstractmethod
    def _sync_weights(self, body: dict[str, Any]) -> Future:
        """Copy trainer weights to the samplers after earlier training work and before later sampling work."""

    # --- delivery --------------------------------------------------------------------------------
    def handle(self, request: Request) -> Future:
        return self._submit(request)

    def _submit(self, request: Request) -> Future:
        if self._closed:
            raise ClientClosedError(f"cannot run {request.op!r}: the client was shut down; build a new client")
        self.open()
        body, op = request.body, request.op
        if op == OP_FWD_BWD:
            return self._worker("training").submit(self.training.fwd_bwd, body["batch"])
        if op == OP_FORWARD:
            if request.target == TARGET_REFERENCE:
                if self.reference is None:
                    raise InvalidRequestError(
                        "forward(reference=True) needs a reference role; set num_log_prob_workers=1 in the config"
                    )
                return self._worker("reference").submit(self.reference.forward, body["batch"])
            return self._worker("training").submit(self.training.forward, body["batch"])
        if op == OP_STEP:
            return self._worker("training").submit(self.training.step, body.get("learning_rate"))
        if op == OP_GENERATE:
            return self._generate(body["prompts"], body["sampling_params"])
        if op == OP_WEIGHT_SYNC:
            if self.sampling is None:
                raise InvalidRequestError(
                    "sync_weights needs a sampling role; set num_sampling_workers=1 in the config"
                )
            return self._sync_weights(body)
        if op == OP_SAVE:
            return self._worker("training").submit(
                self.training.save_checkpoint, self.checkpoint_root, kind=body.get("checkpoint_type", "resumable")
            )
        if op == OP_LOAD:
            return self._worker("training").submit(self._load, body["checkpoint_id"])
        if op == OP_LIST_CHECKPOINTS:
            return _done({"checkpoints": self._list_checkpoints()})
        if op == OP_GET_CHECKPOINT:
            return _done(self._get_checkpoint(body["checkpoint_id"]))
        if op == OP_DELETE_CHECKPOINT:
            return self._worker("training").submit(self._delete_checkpoint, body["checkpoint_id"])
        if op in (OP_SLEEP_TRAINING, OP_WAKE_TRAINING):
            method = self.training.sleep if op == OP_SLEEP_TRAINING else self.training.wake
            return self._worker("training").submit(method)
        if op in (OP_SLEEP_INFERENCE, OP_WAKE_INFERENCE, OP_RESET_PREFIX_CACHE):
            if self.sampling is None:
                return _done({})
            if op == OP_SLEEP_INFERENCE:
                return self._worker("sampling").submit(self.sampling.sleep, body.get("level", 1))
            if op == OP_WAKE_INFERENCE:
                return self._worker("sampling").submit(self.sampling.wake)
            return self._worker("sampling").submit(self.sampling.reset_prefix_cache)
        if op == OP_CANCEL:
            return _done({})
        raise AssertionError(f"unreachable: op {op!r} is in OPS but not routed")

    def _worker(self, role: str) -> Any:
        return self._workers[role]

    def _generate(self, prompts: list[Any], params: SamplingParams | list[SamplingParams]) -> Future:
        if self.sampling is None:
            raise InvalidRequestError("generate needs a sampling role; set num_sampling_workers=1 in the config")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        return self._worker("sampling").submit_batchable("generate", (prompts, params_list), self._run_generate)

    def _run_generate(self, items: list[tuple[list[Any], list[SamplingParams]]]) -> list[list[dict[str, Any]]]:
        """Run coalesced generate calls as one engine batch and hand each caller its own slice."""
        all_prompts = [prompt for prompts, _ in items for prompt in prompts]
        all_params = [p for _, params in items for p in params]
        samples = self.sampling.generate(all_prompts, all_params)
        out, start = [], 0
        for _, params in items:
            count = sum(p.n for p in params)
            out.append(samples[start : start + count])
            start += count
        return out

    # --- checkpoints -----------------------------------------------------------------------------
    def _checkpoint_dir(self, checkpoint_id: str) -> Path:
        if not checkpoint_id or "/" in checkpoint_id or checkpoint_id.startswith("."):
            raise InvalidRequestError(f"checkpoint_id must be a name like 'global_step12'; got {checkpoint_id!r}")
        path = self.checkpoint_root / checkpoint_id
        if not path.is_dir():
            known = [c["checkpoint_id"] for c in self._list_checkpoints()]
            raise InvalidRequestError(f"checkpoint {checkpoint_id!r} does not exist; saved checkpoints: {known}")
        return path

    def _load(self, checkpoint_id: str) -> dict[str, Any]:
        return self.training.load_checkpoint(self._checkpoint_dir(checkpoint_id))

    def _list_checkpoints(self) -> list[dict[str, Any]]:
        if not self.checkpoint_root.is_dir():
            return []
        # Hidden folders are checkpoints being written or replaced, not checkpoints.
        entries = [
            self._describe(path)
            for path in self.checkpoint_root.iterdir()
            if path.is_dir() and not path.name.startswith(".")
        ]
        return sorted(entries, key=lambda entry: entry["global_step"])

    def _describe(self, path: Path) -> dict[str, Any]:
        state_file = path / "trainer_state.json"
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        step = state.get("global_step", _step_from_name(path.name))
        return {
            "checkpoint_id": path.name,
            "global_step": step,
            "global_steps": step,
            "checkpoint_type": state.get("kind", "weights-only"),
            "kind": state.get("kind", "weights-only"),
            "path": str(path),
            "created_at": path.stat().st_mtime,
        }

    def _get_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        path = self._checkpoint_dir(checkpoint_id)
        files = [
            {"filename": f.name, "url": f.resolve().as_uri(), "size_bytes": f.stat().st_size}
            for f in sorted(path.iterdir())
            if f.is_file()
        ]
        return {**self._describe(path), "files": files}

    def _delete_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        shutil.rmtree(self._checkpoint_dir(checkpoint_id))
        return {}


def _step_from_name(name: str) -> int:
    digits = name.removeprefix("global_step")
    return int(digits) if digits.isdigit() else 0


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
