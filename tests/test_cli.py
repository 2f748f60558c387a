"""The ``icefloe`` command line: light import, help, and option checking."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from icefloe.cli import app


def test_cli_import_does_not_load_torch():
    heavy = "('torch', 'transformers', 'icefloe.engines')"
    code = f"import sys, icefloe.cli; print(sorted(m for m in {heavy} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"


def test_cli_demo_help_lists_its_options():
    result = CliRunner().invoke(app, ["demo", "--help"])
    assert result.exit_code == 0
    for option in ("--steps", "--seed", "--name", "--backend", "--out-dir"):
        assert option in result.output


def test_cli_demo_rejects_an_unknown_backend(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--backend", "cloud", "--out-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "must be local or remote" in result.output
    assert not (tmp_path / "demo").exists()


def test_cli_demo_rejects_zero_steps():
    result = CliRunner().invoke(app, ["demo", "--steps", "0"])
    assert result.exit_code != 0
