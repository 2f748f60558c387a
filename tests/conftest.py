"""Suite-wide: no test leaves its torch thread count behind; ``validations`` counts batch validations.

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


@pytest.fixture
def validations(monkeypatch) -> list[bool]:
    """Counts calls of ``engines.batch.validate_batch`` (each one's ``require_context``) from any module of
    this process, also one that imported the function by name."""
    from icefloe.engines import batch as batch_module

    calls: list[bool] = []
    real = batch_module.validate_batch

    def counted(batch, *, require_context=True, vocab_size=None):
        calls.append(require_context)
        return real(batch, require_context=require_context, vocab_size=vocab_size)

    for name, module in list(sys.modules.items()):
        if name.startswith("icefloe") and getattr(module, "validate_batch", None) is real:
            monkeypatch.setattr(module, "validate_batch", counted)
    return calls
