"""Test helpers for the wire tests: frame surgery on raw header JSON and deep, bitwise equality."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import torch

TORCH_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn, torch.int16, torch.uint16,
    torch.float16, torch.bfloat16, torch.int32, torch.uint32, torch.float32, torch.float64, torch.int64,
    torch.uint64,
]  # fmt: skip


def split_header(frame: bytes) -> tuple[dict, bytes]:
    """Header JSON (parsed, order kept) and the data region of a frame."""
    (length,) = struct.unpack_from("<Q", frame)
    return json.loads(frame[8 : 8 + length]), frame[8 + length :]


def join_header(header: dict | str | bytes, data: bytes, pad: bool = True) -> bytes:
    """A frame from header JSON (object, text or raw bytes) and a data region; pads to 8 unless told not to."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    raw = header.encode() if isinstance(header, str) else header
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Raw bytes of any tensor (numpy has no bfloat16 or float8, so those go through an integer view)."""
    if tensor.dtype in (torch.bfloat16, torch.float8_e5m2, torch.float8_e4m3fn):
        tensor = tensor.view(torch.uint8 if tensor.element_size() == 1 else torch.int16)
    return tensor.numpy().tobytes()


def assert_same(left, right, path="root"):
    """Deep equality: exact container types and key order, NaN-aware floats, bitwise tensors."""
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor), path
        assert (right.dtype, right.shape) == (left.dtype, left.shape), path
        assert tensor_bytes(left) == tensor_bytes(right), path
    elif isinstance(left, np.ndarray):
        assert isinstance(right, np.ndarray) and right.dtype == left.dtype and right.shape == left.shape, path
        assert left.tobytes() == right.tobytes(), path
    elif isinstance(left, dict):
        assert type(right) is dict and list(right) == list(left), path
        for key in left:
            assert_same(left[key], right[key], f"{path}.{key}")
    elif isinstance(left, list | tuple):
        assert type(right) is type(left) and len(right) == len(left), path
        for index, (a, b) in enumerate(zip(left, right, strict=True)):
            assert_same(a, b, f"{path}.{index}")
    elif isinstance(left, float) and math.isnan(left):
        assert isinstance(right, float) and math.isnan(right), path
    else:
        assert type(right) is type(left) and right == left, path
