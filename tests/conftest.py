"""Suite-wide: no test leaves its torch thread count behind; ``hub_cache`` and ``validations`` fixtures.

Several tests pin torch to one thread (to compare against another process bit for bit); the demo's
recorded curves were made with the default count, and a run on one thread takes a different path
(the LoRA demo ended at 0.77 instead of 0.98 after a Ray test had pinned it).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    torch = sys.modules.get("torch")  # imported by collection wherever a test needs it; never imported here
    previous = torch.get_num_threads() if torch is not None else None
    yield
    if torch is not None and previous is not None and torch.get_num_threads() != previous:
        torch.set_num_threads(previous)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache holding acme/tiny-chat as the hub lays it out (refs/main -> snapshots/<commit>)."""
    import huggingface_hub.constants

    from icefloe.engines.models import resolve_model

    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny-chat"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(resolve_model("tiny:chat", seed=0), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))  # what HF_HUB_CACHE sets at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo / "snapshots" / commit


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
