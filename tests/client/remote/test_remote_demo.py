"""``icefloe demo --backend remote`` with no service configured starts its own ``icefloe serve``."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_remote_demo_runs_over_a_local_service(tmp_path, monkeypatch, capsys):
    for name in (
        "ICEFLOE_REMOTE_BASE_URL",
        "ICEFLOE_REMOTE_HOST",
        "ARCTIC_CORTEX_BASE_URL",
        "ARCTIC_CORTEX_HOST",
    ):
        monkeypatch.delenv(name, raising=False)
    from icefloe.cli import run_demo

    history = run_demo(steps=2, seed=0, name="remote-demo", backend="remote", out_dir=tmp_path)

    assert [row["step"] for row in history] == [1, 2]
    assert history[-1]["policy_version"] > history[0]["policy_version"]
    assert "started icefloe serve at http://127.0.0.1:" in capsys.readouterr().out
