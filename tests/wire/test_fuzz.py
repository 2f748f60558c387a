"""10,000 mutated or truncated frames: only the codec's own errors come out, and memory stays bounded."""

from __future__ import annotations

import collections
import json
import random
import struct
import tracemalloc

import numpy as np
import torch

from icefloe import wire
from icefloe.protocol import WireError

from .support import join_header, split_header

_MUTATIONS_PER_RUN = 10_000
_PEAK_BYTES_LIMIT = 32 * 1024 * 1024
_JUNK = [-1, 0, 1, 2**31, 2**63, 2**64, 1.5, float("inf"), "x", "", "F32", "BOOL", "C64", "__root__", None, True,
         [], {}, [1], [0, 1], [2**40, 2**40], [0, 2**62], ["t", "x"], ["d", []], ["j"], {"scalar": 1}]  # fmt: skip


def _seed_frames() -> list[bytes]:
    payload = np.arange(40, dtype=np.uint8)
    return [
        wire.encode(
            {
                "args": (),
                "kwargs": {"input_ids": torch.arange(6).reshape(2, 3), "use_cache": False},
                "context": {"advantages": torch.randn(2, 3), "mask": torch.tensor([True, False])},
                "processing": {"loss_fn": "grpo", "config": {"eps_clip": 0.2}},
            },
            op_metadata={"response_options": {"format": "dssst1", "delivery": "chunked"}},
        ),
        wire.encode({"prompts": [[1, 2, 3]], "strict": False}),
        wire.encode(
            [torch.tensor(1.5, dtype=torch.bfloat16), (torch.zeros(0, 2), {"a.b": torch.ones(1, dtype=torch.int16)})]
        ),
        *wire.split_frame(payload.tobytes(), max_bytes=0, force=True),
        wire.encode(torch.arange(3, dtype=torch.float64)),
    ]


def _mutate_bytes(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    choice = rng.randrange(6)
    if choice == 0:  # flip a few bits
        for _ in range(rng.randint(1, 4)):
            index = rng.randrange(len(data))
            data[index] ^= 1 << rng.randrange(8)
    elif choice == 1:  # overwrite a few bytes
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
    elif choice == 2:  # truncate
        return bytes(data[: rng.randrange(len(data))])
    elif choice == 3:  # append junk
        return bytes(data) + rng.randbytes(rng.randint(1, 16))
    elif choice == 4:  # cut a slice out
        start = rng.randrange(len(data))
        del data[start : start + rng.randint(1, 16)]
    else:  # rewrite the length prefix
        (length,) = struct.unpack_from("<Q", data)
        new_length = rng.choice([0, 1, length - 1, length + 1, len(data), 2**64 - 1, 64 * 2**20 + 1])
        data[:8] = struct.pack("<Q", new_length)
    return bytes(data)


def _random_path_replace(rng: random.Random, node, junk):
    """Replace one randomly chosen element somewhere inside a JSON value with ``junk``."""
    if isinstance(node, dict) and node and rng.random() < 0.7:
        key = rng.choice(list(node))
        return {**node, key: _random_path_replace(rng, node[key], junk)}
    if isinstance(node, list) and node and rng.random() < 0.7:
        index = rng.randrange(len(node))
        return [*node[:index], _random_path_replace(rng, node[index], junk), *node[index + 1 :]]
    return junk


def _mutate_header(rng: random.Random, frame: bytes) -> bytes:
    header, data = split_header(frame)
    junk = rng.choice(_JUNK)
    if rng.random() < 0.5:
        dss = json.loads(header["__metadata__"]["dss"])
        dss = _random_path_replace(rng, dss, junk)
        header["__metadata__"]["dss"] = json.dumps(dss)
    else:
        header = _random_path_replace(rng, header, junk)
    return join_header(json.dumps(header, separators=(",", ":")), data, pad=rng.random() < 0.5)


def _check_only_wire_errors(frame: bytes, tensors: str, outcomes: collections.Counter) -> None:
    assert isinstance(wire.read_metadata(frame), dict)
    try:
        wire.decode(frame, tensors=tensors)
        wire.chunk_descriptor(frame)
        wire.join_chunks([frame])
        outcomes["ok"] += 1
    except WireError as error:
        outcomes[type(error).__name__] += 1


def test_fuzzed_frames_raise_only_wire_errors_with_bounded_memory():
    rng = random.Random(1234)
    seeds = _seed_frames()
    for seed in seeds:
        wire.decode(seed)  # every seed is valid before it is mutated
    outcomes: collections.Counter = collections.Counter()
    tracemalloc.start()
    try:
        for iteration in range(_MUTATIONS_PER_RUN):
            seed = rng.choice(seeds)
            frame = _mutate_header(rng, seed) if rng.random() < 0.4 else _mutate_bytes(rng, seed)
            _check_only_wire_errors(frame, "numpy" if iteration % 2 else "torch", outcomes)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < _PEAK_BYTES_LIMIT, f"peak Python allocation {peak} bytes while fuzzing"
    assert sum(outcomes.values()) == _MUTATIONS_PER_RUN
    # Most mutations must be caught, by the container/tree checks and by the chunk checks alike.
    assert outcomes["FrameFormatError"] > _MUTATIONS_PER_RUN // 2, outcomes
    assert outcomes["ChunkError"] + outcomes["ChunkDigestError"] > 0, outcomes


def test_random_bytes_raise_only_wire_errors():
    rng = random.Random(99)
    outcomes: collections.Counter = collections.Counter()
    for _ in range(1000):
        _check_only_wire_errors(rng.randbytes(rng.randint(0, 64)), "torch", outcomes)
    assert outcomes["ok"] == 0
