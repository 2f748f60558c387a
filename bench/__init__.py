"""Benchmarks run with ``python -m bench <name>``; see ``bench/__main__.py`` for the convention."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def timed(fn: Callable[[], object], device: Any = None, iterations: int = 1) -> float:
    """Seconds that ``iterations`` calls of ``fn`` take; a CUDA ``device`` is synchronised before and after."""
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    _synchronize(device)
    return time.perf_counter() - start


def _synchronize(device: Any) -> None:
    if device is not None and device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
