"""Slots: the units of compute this machine hands to jobs (GPUs, or CPU slots when there is none).

A job waits in ``placing`` until every slot it needs is free; waiters are served first come, first
served, so a large job is not starved by a stream of small ones.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Literal

__all__ = ["SlotPool"]

_WAIT_TICK_S = 0.1  # how often a waiting job re-checks its cancel flag


class SlotPool:
    """A fixed set of numbered slots with FIFO, cancellable acquisition."""

    def __init__(self, kind: Literal["gpu", "cpu"], total: int) -> None:
        self.kind = kind
        self.total = total
        self._free = list(range(total))
        self._queue: deque[object] = deque()
        self._cond = threading.Condition()

    @classmethod
    def detect(cls, cpu_slots: int) -> SlotPool:
        """GPUs when torch sees CUDA devices, else ``cpu_slots`` CPU slots."""
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return cls("gpu", num_gpus) if num_gpus else cls("cpu", cpu_slots)

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.total - len(self._free)

    def waiting(self, ticket: object) -> tuple[list[object], int]:
        """``(tickets ahead of ticket, free slots)`` for a job waiting in :meth:`acquire`."""
        with self._cond:
            ahead = list(self._queue)[: self._queue.index(ticket)] if ticket in self._queue else []
            return ahead, len(self._free)

    def device(self, slot: int) -> str:
        return f"cuda:{slot}" if self.kind == "gpu" else "cpu"

    def acquire(self, count: int, *, cancelled: threading.Event, ticket: object) -> list[int] | None:
        """Block until ``count`` slots are free and take them; None if ``cancelled`` was set first.
        ``ticket`` names the waiter for :meth:`waiting`."""
        with self._cond:
            self._queue.append(ticket)
            try:
                while True:
                    if cancelled.is_set():
                        return None
                    if self._queue[0] is ticket and len(self._free) >= count:
                        taken, self._free = self._free[:count], self._free[count:]
                        return taken
                    self._cond.wait(_WAIT_TICK_S)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def release(self, slots: list[int]) -> None:
        with self._cond:
            self._free = sorted(set(self._free) | set(slots))
            self._cond.notify_all()
