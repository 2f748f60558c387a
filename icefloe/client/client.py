"""``Client`` (blocking) and ``AsyncClient`` (awaitable): one frontend over every backend.

Each method is a line or two over ``icefloe.client.ops``; what is not I/O lives once in
``_BaseClient``. The two classes mirror each other method for method (a test pins it).

Lifecycle: UNOPENED (built, nothing attached) → OPEN (engines loaded or job attached, on first
use or ``open()``) → CLOSED (after ``shutdown()``; every later op raises ``ClientClosedError``).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from typing import Any, Self

from icefloe.client import ops
from icefloe.client.transports import Transport, make_transport
from icefloe.config import ClientConfig
from icefloe.protocol import ClientClosedError, SamplingParams, UnsupportedOpError

__all__ = ["AsyncClient", "Client"]

Prompts = Sequence[Sequence[int] | str]
Params = SamplingParams | Mapping[str, Any] | Sequence[SamplingParams | Mapping[str, Any]] | None

# Roles do not share a disk on every backend; a silent no-op would leave the sampler on stale weights.
_SAVE_WEIGHTS_POINTER = (
    "save_weights(path) is not an op of any backend: use sync_weights() to move trainer weights into the "
    "sampler, or save_checkpoint('weights-only') for a Hugging Face export"
)


class _State(enum.Enum):
    UNOPENED = "unopened"  # built; no engine loaded, no job attached
    OPEN = "open"  # transport attached; ops run
    CLOSED = "closed"  # shut down; ops raise ClientClosedError


class _BaseClient:
    """Config, transport, state and re-attach: everything that is not I/O."""

    def __init__(
        self,
        config: ClientConfig | Mapping[str, Any] | None = None,
        *,
        transport: Transport | None = None,
        _handle: dict[str, Any] | None = None,
    ) -> None:
        if config is None:
            config = ClientConfig()
        elif not isinstance(config, ClientConfig):
            config = ClientConfig.build(config)
        self.config: ClientConfig = config
        self._transport = transport if transport is not None else make_transport(config, handle=_handle)
        self._state = _State.UNOPENED

    @classmethod
    def from_handle(cls, handle: Mapping[str, Any]) -> Self:
        """Re-attach to the live engines or job that ``handle()`` described (another process, an actor).

        Secrets are not in a handle: a remote PAT is read again from the environment.
        """
        config = ClientConfig.from_env(handle["config"])
        return cls(config, _handle=dict(handle["transport"]))

    def handle(self) -> dict[str, Any]:
        """JSON-safe description of this client's engines or job, for ``from_handle`` elsewhere."""
        self._check_open()
        self._ensure_open_sync()
        config = self.config.model_dump(mode="json", by_alias=True, exclude={"backend": {"pat"}})
        return {"config": config, "transport": self._transport.handle_info()}

    @property
    def tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (loaded from the same files the engines use)."""
        self._check_open()
        found = self._transport.tokenizer
        if found is not None:
            return found
        from icefloe.engines.models import load_tokenizer, resolve_model

        return load_tokenizer(resolve_model(self.config.model, seed=self.config.seed))

    @property
    def capabilities(self) -> frozenset[str]:
        """The ops this backend executes."""
        return self._transport.capabilities

    @property
    def closed(self) -> bool:
        return self._state is _State.CLOSED

    def _check_open(self) -> None:
        if self._state is _State.CLOSED:
            raise ClientClosedError("this client was shut down; build a new one (or Client.from_handle)")

    def _ensure_open_sync(self) -> None:
        if self._state is _State.UNOPENED:
            self._transport.open()
            self._state = _State.OPEN

    def __repr__(self) -> str:
        name, backend = type(self).__name__, self.config.backend.type
        return f"{name}(model={self.config.model!r}, backend={backend!r}, state={self._state.value})"


class Client(_BaseClient):
    """Blocking client: each call returns when the backend has finished the op."""

    def open(self) -> Self:
        """Load engines or attach the job now instead of on first use."""
        self._check_open()
        self._ensure_open_sync()
        return self

    def _call(self, call: ops.OpCall) -> Any:
        self._check_open()
        self._ensure_open_sync()
        return call.parse(self._transport.handle(call.request).result())

    def fwd_bwd(self, batch: Mapping[str, Any], processing: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Forward + backward; gradients accumulate until ``step``. Returns ``{loss, metrics, num_tokens}``."""
        return self._call(ops.fwd_bwd(batch, processing))

    def forward(self, batch: Mapping[str, Any], *, reference: bool = False) -> dict[str, Any]:
        """Shifted ``{logprobs, entropy}`` ``[B, S]`` of the policy (or the reference) without gradients."""
        return self._call(ops.forward(batch, reference=reference))

    def fwd_no_grad(self, batch: Mapping[str, Any], *, reference_model: bool = False) -> dict[str, Any]:
        """``forward`` under the name verl and SkyRL call."""
        return self.forward(batch, reference=reference_model)

    def step(self, learning_rate: float | None = None) -> dict[str, Any]:
        """Optimizer step. Returns ``{global_step, lr, grad_norm, metrics}``."""
        return self._call(ops.step(learning_rate))

    def generate(self, prompts: Prompts, sampling_params: Params = None) -> list[dict[str, Any]]:
        """Sample; returns ``[{token_ids, text, finish_reason, logprobs?, policy_version}]`` prompt-major."""
        return self._call(ops.generate(prompts, sampling_params))

    def sync_weights(self, *, cuda_ipc: bool = False, low_memory: bool = False) -> dict[str, Any]:
        """Trainer → sampler weights. Returns ``{policy_version, seconds, bytes}``."""
        return self._call(ops.sync_weights(cuda_ipc=cuda_ipc, low_memory=low_memory))

    def save_checkpoint(self, kind: str = "resumable") -> dict[str, Any]:
        """Save; returns ``{checkpoint_id, global_step, path, kind}``."""
        return self._call(ops.save_checkpoint(kind))

    def save_weights(self, path: str | None = None) -> dict[str, Any]:
        """Refused on every backend (raises ``UnsupportedOpError``); see ``sync_weights`` / ``save_checkpoint``."""
        raise UnsupportedOpError(_SAVE_WEIGHTS_POINTER)

    def load_checkpoint(self, checkpoint_id: str, *, source_job_id: str | None = None) -> dict[str, Any]:
        """Load a checkpoint into the training role."""
        return self._call(ops.load_checkpoint(checkpoint_id, source_job_id=source_job_id))

    def list_checkpoints(self) -> list[dict[str, Any]]:
        """Every checkpoint this job saved, oldest first."""
        return self._call(ops.list_checkpoints())

    def get_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """One checkpoint's metadata and files."""
        return self._call(ops.get_checkpoint(checkpoint_id))

    def delete_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """Delete one checkpoint."""
        return self._call(ops.delete_checkpoint(checkpoint_id))

    def sleep_training(self) -> dict[str, Any]:
        """Offload training state from the device (no-op where there is nothing to free)."""
        return self._call(ops.sleep_training())

    def wake_training(self) -> dict[str, Any]:
        """Reload training state onto the device."""
        return self._call(ops.wake_training())

    def sleep_inference(self, level: int = 1) -> dict[str, Any]:
        """Free sampler memory."""
        return self._call(ops.sleep_inference(level))

    def wake_inference(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Restore sampler memory."""
        return self._call(ops.wake_inference(tags))

    def reset_prefix_cache(self) -> dict[str, Any]:
        """Drop the sampler's prefix cache."""
        return self._call(ops.reset_prefix_cache())

    def shutdown(self) -> None:
        """Release engines / cancel the job and close every connection. Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        self._transport.close()

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


class AsyncClient(_BaseClient):
    """Awaitable client: concurrent calls overlap; calls to one role still run in submission order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open_lock: asyncio.Lock | None = None

    async def open(self) -> Self:
        """Load engines or attach the job now (in a thread or over async I/O)."""
        self._check_open()
        if self._state is _State.UNOPENED:
            if self._open_lock is None:
                self._open_lock = asyncio.Lock()
            async with self._open_lock:
                if self._state is _State.UNOPENED:
                    await asyncio.to_thread(self._transport.open)
                    self._state = _State.OPEN
        return self

    async def _call(self, call: ops.OpCall) -> Any:
        self._check_open()
        if self._state is _State.UNOPENED:
            await self.open()
        return call.parse(await asyncio.wrap_future(self._transport.handle(call.request)))

    async def fwd_bwd(self, batch: Mapping[str, Any], processing: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Forward + backward; gradients accumulate until ``step``. Returns ``{loss, metrics, num_tokens}``."""
        return await self._call(ops.fwd_bwd(batch, processing))

    async def forward(self, batch: Mapping[str, Any], *, reference: bool = False) -> dict[str, Any]:
        """Shifted ``{logprobs, entropy}`` ``[B, S]`` of the policy (or the reference) without gradients."""
        return await self._call(ops.forward(batch, reference=reference))

    async def fwd_no_grad(self, batch: Mapping[str, Any], *, reference_model: bool = False) -> dict[str, Any]:
        """``forward`` under the name verl and SkyRL call."""
        return await self.forward(batch, reference=reference_model)

    async def step(self, learning_rate: float | None = None) -> dict[str, Any]:
        """Optimizer step. Returns ``{global_step, lr, grad_norm, metrics}``."""
        return await self._call(ops.step(learning_rate))

    async def generate(self, prompts: Prompts, sampling_params: Params = None) -> list[dict[str, Any]]:
        """Sample; returns ``[{token_ids, text, finish_reason, logprobs?, policy_version}]`` prompt-major."""
        return await self._call(ops.generate(prompts, sampling_params))

    async def sync_weights(self, *, cuda_ipc: bool = False, low_memory: bool = False) -> dict[str, Any]:
        """Trainer → sampler weights. Returns ``{policy_version, seconds, bytes}``."""
        return await self._call(ops.sync_weights(cuda_ipc=cuda_ipc, low_memory=low_memory))

    async def save_checkpoint(self, kind: str = "resumable") -> dict[str, Any]:
        """Save; returns ``{checkpoint_id, global_step, path, kind}``."""
        return await self._call(ops.save_checkpoint(kind))

    async def save_weights(self, path: str | None = None) -> dict[str, Any]:
        """Refused on every backend (raises ``UnsupportedOpError``); see ``sync_weights`` / ``save_checkpoint``."""
        raise UnsupportedOpError(_SAVE_WEIGHTS_POINTER)

    async def load_checkpoint(self, checkpoint_id: str, *, source_job_id: str | None = None) -> dict[str, Any]:
        """Load a checkpoint into the training role."""
        return await self._call(ops.load_checkpoint(checkpoint_id, source_job_id=source_job_id))

    async def list_checkpoints(self) -> list[dict[str, Any]]:
        """Every checkpoint this job saved, oldest first."""
        return await self._call(ops.list_checkpoints())

    async def get_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """One checkpoint's metadata and files."""
        return await self._call(ops.get_checkpoint(checkpoint_id))

    async def delete_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        """Delete one checkpoint."""
        return await self._call(ops.delete_checkpoint(checkpoint_id))

    async def sleep_training(self) -> dict[str, Any]:
        """Offload training state from the device (no-op where there is nothing to free)."""
        return await self._call(ops.sleep_training())

    async def wake_training(self) -> dict[str, Any]:
        """Reload training state onto the device."""
        return await self._call(ops.wake_training())

    async def sleep_inference(self, level: int = 1) -> dict[str, Any]:
        """Free sampler memory."""
        return await self._call(ops.sleep_inference(level))

    async def wake_inference(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        """Restore sampler memory."""
        return await self._call(ops.wake_inference(tags))

    async def reset_prefix_cache(self) -> dict[str, Any]:
        """Drop the sampler's prefix cache."""
        return await self._call(ops.reset_prefix_cache())

    async def shutdown(self) -> None:
        """Release engines / cancel the job and close every connection. Idempotent."""
        if self._state is _State.CLOSED:
            return
        self._state = _State.CLOSED
        await asyncio.to_thread(self._transport.close)

    async def __aenter__(self) -> Self:
        return await self.open()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()
