"""The embedded backend: every engine runs inside the calling process.

Routing, ordering, generate merging and the in-memory weight copy come from the engine host (see
:class:`RoleTransport`); this module only builds the engines, or finds them when a handle
re-attaches in the same process.
"""

from __future__ import annotations

import uuid
import weakref
from typing import Any

from icefloe.client.transports.roles import RoleTransport
from icefloe.config import ClientConfig
from icefloe.protocol import ConfigError

__all__ = ["LocalTransport"]

# Live transports of this process, so Client.from_handle() can re-attach without new engines.
_LIVE: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()


class LocalTransport(RoleTransport):
    """Engines in this process; one ordered worker thread per role."""

    def __init__(self, config: ClientConfig, handle: dict[str, Any] | None = None) -> None:
        session = (handle or {}).get("session") or uuid.uuid4().hex[:12]
        self._attached_to: LocalTransport | None = None
        if handle is not None:
            live = _LIVE.get(session)
            if live is None:
                raise ConfigError(
                    "the local backend lives inside one process and this handle's engines are not in this one; "
                    "use backend.type='ray' or 'remote' to re-attach from another process"
                )
            self._attached_to = live
        super().__init__(config, session=session, checkpoint_root=config.training.checkpoint_root(session))

    def _start(self) -> None:
        if self._attached_to is not None:  # a twin drives the owner's engines through the owner's host
            self._attached_to.open()
            self.host = self._attached_to.host
            self.training = self._attached_to.training
            return
        from icefloe.engines import TrainingEngine, build_sampling_engine, resolve_model

        device = _pick_device(self.config.backend.device)
        model_dir = resolve_model(self.config.model, seed=self.config.seed)
        self.training = TrainingEngine(self.config, device=device, model_dir=model_dir)
        if self.config.num_sampling_workers > 0:
            self.sampling = build_sampling_engine(self.config, device=device, model_dir=model_dir)
        if self.config.num_log_prob_workers > 0 and self.config.lora is None:  # LoRA: the trainer is the reference
            self.reference = TrainingEngine(self.config, device=device, role="reference", model_dir=model_dir)
        _LIVE[self._session] = self

    def _stop(self) -> None:
        if self._attached_to is None:
            _LIVE.pop(self._session, None)

    def handle_info(self) -> dict[str, Any]:
        return {"backend": "local", "session": self._session}

    @property
    def tokenizer(self) -> Any:
        self.open()
        return self.training.tokenizer


def _pick_device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("backend.device='cuda' but torch sees no CUDA device; use 'cpu' or 'auto'")
    return choice
