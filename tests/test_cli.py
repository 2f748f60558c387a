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
    for option in ("--steps", "--seed", "--name", "--backend", "--out-dir", "--lora-rank", "--tracker"):
        assert option in result.output


def test_cli_demo_rejects_an_unknown_backend(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--backend", "cloud", "--out-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert "must be local, ray or remote" in result.output
    assert not (tmp_path / "demo").exists()


def test_cli_demo_rejects_a_negative_lora_rank(tmp_path):
    result = CliRunner().invoke(app, ["demo", "--lora-rank", "-1", "--out-dir", str(tmp_path)])
    assert result.exit_code != 0
    assert not (tmp_path / "demo").exists()


def test_cli_demo_rejects_zero_steps():
    result = CliRunner().invoke(app, ["demo", "--steps", "0"])
    assert result.exit_code != 0


def test_cli_jobs_logs_and_checkpoints_against_a_real_service(tmp_path):
    """A person inspects a job another process created: list, log, checkpoints, export, cancel."""
    from icefloe.client import Client, build_batch
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.settings import ServeSettings

    runner = CliRunner()
    with ServerThread(create_app(ServeSettings(data_dir=tmp_path / "serve", port=0))) as base_url:
        client = Client({"model": "tiny:arith", "backend": {"type": "remote", "base_url": base_url}}).open()
        try:
            client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
            client.step()
            client.save_checkpoint()
            job_id = client.handle()["transport"]["job_id"]
            listed = runner.invoke(app, ["jobs", "list", "--base-url", base_url])
            assert listed.exit_code == 0, listed.output
            assert job_id[:8] in listed.output and "running" in listed.output
            shown = runner.invoke(app, ["jobs", "show", job_id, "--base-url", base_url])
            assert f'"job_id": "{job_id}"' in shown.output
            logged = runner.invoke(app, ["logs", job_id, "--base-url", base_url])
            assert logged.exit_code == 0 and "job is running" in logged.output
            ckpts = runner.invoke(app, ["checkpoints", job_id, "--base-url", base_url])
            assert "global_step1" in ckpts.output and "resumable" in ckpts.output
            exported = runner.invoke(app, ["checkpoints", job_id, "--export", "global_step1", "--base-url", base_url])
            assert "model.safetensors" in exported.output and f"{base_url}/files/" in exported.output
            cancelled = runner.invoke(app, ["jobs", "cancel", job_id, "--base-url", base_url])
            assert cancelled.exit_code == 0 and f"job {job_id}:" in cancelled.output
            missing = runner.invoke(app, ["jobs", "show", "no-such-job", "--base-url", base_url])
            assert missing.exit_code == 1 and "not found" in missing.output
        finally:
            client.shutdown()


def test_cli_jobs_without_a_service_names_the_setting():
    result = CliRunner().invoke(app, ["jobs", "list"], env={"ICEFLOE_REMOTE_BASE_URL": "", "ARCTIC_CORTEX_HOST": ""})
    assert result.exit_code != 0
    assert "base_url" in result.output


def test_cli_serve_help_recommends_a_token_file_or_the_env_var_over_token():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--token-file" in result.output and "ICEFLOE_SERVE_TOKENS" in result.output
    assert "prefer --token-file" in result.output


def test_cli_serve_refuses_a_token_file_it_cannot_use(tmp_path):
    empty = tmp_path / "empty-tokens"
    empty.write_text("# no token yet\n\n")
    for path, problem in ((tmp_path / "missing", "cannot read"), (empty, "holds no token")):
        result = CliRunner().invoke(app, ["serve", "--token-file", str(path), "--data-dir", str(tmp_path / "d")])
        assert result.exit_code != 0 and problem in result.output, result.output


def test_cli_serve_takes_its_tokens_from_a_file(tmp_path):
    """--token put the secret in `ps`; a token file keeps it out of the command line."""
    import socket
    import time

    import httpx

    token = "file-token-" + "x" * 24
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# serve tokens\n{token}\n")
    with socket.socket() as probe:  # a free port for the child to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "icefloe.cli", "serve", "--port", str(port), "--engines", "local"]
    command += ["--data-dir", str(tmp_path / "serve"), "--token-file", str(token_file)]
    log = tmp_path / "serve.log"
    with log.open("wb") as output, subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT) as child:
        try:
            base_url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
            while True:
                try:
                    httpx.get(f"{base_url}/health", timeout=5).raise_for_status()
                    break
                except httpx.TransportError:
                    assert child.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.2)
            assert token not in " ".join(command)
            capacity = f"{base_url}/api/v2/databases/DB/schemas/SC/cortex-training/capacity"
            assert httpx.get(capacity, timeout=30).status_code == 401
            assert httpx.get(capacity, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
        finally:
            child.terminate()
            child.wait(timeout=60)


def test_cli_jobs_against_a_port_where_nothing_listens_fails_at_once(caplog):
    import socket

    with socket.socket() as sock:  # bound, never listening: every connection to it is refused
        sock.bind(("127.0.0.1", 0))
        base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with caplog.at_level("WARNING", logger="icefloe.client.remote"):
            result = CliRunner().invoke(app, ["jobs", "list", "--base-url", base_url])
    assert result.exit_code == 1 and "is the service running?" in result.output
    assert not [r for r in caplog.records if "retrying" in r.getMessage()], "a refused connection is not retried"
