"""Suite-wide: no test leaves its torch thread count behind.

Several tests pin torch to one thread (to compare against another process bit for bit); the demo's
recorded curves were made with the default count, and a run on one thread takes a different path
(the LoRA demo ended at 0.77 instead of 0.98 after a Ray test had pinned it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    torch = sys.modules.get("torch")  # imported by collection wherever a test needs it; never imported here
    previous = torch.get_num_threads() if torch is not None else None
    yield
    if torch is not None and previous is not None and torch.get_num_threads() != previous:
        torch.set_num_threads(previous)
