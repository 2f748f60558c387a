"""Interop with the ``safetensors`` library in both directions, byte for byte where layouts agree."""

from __future__ import annotations

import json

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from icefloe import wire
from icefloe.wire.frames import write_frame
from icefloe.wire.tensors import tensor_record

from .support import TORCH_DTYPES, assert_same


def _every_dtype() -> dict[str, torch.Tensor]:
    tensors = {}
    for index, dtype in enumerate(TORCH_DTYPES):
        raw = torch.arange(6, dtype=torch.uint8) % 2 if dtype == torch.bool else torch.arange(6, dtype=torch.uint8)
        tensors[f"t{index:02d}"] = raw.view(dtype).reshape(2, 3) if dtype.itemsize == 1 else raw.float().to(dtype)
    tensors["empty"] = torch.empty(0, 4, dtype=torch.float32)
    return tensors


def test_write_frame_is_byte_identical_to_the_safetensors_library():
    tensors = _every_dtype()
    metadata = {"dss": '{"v": "DSSST1", "k": "é"}'}  # one key: the library keeps metadata in a hash map
    ours = write_frame(metadata, [(name, *tensor_record(t, name)) for name, t in tensors.items()])
    assert ours == safetensors.torch.save(tensors, metadata=metadata)


def test_safetensors_library_reads_our_frames():
    value = {"batch": _every_dtype(), "scalar": torch.tensor(3, dtype=torch.int64), "pair": (torch.ones(2),)}
    loaded = safetensors.torch.load(wire.encode(value))
    assert set(loaded) == {f"batch.{name}" for name in value["batch"]} | {"scalar", "pair.0"}
    for name, tensor in value["batch"].items():
        assert_same(tensor, loaded[f"batch.{name}"])
    assert loaded["scalar"].tolist() == [3]


def test_decode_reads_frames_written_by_the_safetensors_library():
    tensors = _every_dtype()
    tree = ["d", [["kwargs", ["d", [[name, ["t", f"kwargs.{name}"]] for name in tensors]]], ["n", ["j", 1]]]]
    frame = safetensors.torch.save(
        {f"kwargs.{name}": t for name, t in tensors.items()},
        metadata={"dss": json.dumps({"v": "DSSST1", "tree": tree}), "format": "pt"},
    )
    assert_same({"kwargs": tensors, "n": 1}, wire.decode(frame))


def test_decode_reads_numpy_frames_written_by_the_safetensors_library():
    arrays = {"ids": np.arange(6, dtype=np.int64).reshape(2, 3), "mask": np.array([True, False])}
    tree = ["u", [["t", "ids"], ["t", "mask"]]]
    frame = safetensors.numpy.save(arrays, metadata={"dss": json.dumps({"v": "DSSST1", "tree": tree})})
    assert_same((arrays["ids"], arrays["mask"]), wire.decode(frame, tensors="numpy"))
