"""DSSST1 encode+decode of a forward-backward frame vs torch.save+torch.load vs a raw byte copy.

The frame is the canonical training batch of docs/architecture.md (int64 ids/masks/positions and
float32 advantages/masks/logprobs, ``[B, S]``) sized to about ``--mib`` MiB. The three contenders run
interleaved (rotating order) in one process, ``--repeats`` times; medians are reported as GB/s of
tensor bytes. ``ratio`` = ours ÷ torch.save+load, ``raw_ratio`` = ours ÷ one raw copy.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from bench import finish, parse_args
from icefloe import wire

_INT64_FIELDS = 4  # kwargs.input_ids, attention_mask, position_ids, context.input_ids
_FLOAT32_FIELDS = 4  # advantages, loss_mask, old_logprobs, ref_logprobs


def canonical_batch(rows: int, target_bytes: int, seed: int = 0) -> dict[str, Any]:
    """A fwd-bwd payload shaped like the canonical batch, ``[rows, S]`` with S chosen to fill ``target_bytes``."""
    bytes_per_position = _INT64_FIELDS * 8 + _FLOAT32_FIELDS * 4
    positions = max(1, target_bytes // (rows * bytes_per_position))
    generator = torch.Generator().manual_seed(seed)
    input_ids_BS = torch.randint(0, 32_000, (rows, positions), generator=generator)
    attention_mask_BS = torch.ones(rows, positions, dtype=torch.int64)
    position_ids_BS = torch.arange(positions).expand(rows, positions).contiguous()
    loss_mask_BS = (torch.rand(rows, positions, generator=generator) > 0.5).float()
    advantages_BS = torch.randn(rows, 1, generator=generator) * loss_mask_BS
    return {
        "args": (),
        "kwargs": {
            "input_ids": input_ids_BS,
            "attention_mask": attention_mask_BS,
            "position_ids": position_ids_BS,
            "use_cache": False,
        },
        "context": {
            "input_ids": input_ids_BS.clone(),
            "advantages": advantages_BS,
            "loss_mask": loss_mask_BS,
            "old_logprobs": -torch.rand(rows, positions, generator=generator),
            "ref_logprobs": -torch.rand(rows, positions, generator=generator),
        },
        "processing": {"loss_fn": "grpo", "config": {"eps_clip": 0.2, "loss_agg_mode": "token-mean"}},
    }


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _ours(batch: dict[str, Any]) -> Any:
    return wire.decode(wire.encode(batch))


def _torch_save_load(batch: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(batch, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _check_same(left: Any, right: Any) -> None:
    if isinstance(left, torch.Tensor):
        assert torch.equal(left, right), "round trip changed a tensor"
    elif isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            _check_same(left[key], right[key])
    elif isinstance(left, list | tuple):
        assert type(left) is type(right) and len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            _check_same(a, b)
    else:
        assert left == right


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench wire", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="approximate tensor bytes of the frame, in MiB")
    parser.add_argument("--rows", type=int, default=64, help="batch rows B")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats per contender")
    args = parse_args(parser, argv, smoke={"mib": 1, "rows": 4, "repeats": 1})

    batch = canonical_batch(args.rows, args.mib * 1024 * 1024)
    payload_bytes = _tensor_bytes(batch)
    frame = wire.encode(batch)
    _check_same(batch, wire.decode(frame))
    _check_same(batch, _torch_save_load(batch))

    contenders: dict[str, Callable[[], Any]] = {
        "DSSST1 encode+decode": lambda: _ours(batch),
        "torch.save+load (BytesIO)": lambda: _torch_save_load(batch),
        "raw bytes copy": lambda: bytearray(frame),
    }
    timings: dict[str, list[float]] = {name: [] for name in contenders}
    encode_s: list[float] = []
    decode_s: list[float] = []
    names = list(contenders)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
            start = time.perf_counter()
            result = contenders[name]()
            timings[name].append(time.perf_counter() - start)
            del result
        start = time.perf_counter()
        encoded = wire.encode(batch)
        middle = time.perf_counter()
        wire.decode(encoded)
        encode_s.append(middle - start)
        decode_s.append(time.perf_counter() - middle)

    medians = {name: statistics.median(values) for name, values in timings.items()}
    gbps = {name: payload_bytes / seconds / 1e9 for name, seconds in medians.items()}
    ours, torch_gbps, raw = (gbps[name] for name in names)

    table = Table(title=f"wire: fwd-bwd frame B={args.rows}, {payload_bytes / 2**20:.0f} MiB, median of {args.repeats}")
    for column in ("contender", "median ms", "GB/s", "× torch.save+load"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for name in names:
        table.add_row(name, f"{medians[name] * 1e3:.1f}", f"{gbps[name]:.2f}", f"{gbps[name] / torch_gbps:.2f}")
    table.add_row("  of which encode", f"{statistics.median(encode_s) * 1e3:.1f}", "", "")
    table.add_row("  of which decode", f"{statistics.median(decode_s) * 1e3:.1f}", "", "")
    Console().print(table)
    finish(
        args,
        f"bench=wire ratio={ours / torch_gbps:.3f} raw_ratio={ours / raw:.3f} ours_gbps={ours:.3f} "
        f"torch_gbps={torch_gbps:.3f} raw_gbps={raw:.3f}",
    )
