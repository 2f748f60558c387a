"""Data-parallel training and trainer → sampler weight broadcast over torch.distributed.

Exactness is the design rule: a batch split across N ranks trains exactly like the whole batch on
one. :func:`shard_rows` fixes the loss normalisers (``batch_num_tokens``, ``global_batch_size``) to
the GLOBAL totals before splitting, so each rank's loss is its share of the global loss; gradients
are then SUMMED across ranks (never averaged) and metrics are combined weighted by tokens
(:func:`combine_fwd_bwd`). Weights stay identical on every rank because every rank applies the same
summed gradient.

Weight sync runs on its own process group (trainer rank 0 + every sampler) built from a TCP store,
independent of the trainers' default group: parameters are packed into flat buckets of
``bucket_bytes`` and broadcast, then copied in place into the receiver's parameters. Tensors never
travel through pickling. Tensors: B rows, S positions.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from icefloe.config import ClientConfig
from icefloe.engines.batch import Frame
from icefloe.engines.micro_batches import MicroBatch, Spans, row_spans
from icefloe.engines.training import (
    TrainingEngine,
    describe_checkpoint,
    optimizer_file_tensors,
    optimizer_state_from_file,
)
from icefloe.protocol import ConfigError, InvalidRequestError

__all__ = [
    "DataParallelTrainingEngine",
    "WeightBroadcast",
    "WeightEntry",
    "combine_fwd_bwd",
    "concat_forward",
    "plan_buckets",
    "shard_rows",
    "unpack_bucket",
    "weight_layout",
]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


# --- batch sharding and result reduction -----------------------------------------------------
def shard_rows(frame: Mapping[str, Any], world_size: int) -> tuple[list[dict[str, Any]], list[int]]:
    """Split a validated canonical batch into ``world_size`` contiguous row shards.

    The loss normalisers are set to the whole batch's totals first (unless the caller already set
    them), so summing the shards' losses and gradients reproduces the unsplit batch. A rank that
    would get no row gets one padding row with ``loss_mask`` 0 (it contributes nothing but still
    takes part in collectives, which FSDP needs).

    Returns:
        ``(shards, real_rows)``: one frame per rank and how many of its rows are real. The shards of
        a :class:`~icefloe.engines.batch.Frame` are Frames, which the ranks do not validate again.
    """
    if world_size < 1:
        raise InvalidRequestError(f"world_size must be >= 1; got {world_size}")
    kwargs, context = frame["kwargs"], frame.get("context") or {}
    num_rows = int(kwargs["input_ids"].shape[0])
    processing = {"loss_fn": "grpo", "config": {}, **dict(frame.get("processing") or {})}
    loss_config = dict(processing.get("config") or {})
    if "loss_mask" in context:
        if loss_config.get("batch_num_tokens") is None:
            loss_config["batch_num_tokens"] = int(context["loss_mask"].sum().item())
        if loss_config.get("global_batch_size") is None:
            loss_config["global_batch_size"] = num_rows
    processing["config"] = loss_config

    bounds = [(num_rows * rank) // world_size for rank in range(world_size + 1)]
    shards, real_rows = [], []
    for rank in range(world_size):
        start, stop = bounds[rank], bounds[rank + 1]
        if stop > start:
            rows = slice(start, stop)
            shard = {
                "args": (),
                "kwargs": {name: t[rows] for name, t in kwargs.items()},
                "context": {name: t[rows] for name, t in context.items()},
                "processing": processing,
            }
        else:
            shard = _padding_row(kwargs, context, processing)
        shards.append(shard)
        real_rows.append(stop - start)
    if isinstance(frame, Frame):
        shards = [Frame(shard, training=frame.training) for shard in shards]
    return shards, real_rows


def _padding_row(kwargs: Mapping[str, Tensor], context: Mapping[str, Tensor], processing: dict) -> dict[str, Any]:
    """Row 0 with every trained-token weight zeroed: a forward/backward that adds nothing."""
    pad_context = {name: torch.zeros_like(t[:1]) if t.is_floating_point() else t[:1] for name, t in context.items()}
    return {
        "args": (),
        "kwargs": {n: t[:1] for n, t in kwargs.items()},
        "context": pad_context,
        "processing": processing,
    }


def combine_fwd_bwd(results: Sequence[Mapping[str, Any]], real_rows: Sequence[int]) -> dict[str, Any]:
    """Reduce per-rank ``fwd_bwd`` results into the whole batch's.

    Each rank's loss already uses the global normaliser, so losses add. Every other metric is a
    token mean over that rank's tokens, so it is recombined weighted by the rank's token count.
    Per-row ``logprobs`` (``return_logprobs``) are joined in row order without the padding rows.
    """
    num_tokens = sum(int(r["num_tokens"]) for r in results)
    loss = float(sum(float(r["loss"]) for r in results))
    names = sorted({name for r in results for name in r["metrics"] if name != "loss"})
    metrics = {
        name: sum(float(r["metrics"].get(name, 0.0)) * int(r["num_tokens"]) for r in results) / max(num_tokens, 1)
        for name in names
    }
    metrics["loss"] = loss
    combined = {"loss": loss, "avg_loss": loss, "metrics": metrics, "num_tokens": num_tokens}
    if "logprobs" in results[0]:
        combined.update(concat_forward([{"logprobs": r["logprobs"]} for r in results], real_rows))
    return combined


def concat_forward(results: Sequence[Mapping[str, Tensor]], real_rows: Sequence[int]) -> dict[str, Tensor]:
    """Join per-rank ``forward`` outputs in row order, dropping padding rows."""
    keys = results[0].keys()
    return {key: torch.cat([r[key][:n] for r, n in zip(results, real_rows, strict=True) if n > 0]) for key in keys}


# --- the data-parallel engine ----------------------------------------------------------------
class DataParallelTrainingEngine(TrainingEngine):
    """One data-parallel rank of a training engine; the default process group spans the ranks.

    Replicated mode (default): every rank holds the whole model and ``step`` sums the gradients
    with one all-reduce per bucket before clipping, so clipping and the AdamW update see the global
    gradient on every rank. FSDP mode (``fsdp=True``): parameters are sharded with FSDP2
    ``fully_shard`` and the reduce-scatter sums (divide factor 1). Every rank runs the same number of
    forward passes (sharded ranks gather and reduce together in each): ranks agree on the most any
    of them plans and the others add idle passes. Checkpoints are the
    files one unsharded engine writes and reads, so they move freely between both modes.

    The process group must be initialised before construction; other arguments are TrainingEngine's.
    """

    def __init__(
        self, config: ClientConfig, *, fsdp: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **engine: Any
    ) -> None:
        if not dist.is_initialized():
            raise ConfigError("DataParallelTrainingEngine needs torch.distributed initialised first")
        super().__init__(config, **engine)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.fsdp = fsdp
        self.bucket_bytes = bucket_bytes  # gradient all-reduce bucket size
        if fsdp:
            self._shard_model()

    def _shard_model(self) -> None:
        """Wrap each decoder layer and then the root with FSDP2 and rebuild the optimizer on the shards."""
        from torch.distributed.fsdp import fully_shard

        units = [*_decoder_layers(self.model), self.model]
        for unit in units:
            fully_shard(unit)
        for unit in units:  # each unit reduces its own gradients: every one must sum, not average
            unit.set_gradient_divide_factor(1.0)  # the loss already carries 1/global normaliser
            unit.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
        self._params = list(self.model.parameters())
        if self.optimizer is not None:
            opt = self.config.training.optimizer
            self.optimizer = torch.optim.AdamW(
                self._params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
            )

    def fwd_bwd(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """This rank's shard's result; the checkpoint's loss becomes the whole batch's (the ranks' sum)."""
        result = super().fwd_bwd(batch)
        loss = torch.tensor([result["loss"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)  # as combine_fwd_bwd adds the ranks' losses
        self._last_loss = float(loss.item())
        return result

    def _plan(self, frame: Mapping[str, Any], pass_s: float | None = None) -> tuple[Spans, list[MicroBatch]]:
        """This rank's passes, under FSDP padded with idle ones to the most any rank plans; if any rank refuses its
        shard (a row over the budget), every rank raises, so none is left waiting in a collective."""
        refusal: InvalidRequestError | None = None
        try:
            spans, passes = super()._plan(frame, pass_s)
        except InvalidRequestError as exc:
            refusal, spans, passes = exc, row_spans(frame), []
        agreed = torch.tensor([len(passes), refusal is not None], dtype=torch.int64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if refusal is not None:
            raise refusal
        if agreed[1]:
            raise InvalidRequestError("another data-parallel rank refused its share of the batch; see its error")
        idle = int(agreed[0]) - len(passes) if self.fsdp else 0  # replicated ranks only meet in step()
        return spans, passes + [MicroBatch((), 1)] * idle

    def step(self, learning_rate: float | None = None, adam: Mapping[str, float] | None = None) -> dict[str, Any]:
        """Sum the gradients over ranks, then clip and update exactly as one engine would."""
        self._require_training("step")
        if not self.fsdp:  # FSDP already reduce-scattered (summed) the gradients during backward
            self._all_reduce_grads()
        return super().step(learning_rate, adam)  # DTensor grads: the norm is reduced over every shard

    def _all_reduce_grads(self) -> None:
        """SUM every gradient over ranks, flattened into buckets; ranks agree on which params have one."""
        if self.world_size == 1:
            return
        params = [p for p in self._params if p.requires_grad]
        has_grad = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.int32, device=self.device
        )  # NCCL: on device
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX)
        grads: dict[str, Tensor] = {}
        for index, (param, flag) in enumerate(zip(params, has_grad.tolist(), strict=True)):
            if flag and param.grad is None:
                param.grad = torch.zeros_like(param)
            if flag:
                grads[str(index)] = param.grad
        for bucket in plan_buckets(weight_layout(grads.items()), self.bucket_bytes):
            flat = torch.cat([grads[entry.name].reshape(-1) for entry in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for name, summed in unpack_bucket(flat, bucket):
                grads[name].copy_(summed)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full (unsharded) parameters; under FSDP every rank must iterate, since gathering is collective."""
        if not self.fsdp:
            yield from super().named_weights()
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.model.modules():  # a no-grad forward leaves the root unit gathered
            if isinstance(module, FSDPModule):
                module.reshard()
        for name, param in self.model.named_parameters():
            yield name, param.detach().full_tensor()

    def save_checkpoint(self, root: Path | str, kind: str = "resumable") -> dict[str, Any]:
        """Rank 0 writes with the engine's own writer; under FSDP every rank first helps gather the full tensors."""
        self._check_checkpoint_kind(kind)  # on every rank, so a bad kind fails all of them alike
        tensors = self.checkpoint_tensors(kind) if self.fsdp or self.rank == 0 else None
        saved = describe_checkpoint(Path(root) / f"global_step{self.global_step}", self.global_step, kind)
        if self.rank == 0:  # its answer names the folder (the group answers with rank 0's)
            assert tensors is not None
            saved = self.write_checkpoint(root, kind, *tensors)
        dist.barrier()  # nobody reports done before the folder exists
        return saved

    def _optimizer_tensors(self) -> dict[str, Tensor]:
        """Under FSDP, AdamW state gathered to full tensors (collective; only rank 0 gets them)."""
        if not self.fsdp:
            return super()._optimizer_tensors()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        index_of = {name: index for index, (name, _) in enumerate(self.model.named_parameters())}
        return optimizer_file_tensors({index_of[name]: state for name, state in full.get("state", {}).items()})

    def _load_weights(self, loaded: dict[str, Tensor]) -> None:
        """Under FSDP every rank reads the full tensors and keeps its own shard."""
        if not self.fsdp:
            return super()._load_weights(loaded)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, strict=False)  # a tied embedding is saved once
        set_model_state_dict(self.model, loaded, options=options)

    def _load_optimizer(self, tensors: Mapping[str, Tensor], state: Mapping[str, Any]) -> None:
        if not self.fsdp:
            return super()._load_optimizer(tensors, state)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in self.model.named_parameters()]
        full = optimizer_state_from_file(tensors, state, names)
        set_optimizer_state_dict(self.model, self.optimizer, full, options=StateDictOptions(full_state_dict=True))


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks (the FSDP units); empty when the model has no such list."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            return list(module)
    return []


# --- weight broadcast ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WeightEntry:
    """Where one parameter lives in the broadcast: name, shape, dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


def weight_layout(named: Iterable[tuple[str, Tensor]]) -> list[WeightEntry]:
    """The metadata a receiver needs to unpack buckets: no tensor data."""
    return [WeightEntry(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named]


def plan_buckets(layout: Sequence[WeightEntry], bucket_bytes: int) -> list[list[WeightEntry]]:
    """Group consecutive same-dtype entries into buckets of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ConfigError(f"bucket_bytes must be > 0; got {bucket_bytes}")
    buckets: list[list[WeightEntry]] = []
    size = 0
    for entry in layout:
        nbytes = entry.numel * entry.torch_dtype.itemsize
        if buckets and buckets[-1] and (entry.dtype == buckets[-1][0].dtype) and size + nbytes <= bucket_bytes:
            buckets[-1].append(entry)
            size += nbytes
        else:
            buckets.append([entry])
            size = nbytes
    return buckets


def unpack_bucket(flat: Tensor, bucket: Sequence[WeightEntry]) -> Iterator[tuple[str, Tensor]]:
    """``(name, view)`` of each entry's slice of a packed bucket, in its own shape."""
    offset = 0
    for entry in bucket:
        yield entry.name, flat[offset : offset + entry.numel].view(entry.shape)
        offset += entry.numel


class WeightBroadcast:
    """A process group of its own for trainer rank 0 (rank 0 here) and the samplers (ranks 1..N).

    Built from a TCP store that rank 0 hosts, so it never touches the trainers' default group.
    ``backend`` is ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors).
    """

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo", device: str = "cpu"
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"backend.collective_backend must be 'gloo' or 'nccl' for weight sync; got {backend!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        self._store = dist.TCPStore(host, port, world_size, rank == 0, timeout=_COLLECTIVE_TIMEOUT)
        prefixed = dist.PrefixStore("icefloe-weight-sync", self._store)
        if backend == "gloo":
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, _COLLECTIVE_TIMEOUT)
        else:
            options = dist.ProcessGroupNCCL.Options()
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        self._buffers: dict[tuple[str, int], Tensor] = {}

    def broadcast(self, tensor: Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 in place."""
        self._start_broadcast(tensor).wait()

    def _start_broadcast(self, tensor: Tensor) -> Any:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self._group.broadcast([tensor], options)

    def send(
        self, named: Iterable[tuple[str, Tensor]], policy_version: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> int:
        """Rank 0: broadcast the policy version, then the tensors packed into buckets; returns the bytes sent.

        Two staging buffers alternate, so packing bucket k+1 overlaps the broadcast of bucket k.
        """
        self.broadcast(torch.tensor([policy_version], dtype=torch.int64, device=self.device))
        tensors = dict(named)
        in_flight: dict[int, Any] = {}
        sent = 0
        for index, bucket in enumerate(plan_buckets(weight_layout(tensors.items()), bucket_bytes)):
            slot = index % 2
            if slot in in_flight:
                in_flight.pop(slot).wait()  # this buffer's previous broadcast must finish before reuse
            flat = self._buffer(bucket, slot)
            for name, view in unpack_bucket(flat, bucket):
                view.copy_(tensors[name])
            in_flight[slot] = self._start_broadcast(flat)
            sent += flat.numel() * flat.element_size()
        for work in in_flight.values():
            work.wait()
        return sent

    def receive(
        self,
        layout: Sequence[WeightEntry],
        load: Callable[..., int],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> tuple[int, int]:
        """Ranks 1..N: receive the version and every bucket, handing each bucket's views to ``load``.

        ``load(named_views, policy_version=...)`` copies in place (a sampler's ``load_weights``).
        Bucket k+1 is already arriving in the other staging buffer while bucket k is copied out.

        Returns:
            ``(bytes received, policy_version)``.
        """
        version_1 = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(version_1)
        version = int(version_1.item())
        buckets = plan_buckets(layout, bucket_bytes)
        received = 0
        pending = (self._buffer(buckets[0], 0), self._start_broadcast(self._buffer(buckets[0], 0))) if buckets else None
        for index, bucket in enumerate(buckets):
            flat, work = pending
            if index + 1 < len(buckets):
                following = self._buffer(buckets[index + 1], (index + 1) % 2)
                pending = (following, self._start_broadcast(following))
            work.wait()
            load(list(unpack_bucket(flat, bucket)), policy_version=version)
            received += flat.numel() * flat.element_size()
        return received, version

    def _buffer(self, bucket: Sequence[WeightEntry], slot: int) -> Tensor:
        """A view of staging buffer ``slot`` (0 or 1) for this dtype, grown to the largest bucket seen."""
        numel = sum(entry.numel for entry in bucket)
        key = (bucket[0].dtype, slot)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=bucket[0].torch_dtype, device=self.device)
            self._buffers[key] = buffer
        return buffer[:numel]

    def close(self) -> None:
        self._buffers.clear()
        self._group = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


# --- CUDA IPC (colocated trainer and sampler on one GPU) --------------------------------------
def export_cuda_ipc(named: Iterable[tuple[str, Tensor]]) -> list[tuple[str, Any]]:
    """Share CUDA tensors with another process on the same GPU without copying them (handles only)."""
    from torch.multiprocessing.reductions import reduce_tensor

    shared = []
    for name, tensor in named:
        if tensor.device.type != "cuda":
            raise InvalidRequestError("cuda_ipc weight sync needs the trainer on a CUDA device; use cuda_ipc=False")
        shared.append((name, reduce_tensor(tensor.contiguous())))
    return shared


def import_cuda_ipc(handles: Sequence[tuple[str, Any]], device_index: int) -> Iterator[tuple[str, Tensor]]:
    """Open handles from :func:`export_cuda_ipc` in this process (the receiving side)."""
    for name, (rebuild, args) in handles:
        args = list(args)
        args[6] = device_index  # the device ordinal as this process sees it
        yield name, rebuild(*args)
