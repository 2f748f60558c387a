"""Tensors ↔ raw little-endian bytes, for torch and numpy; torch is optional.

The remote client imports the wire on a light install, so torch is imported only when a torch
tensor is decoded (a value can only be a torch tensor if torch is already in ``sys.modules``).

Decoding builds no element in Python: a tensor is a view over the frame buffer when that buffer is
writable and the tensor is aligned, otherwise one ``memcpy`` into its own storage. numpy output is
always a view (read-only when the frame is ``bytes``); numpy has no bfloat16 or float8, so those
arrive widened to float32, which represents every one of their values exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from functools import cache
from typing import Any, Final, Literal

import numpy as np

from icefloe.protocol import FrameFormatError
from icefloe.wire.frames import DTYPE_SIZES, TensorSpec

__all__ = ["TensorKind", "build_tensors", "check_tensor_bytes", "is_tensor", "resolve_kind", "tensor_record"]

TensorKind = Literal["torch", "numpy"]

_NUMPY_CODES: Final[dict[np.dtype, str]] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
}
_NUMPY_DTYPES: Final[dict[str, np.dtype]] = {code: dtype.newbyteorder("<") for dtype, code in _NUMPY_CODES.items()}
_TORCH_NAMES: Final[dict[str, str]] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}


# --- encoding ----------------------------------------------------------------------------------
def is_tensor(value: object) -> bool:
    """True for a torch tensor or a numpy array (never imports torch)."""
    if isinstance(value, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def tensor_record(value: Any, name: str) -> tuple[str, tuple[int, ...], memoryview]:
    """``(dtype code, shape, flat byte view)`` of a tensor, copying only to make it contiguous/CPU."""
    if isinstance(value, np.ndarray):
        return _numpy_record(value, name)
    return _torch_record(value, name)


def _numpy_record(array: np.ndarray, name: str) -> tuple[str, tuple[int, ...], memoryview]:
    if isinstance(array, np.ma.MaskedArray):
        raise FrameFormatError(f"tensor {name!r}: masked arrays would lose their mask; pass array.filled()")
    code = _NUMPY_CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        raise FrameFormatError(
            f"tensor {name!r}: numpy dtype {array.dtype} has no DSSST1 code; "
            f"use one of {', '.join(sorted(str(d) for d in _NUMPY_CODES))}"
        )
    shape = tuple(int(dim) for dim in array.shape)
    flat = np.ascontiguousarray(array, dtype=_NUMPY_DTYPES[code]).reshape(-1)
    return code, shape, memoryview(flat.view(np.uint8))


def _torch_record(tensor: Any, name: str) -> tuple[str, tuple[int, ...], memoryview]:
    torch = sys.modules["torch"]
    if tensor.layout != torch.strided:
        raise FrameFormatError(f"tensor {name!r}: layout {tensor.layout} is not supported; pass tensor.to_dense()")
    if tensor.device.type == "meta":
        raise FrameFormatError(f"tensor {name!r} is on the meta device and has no data")
    code = _torch_codes().get(tensor.dtype)
    if code is None:
        raise FrameFormatError(
            f"tensor {name!r}: dtype {tensor.dtype} has no DSSST1 code; known: {', '.join(DTYPE_SIZES)}"
        )
    dense = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()
    flat = dense.reshape(-1)
    if flat.stride(0) != 1:  # is_contiguous() ignores the stride of 0- and 1-element tensors
        flat = flat.as_strided((flat.numel(),), (1,))
    flat_bytes = flat.view(torch.uint8).numpy()
    return code, tuple(dense.shape), memoryview(flat_bytes)


@cache
def _torch_codes() -> dict[Any, str]:
    torch = sys.modules["torch"]
    return {getattr(torch, attr): code for code, attr in _TORCH_NAMES.items() if hasattr(torch, attr)}


# --- decoding ----------------------------------------------------------------------------------
def resolve_kind(kind: str) -> TensorKind:
    """Validate ``tensors=``; ``"torch"`` falls back to numpy when torch is not installed."""
    if kind == "numpy":
        return "numpy"
    if kind != "torch":
        raise FrameFormatError(f"tensors must be 'torch' or 'numpy'; got {kind!r}")
    return "torch" if _torch_module() is not None else "numpy"


def check_tensor_bytes(view: memoryview, spec: TensorSpec) -> None:
    """Value checks that the header cannot express: BOOL bytes must be 0 or 1."""
    if spec.dtype == "BOOL" and spec.end > spec.begin:
        raw = np.frombuffer(view, dtype=np.uint8, count=spec.end - spec.begin, offset=spec.begin)
        if int(raw.max()) > 1:
            raise FrameFormatError(f"tensor {spec.name!r}: BOOL bytes must be 0 or 1; found {int(raw.max())}")


def build_tensors(view: memoryview, specs: Iterable[TensorSpec], kind: TensorKind) -> dict[str, Any]:
    """Materialise validated specs as tensors of ``kind`` over (or copied from) ``view``."""
    if kind == "numpy":
        return {spec.name: _numpy_tensor(view, spec) for spec in specs}
    torch = _torch_module()
    if torch is None:
        raise FrameFormatError("tensors='torch' needs torch; pip install icefloe[torch] or pass tensors='numpy'")
    all_bytes = np.frombuffer(view, dtype=np.uint8)
    base_address = all_bytes.ctypes.data
    writable = not view.readonly
    result = {}
    for spec in specs:
        dtype = getattr(torch, _TORCH_NAMES[spec.dtype], None)
        if dtype is None:
            raise FrameFormatError(f"tensor {spec.name!r}: this torch has no dtype for {spec.dtype}")
        size = DTYPE_SIZES[spec.dtype]
        if spec.numel and writable and (base_address + spec.begin) % size == 0:
            tensor = torch.frombuffer(view, dtype=dtype, count=spec.numel, offset=spec.begin).view(spec.shape)
        else:
            tensor = torch.empty(spec.shape, dtype=dtype)
            if spec.numel:
                tensor.reshape(-1).view(torch.uint8).numpy()[:] = all_bytes[spec.begin : spec.end]
        result[spec.name] = tensor
    return result


def _numpy_tensor(view: memoryview, spec: TensorSpec) -> np.ndarray:
    if spec.dtype == "BF16":
        upper = np.frombuffer(view, dtype="<u2", count=spec.numel, offset=spec.begin).astype("<u4")
        np.left_shift(upper, 16, out=upper)
        return upper.view("<f4").reshape(spec.shape)
    if spec.dtype.startswith("F8_"):
        codes = np.frombuffer(view, dtype=np.uint8, count=spec.numel, offset=spec.begin)
        return _float8_table(spec.dtype)[codes].reshape(spec.shape)
    return np.frombuffer(view, dtype=_NUMPY_DTYPES[spec.dtype], count=spec.numel, offset=spec.begin).reshape(spec.shape)


@cache
def _float8_table(code: str) -> np.ndarray:
    """float32 value of each of the 256 float8 bit patterns (E4M3 is the finite-only "fn" variant)."""
    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent_bits, mantissa_bits, bias = (4, 3, 7) if code == "F8_E4M3" else (5, 2, 15)
    exponent = (bits >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = (bits & ((1 << mantissa_bits) - 1)) / float(1 << mantissa_bits)
    normal = (1.0 + mantissa) * np.exp2(exponent.astype(np.float64) - bias)
    subnormal = mantissa * np.exp2(1.0 - bias)
    values = sign * np.where(exponent == 0, subnormal, normal)
    is_top = exponent == (1 << exponent_bits) - 1
    raw_mantissa = bits & ((1 << mantissa_bits) - 1)
    if code == "F8_E4M3":
        values[is_top & (raw_mantissa == 0x7)] = np.nan
    else:
        values[is_top] = np.where(raw_mantissa == 0, sign * np.inf, np.nan)[is_top]
    table = values.astype(np.float32)
    table.flags.writeable = False
    return table


def _torch_module() -> Any:
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch
    try:
        import torch
    except ImportError:
        return None
    return torch
