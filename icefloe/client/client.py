"""``Client`` (blocking) and ``AsyncClient`` (awaitable): one frontend over every backend.

Each method is a line or two over ``icefloe.client.ops``; what is not I/O lives once in
``_BaseClient``. The two classes mirror each other method for method (a test pins it).

Lifecycle: UNOPENED (built, nothing attached) → OPEN (engines loaded or job attached, on first
use or ``open()``) → CLOSED (after ``shutdown()``; every later op raises ``ClientClosedError``).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Self

from icefloe.client import ops
from icefloe.client.transports import Transport, make_transport
from icefloe.config import ClientConfig
from icefloe.protocol import (
    OP_GENERATE,
    ClientClosedError,
    InvalidRequestError,
    RequestFailedError,
    SamplingParams,
    UnsupportedOpError,
    checked_metrics,
)

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
        try:
            from icefloe.engines.models import load_tokenizer, resolve_model
        except ModuleNotFoundError as exc:  # the light install: a remote driver without the engines' packages
            raise ImportError(
                f"client.tokenizer loads the model's tokenizer with {exc.name}: pip install 'icefloe[torch]' "
                "(or tokenize yourself: generate takes token ids or text)"
            ) from None

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

    def sync_weights(
        self, *, cuda_ipc: bool = False, low_memory: bool = False, weight_format: str | None = None
    ) -> dict[str, Any]:
        """Trainer → sampler weights. Returns ``{policy_version, seconds, bytes}``.

        ``weight_format``: ``"lora"`` (adapters only), ``"vllm"`` / ``"hf"`` (full weights), or
        None for the default (``"lora"`` when ``config.lora`` is set).
        """
        return self._call(ops.sync_weights(cuda_ipc=cuda_ipc, low_memory=low_memory, weight_format=weight_format))

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

    def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Report scalars the client knows (reward, custom values) for ``step`` of the job.

        On the remote backend they join the job's per-step series on the service (``GET {job}/metrics``,
        the ``/ui`` charts); on the local and Ray backends there is no service to keep them, so nothing
        is sent (log them with a tracker). Names must be non-empty strings (not ``step`` or ``time``),
        values finite numbers.
        """
        values = checked_metrics(step, metrics)
        self._check_open()
        self._ensure_open_sync()
        self._transport.log_metrics(values, step).result()

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
    """Awaitable client: concurrent calls overlap; calls to one role still run in call order.

    An op is handed to the backend when it is called, not when it is first awaited: its place in
    line is fixed by the call, and it starts even while the caller goes on building the next batch.
    Each op method returns an ``asyncio.Future`` of the canonical result.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opening: asyncio.Future[None] | None = None
        # Ops held back, in call order: generates of this loop turn (to merge), or anything called before open.
        self._pending: list[tuple[ops.OpCall, asyncio.Future[Any]]] = []
        self._tasks: set[asyncio.Future[Any]] = set()

    async def open(self) -> Self:
        """Load engines or attach the job now (in a worker thread).

        An open that is cancelled (Ctrl-C under ``asyncio.run``, a timeout) shuts the client down, which
        interrupts the open and cancels a job it created; build a new client to try again.
        """
        self._check_open()
        if self._state is _State.UNOPENED:
            if self._opening is None or self._opening.get_loop() is not asyncio.get_running_loop():
                self._opening = asyncio.ensure_future(asyncio.to_thread(self._transport.open))
            try:
                await asyncio.shield(self._opening)
            except asyncio.CancelledError:
                await self.shutdown()
                raise
            except Exception:
                self._opening = None  # a later open() tries again
                raise
            if self._state is _State.UNOPENED:
                self._state = _State.OPEN
        return self

    def _call(self, call: ops.OpCall, *, merge: bool = False) -> asyncio.Future[Any]:
        """Hand the op over now; hold it only behind held ops, to merge a generate, or until open."""
        self._check_open()
        if self._state is _State.OPEN and not self._pending and not merge:
            return self._send(call)
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._pending.append((call, answer))
        if self._state is not _State.OPEN:
            if len(self._pending) == 1:
                self._track(self._open_then_send())
        elif merge:
            loop.call_soon(self._send_pending)  # when this loop turn ends: every generate called in it joins
        else:
            self._send_pending()  # generates called before this op go first
        return answer

    def _send(self, call: ops.OpCall) -> asyncio.Future[Any]:
        return self._track(_answer(self._transport.handle(call.request), call.parse))

    def _track(self, coroutine: Any) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _open_then_send(self) -> None:
        try:
            await self.open()
        except Exception as exc:
            pending, self._pending = self._pending, []
            for _, answer in pending:
                _settle(answer, error=exc)
            return
        self._send_pending()

    def _send_pending(self) -> None:
        """Hand every held op over in call order; adjacent generates travel as one request."""
        pending, self._pending = self._pending, []
        for is_generate, run in itertools.groupby(pending, key=lambda held: held[0].request.op == OP_GENERATE):
            group = list(run)
            if is_generate and len(group) > 1:
                merged, counts = ops.merge_generates([call for call, _ in group])
                self._send_merged(merged, group, counts)
            else:
                for call, answer in group:
                    self._send_alone(call, answer)

    def _send_alone(self, call: ops.OpCall, answer: asyncio.Future[Any]) -> None:
        try:
            _settle_from(self._send(call), answer)
        except Exception as exc:  # refused when handed over
            _settle(answer, error=exc)

    def _send_merged(self, merged: ops.OpCall, group: list[tuple[ops.OpCall, Any]], counts: list[int]) -> None:
        try:
            sent = self._send(merged)
        except Exception as exc:
            for _, answer in group:
                _settle(answer, error=exc)
            return
        self._track(self._split(sent, group, counts))

    async def _split(self, sent: Any, group: list[tuple[ops.OpCall, Any]], counts: list[int]) -> None:
        """Hand each caller its own samples; a merged call refused as a caller's fault is retried call by call."""
        try:
            samples = await sent
        except Exception as exc:
            if isinstance(exc, InvalidRequestError) or (isinstance(exc, RequestFailedError) and exc.category == "user"):
                for call, answer in group:  # one bad prompt fails only its own caller
                    self._send_alone(call, answer)
            else:
                for _, answer in group:
                    _settle(answer, error=exc)
            return
        start = 0
        for (_, answer), count in zip(group, counts, strict=True):
            _settle(answer, result=samples[start : start + count])
            start += count

    def fwd_bwd(
        self, batch: Mapping[str, Any], processing: Mapping[str, Any] | None = None
    ) -> asyncio.Future[dict[str, Any]]:
        """Forward + backward; gradients accumulate until ``step``. Returns ``{loss, metrics, num_tokens}``."""
        return self._call(ops.fwd_bwd(batch, processing))

    def forward(self, batch: Mapping[str, Any], *, reference: bool = False) -> asyncio.Future[dict[str, Any]]:
        """Shifted ``{logprobs, entropy}`` ``[B, S]`` of the policy (or the reference) without gradients."""
        return self._call(ops.forward(batch, reference=reference))

    def fwd_no_grad(self, batch: Mapping[str, Any], *, reference_model: bool = False) -> asyncio.Future[dict[str, Any]]:
        """``forward`` under the name verl and SkyRL call."""
        return self.forward(batch, reference=reference_model)

    def step(self, learning_rate: float | None = None) -> asyncio.Future[dict[str, Any]]:
        """Optimizer step. Returns ``{global_step, lr, grad_norm, metrics}``."""
        return self._call(ops.step(learning_rate))

    def generate(self, prompts: Prompts, sampling_params: Params = None) -> asyncio.Future[list[dict[str, Any]]]:
        """Sample; returns ``[{token_ids, text, finish_reason, logprobs?, policy_version}]`` prompt-major.

        Generate calls made in one loop turn (``asyncio.gather`` of many) travel as one request.
        """
        return self._call(ops.generate(prompts, sampling_params), merge=True)

    def sync_weights(
        self, *, cuda_ipc: bool = False, low_memory: bool = False, weight_format: str | None = None
    ) -> asyncio.Future[dict[str, Any]]:
        """Trainer → sampler weights. Returns ``{policy_version, seconds, bytes}``.

        ``weight_format``: ``"lora"`` (adapters only), ``"vllm"`` / ``"hf"`` (full weights), or
        None for the default (``"lora"`` when ``config.lora`` is set).
        """
        return self._call(ops.sync_weights(cuda_ipc=cuda_ipc, low_memory=low_memory, weight_format=weight_format))

    def save_checkpoint(self, kind: str = "resumable") -> asyncio.Future[dict[str, Any]]:
        """Save; returns ``{checkpoint_id, global_step, path, kind}``."""
        return self._call(ops.save_checkpoint(kind))

    def save_weights(self, path: str | None = None) -> asyncio.Future[dict[str, Any]]:
        """Refused on every backend (raises ``UnsupportedOpError``); see ``sync_weights`` / ``save_checkpoint``."""
        raise UnsupportedOpError(_SAVE_WEIGHTS_POINTER)

    def load_checkpoint(
        self, checkpoint_id: str, *, source_job_id: str | None = None
    ) -> asyncio.Future[dict[str, Any]]:
        """Load a checkpoint into the training role."""
        return self._call(ops.load_checkpoint(checkpoint_id, source_job_id=source_job_id))

    def list_checkpoints(self) -> asyncio.Future[list[dict[str, Any]]]:
        """Every checkpoint this job saved, oldest first."""
        return self._call(ops.list_checkpoints())

    def get_checkpoint(self, checkpoint_id: str) -> asyncio.Future[dict[str, Any]]:
        """One checkpoint's metadata and files."""
        return self._call(ops.get_checkpoint(checkpoint_id))

    def delete_checkpoint(self, checkpoint_id: str) -> asyncio.Future[dict[str, Any]]:
        """Delete one checkpoint."""
        return self._call(ops.delete_checkpoint(checkpoint_id))

    def sleep_training(self) -> asyncio.Future[dict[str, Any]]:
        """Offload training state from the device (no-op where there is nothing to free)."""
        return self._call(ops.sleep_training())

    def wake_training(self) -> asyncio.Future[dict[str, Any]]:
        """Reload training state onto the device."""
        return self._call(ops.wake_training())

    def sleep_inference(self, level: int = 1) -> asyncio.Future[dict[str, Any]]:
        """Free sampler memory."""
        return self._call(ops.sleep_inference(level))

    def wake_inference(self, tags: Sequence[str] | None = None) -> asyncio.Future[dict[str, Any]]:
        """Restore sampler memory."""
        return self._call(ops.wake_inference(tags))

    def reset_prefix_cache(self) -> asyncio.Future[dict[str, Any]]:
        """Drop the sampler's prefix cache."""
        return self._call(ops.reset_prefix_cache())

    async def log_metrics(self, metrics: Mapping[str, float], *, step: int) -> None:
        """Report scalars the client knows for ``step`` of the job; see ``Client.log_metrics``."""
        values = checked_metrics(step, metrics)
        await self.open()
        await asyncio.wrap_future(self._transport.log_metrics(values, step))

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


async def _answer(handled: Future, parse: Callable[[Any], Any]) -> Any:
    return parse(await asyncio.wrap_future(handled))


def _settle(answer: asyncio.Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    if not answer.done():
        if error is not None:
            answer.set_exception(error)
        else:
            answer.set_result(result)


def _settle_from(source: asyncio.Future[Any], answer: asyncio.Future[Any]) -> None:
    """Settle ``answer`` with what ``source`` ends with."""

    def copy(done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            answer.cancel()
        elif done.exception() is not None:
            _settle(answer, error=done.exception())
        else:
            _settle(answer, result=done.result())

    source.add_done_callback(copy)
