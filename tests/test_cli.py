"""The ``icefloe`` command line: light import, help, and option checking."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from icefloe.cli import app


@contextlib.contextmanager
def _serving(command: list[str], base_url: str, log: Path, **popen: Any) -> Iterator[None]:
    """``icefloe serve`` as a child process writing to ``log``, up (``/health``) for the block, then stopped."""
    import httpx

    with log.open("wb") as output, subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, **popen) as child:
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    httpx.get(f"{base_url}/health", timeout=5).raise_for_status()
                    break
                except httpx.TransportError:
                    assert child.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.2)
            yield
        finally:
            child.terminate()
            child.wait(timeout=60)


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


def test_cli_demo_run_again_writes_a_new_folder_and_a_failed_run_does_not_block_the_next(tmp_path):
    """`make demo` twice failed the second time ("runs/demo already holds a run"), and so did a rerun
    after a failed first run; a run under a taken name once truncated the first run's metrics."""
    args = ["demo", "--steps", "1", "--out-dir", str(tmp_path)]
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "metrics.jsonl").write_text("")  # what a run that failed at once leaves behind
    first = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert first.exit_code == 0, first.output
    assert f"({tmp_path / 'demo-2'}: jsonl)" in first.output, first.output
    metrics = (tmp_path / "demo-2" / "metrics.jsonl").read_text()
    second = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert second.exit_code == 0, second.output
    assert f"({tmp_path / 'demo-3'}: jsonl)" in second.output, second.output
    assert (tmp_path / "demo-2" / "metrics.jsonl").read_text() == metrics
    assert (tmp_path / "demo" / "metrics.jsonl").read_text() == ""


def test_cli_demo_remote_config_error_is_one_message_not_a_traceback(tmp_path):
    env = {"ICEFLOE_REMOTE_HOST": "acct.example.invalid", "COLUMNS": "400"}
    env |= dict.fromkeys(("ICEFLOE_REMOTE_BASE_URL", "ARCTIC_CORTEX_BASE_URL", "ICEFLOE_REMOTE_DATABASE"), "")
    env |= dict.fromkeys(("ARCTIC_CORTEX_DATABASE", "ICEFLOE_REMOTE_SCHEMA", "ARCTIC_CORTEX_SCHEMA"), "")
    result = CliRunner().invoke(app, ["demo", "--backend", "remote", "--out-dir", str(tmp_path)], env=env)
    assert result.exit_code == 2, result.output
    assert "ICEFLOE_REMOTE_DATABASE" in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "demo").exists()


def test_cli_jobs_logs_and_checkpoints_against_a_real_service(tmp_path):
    """A person inspects a job another process created: list, show, log, checkpoints, export, cancel;
    every listing also as JSON, and no ID or URL cut short however narrow the terminal says it is."""
    import re

    import httpx

    from icefloe.client import Client, build_batch
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.settings import ServeSettings

    runner = CliRunner(env={"COLUMNS": "40"})
    with ServerThread(create_app(ServeSettings(data_dir=tmp_path / "serve", port=0))) as base_url:
        client = Client({"model": "tiny:arith", "backend": {"type": "remote", "base_url": base_url}}).open()
        try:
            client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
            client.step()
            client.save_checkpoint()
            job_id = client.handle()["transport"]["job_id"]
            listed = runner.invoke(app, ["jobs", "list", "--base-url", base_url])
            assert listed.exit_code == 0, listed.output
            row = next(line for line in listed.output.splitlines() if job_id in line)
            assert "running" in row
            listed_json = json.loads(runner.invoke(app, ["jobs", "list", "--json", "--base-url", base_url]).output)
            assert [j["status"] for j in listed_json if j["job_id"] == job_id] == ["running"]

            shown = runner.invoke(app, ["jobs", "show", job_id, "--base-url", base_url])
            fields = dict(line.split(None, 1) for line in shown.output.replace("last loss", "last_loss").splitlines())
            metrics = httpx.get(f"{_prefix(base_url)}/{job_id}/metrics")
            points = metrics.json()["points"] if metrics.status_code == 200 else []
            assert fields["step"] == (str(points[-1]["step"]) if points else "-")
            losses = [p["loss"] for p in points if "loss" in p]
            assert fields["last_loss"] == (f"{losses[-1]:.4f}" if losses else "-")
            assert (fields["job_id"], fields["status"], fields["model"]) == (job_id, "running", "tiny:arith")
            assert fields["queue"] == "0 pending, 0 running"
            assert fields["lease"].endswith("s left (renewed by its client's calls)")
            shown_json = json.loads(
                runner.invoke(app, ["jobs", "show", job_id, "--json", "--base-url", base_url]).output
            )
            assert shown_json["job_id"] == job_id and shown_json["queue"] == {"pending": 0, "running": 0}

            logged = runner.invoke(app, ["logs", job_id, "--base-url", base_url])
            assert logged.exit_code == 0 and "job is running" in logged.output
            entries = [
                json.loads(line)
                for line in runner.invoke(app, ["logs", job_id, "--json", "--base-url", base_url]).output.splitlines()
            ]
            assert any("job is running" in e.get("msg", "") for e in entries)

            ckpts = runner.invoke(app, ["checkpoints", job_id, "--base-url", base_url])
            assert "global_step1" in ckpts.output and "resumable" in ckpts.output
            ckpts_json = json.loads(
                runner.invoke(app, ["checkpoints", job_id, "--json", "--base-url", base_url]).output
            )
            assert [c["checkpoint_id"] for c in ckpts_json] == ["global_step1"]
            export = ["checkpoints", job_id, "--export", "global_step1", "--base-url", base_url]
            exported = runner.invoke(app, export)
            files = json.loads(runner.invoke(app, [*export, "--json"]).output)["files"]
            assert "model.safetensors" in {f["filename"] for f in files}
            shown_urls = re.findall(rf"{re.escape(base_url)}/files/[^\s│]+", exported.output)
            assert sorted(map(len, shown_urls)) == sorted(len(f["url"]) for f in files)  # each URL whole (fresh tokens)

            cancelled = runner.invoke(app, ["jobs", "cancel", job_id, "--base-url", base_url])
            assert cancelled.exit_code == 0 and f"job {job_id}:" in cancelled.output
            deadline = time.monotonic() + 60
            while True:  # once the job has ended its lease reads "ended", not the seconds it had left
                after = runner.invoke(app, ["jobs", "show", job_id, "--base-url", base_url]).output
                fields = {k: v.strip() for k, v in (line.split(None, 1) for line in after.splitlines() if line.strip())}
                if fields["status"] in ("cancelled", "terminated"):
                    break
                assert time.monotonic() < deadline, after
                time.sleep(0.1)
            assert fields["lease"] == "ended"
            missing = runner.invoke(app, ["jobs", "show", "no-such-job", "--base-url", base_url])
            assert missing.exit_code == 1 and "not found" in missing.output
        finally:
            client.shutdown()


def _prefix(base_url: str) -> str:
    """The training-API prefix ``icefloe serve`` answers on for a config without database or schema."""
    from icefloe.client.remote.http import Endpoint
    from icefloe.config import RemoteConfig

    endpoint = Endpoint.from_config(RemoteConfig(base_url=base_url))
    return endpoint.url


def test_cli_jobs_list_newest_first_with_why_a_job_waits_and_what_a_missing_token_needs(tmp_path):
    """Jobs were listed oldest first (the dashboard: newest first), a placing job showed no reason, a
    missing token was told in terms of the HTTP header, and `--status bogus` printed an empty table."""
    import httpx

    from icefloe.service.app import ServerThread
    from tests.service.service_client import PREFIX, TRAINING
    from tests.service.service_harness import make_app

    runner = CliRunner(env={"COLUMNS": "400", "ICEFLOE_REMOTE_PAT": "", "CORTEX_PAT": "", "ARCTIC_CORTEX_PAT": ""})
    with ServerThread(make_app(tmp_path, slots=1, engines="local", tokens=["cli-token"])) as base_url:
        headers = {"Authorization": "Bearer cli-token"}
        with httpx.Client(base_url=base_url + PREFIX, headers=headers, timeout=60) as http:
            first = http.post("/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]
            second = http.post("/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]  # waits for the slot
            base = ["--base-url", base_url]
            denied = runner.invoke(app, ["jobs", "list", *base])
            assert denied.exit_code == 1, denied.output
            assert "ICEFLOE_REMOTE_PAT=TOKEN" in denied.output and "--token TOKEN" in denied.output, denied.output
            listed = runner.invoke(app, ["jobs", "list", *base, "--token", "cli-token"])
            rows = [line for line in listed.output.splitlines() if first in line or second in line]
            assert [first in row for row in rows] == [False, True], listed.output  # newest first
            assert "waiting for 1 cpu slot(s): 0 of 1 free, 0 job(s) of yours ahead" in rows[0], listed.output
            bogus = runner.invoke(app, ["jobs", "list", *base, "--status", "bogus"])
            assert bogus.exit_code == 2 and "must be one of canceled, cancelled" in bogus.output, bogus.output
            http.post(f"/{first}:cancel")
            http.post(f"/{second}:cancel")


def test_cli_jobs_without_a_service_names_the_setting():
    result = CliRunner().invoke(app, ["jobs", "list"], env={"ICEFLOE_REMOTE_BASE_URL": "", "ARCTIC_CORTEX_HOST": ""})
    assert result.exit_code != 0
    assert "base_url" in result.output


def test_cli_jobs_for_a_managed_endpoint_without_a_token_names_token_and_its_env_var():
    """It blamed --base-url and told a person at a shell to build a config with ClientConfig.from_env()."""
    env = {"ICEFLOE_REMOTE_HOST": "acct.example.com", "ICEFLOE_REMOTE_DATABASE": "DB", "ICEFLOE_REMOTE_SCHEMA": "SC"}
    env |= dict.fromkeys(("ICEFLOE_REMOTE_BASE_URL", "ARCTIC_CORTEX_BASE_URL", "ICEFLOE_REMOTE_PAT", "CORTEX_PAT"), "")
    env |= {"ARCTIC_CORTEX_PAT": "", "COLUMNS": "200"}
    result = CliRunner().invoke(app, ["jobs", "list"], env=env)
    assert result.exit_code == 2
    assert "--token" in result.output and "ICEFLOE_REMOTE_PAT" in result.output, result.output
    assert "--base-url" not in result.output and "from_env" not in result.output, result.output


def test_cli_serve_refuses_port_0_as_its_help_says(tmp_path):
    """The help said 0 was allowed, and serve refused it."""
    shown = CliRunner().invoke(app, ["serve", "-h"], env={"COLUMNS": "200"})
    assert "[1<=x<=65535]" in shown.output, shown.output
    args = ["serve", "--port", "0", "--data-dir", str(tmp_path / "d")]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "'--port'" in result.output and "greater than or equal to 1" in result.output
    assert not (tmp_path / "d").exists()


def test_cli_serve_help_names_its_default_data_dir():
    """Rich markup ate "[default: <user data dir>/serve]" and left "checkpoints live ."."""
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert "checkpoints live (default: serve/ in the user data directory," in " ".join(result.output.split())


def test_cli_prints_its_version_and_takes_h_for_help():
    import importlib.metadata

    version = CliRunner().invoke(app, ["--version"])
    assert (version.exit_code, version.output) == (0, f"icefloe {importlib.metadata.version('icefloe')}\n")
    for args in (["-h"], ["jobs", "-h"], ["serve", "-h"]):
        shown = CliRunner().invoke(app, args)
        assert shown.exit_code == 0 and "Usage: icefloe" in shown.output, args


def test_cli_serve_on_a_busy_port_says_so_in_one_line_before_any_banner(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "icefloe.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == "", result.stdout
    assert result.stderr == (
        f"icefloe serve: cannot listen on http://127.0.0.1:{port}: Address already in use (another process "
        "listens there: stop it, or pass --port with a free port)\n"
    )


def test_cli_serve_prints_urls_that_work_for_an_ipv6_host(tmp_path):
    """`--host ::1` printed http://::1:8321, which no client can parse."""
    import re
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    command = [sys.executable, "-m", "icefloe.cli", "serve", "--host", "::1", "--port", str(port)]
    command += ["--engines", "local", "--data-dir", str(tmp_path / "serve")]
    log, base_url = tmp_path / "serve.log", f"http://[::1]:{port}"
    with _serving(command, base_url, log, env={**os.environ, "COLUMNS": "200"}):
        pass
    printed = log.read_text()
    urls = re.findall(r"http://\S+", printed)
    assert len(urls) >= 3 and all(url.startswith(base_url) for url in urls), printed  # the CLI's and the log's


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
    """--token put the secret in `ps`; a token file keeps it out of the command line. A relative
    --data-dir is made absolute, and a checkpoint's path is given relative to it (no answer names a
    server folder)."""
    import socket
    from pathlib import Path

    import httpx

    from icefloe.client import Client

    token = "file-token-" + "x" * 24
    token_file = tmp_path / "tokens"
    token_file.write_text(f"# serve tokens\n{token}\n")
    with socket.socket() as probe:  # a free port for the child to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "icefloe.cli", "serve", "--port", str(port), "--engines", "local"]
    command += ["--data-dir", "serve", "--token-file", str(token_file)]
    base_url = f"http://127.0.0.1:{port}"
    with _serving(command, base_url, tmp_path / "serve.log", cwd=tmp_path):
        assert token not in " ".join(command)
        capacity = f"{base_url}/api/v2/databases/DB/schemas/SC/cortex-training/capacity"
        assert httpx.get(capacity, timeout=30).status_code == 401
        assert httpx.get(capacity, headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
        client = Client({"model": "tiny:arith", "backend": {"type": "remote", "base_url": base_url, "pat": token}})
        try:
            saved = Path(client.save_checkpoint()["path"])
        finally:
            client.shutdown()
        assert not saved.is_absolute() and saved.parts[0] == "jobs" and (tmp_path / "serve" / saved).is_dir()


def test_cli_jobs_against_a_port_where_nothing_listens_fails_at_once(caplog):
    import socket

    with socket.socket() as sock:  # bound, never listening: every connection to it is refused
        sock.bind(("127.0.0.1", 0))
        base_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with caplog.at_level("WARNING", logger="icefloe.client.remote"):
            result = CliRunner().invoke(app, ["jobs", "list", "--base-url", base_url])
    assert result.exit_code == 1 and "is the service running?" in result.output
    assert not [r for r in caplog.records if "retrying" in r.getMessage()], "a refused connection is not retried"


# Runs code as under `pip install icefloe` (no extras): every module an extra brings fails to import.
_LIGHT_INSTALL = """
import importlib.metadata, re, sys
for requirement in importlib.metadata.requires("icefloe"):
    name = re.match(r"[A-Za-z0-9_.-]+", requirement).group().replace("-", "_")
    if "extra ==" in requirement and name != "icefloe":  # an extra may name others: icefloe[trackers]
        sys.modules[name] = None
"""


def _light(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-c", _LIGHT_INSTALL + code], capture_output=True, text=True, env=env)


def _light_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _light(f"sys.argv = ['icefloe', *{list(args)!r}]\nfrom icefloe.cli import main\nmain()", env)


def test_light_install_blocks_what_the_extras_bring():
    """The simulation itself: torch and fastapi are installed here, and fail to import under it."""
    done = _light("import torch")
    assert done.returncode == 1 and "ModuleNotFoundError" in done.stderr
    assert _light("import fastapi").returncode == 1


def test_light_install_cli_names_the_extra_in_one_line_before_creating_a_job(tmp_path):
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.settings import ServeSettings

    with ServerThread(create_app(ServeSettings(data_dir=tmp_path / "serve", port=0))) as base_url:
        remote = {"ICEFLOE_REMOTE_BASE_URL": base_url}
        for args, extra in ((["demo", "--backend", "remote"], "torch"), (["serve"], "server"), (["demo"], "torch")):
            done = _light_cli(*args, env=remote)
            assert done.returncode == 1, done.stderr
            assert "Traceback" not in done.stdout + done.stderr
            assert done.stdout.splitlines()[-1].endswith(f"pip install 'icefloe[{extra}]'"), done.stdout
            assert len(done.stdout.strip().splitlines()) == 1 and not done.stderr
        listed = _light_cli("jobs", "list", "--json", env=remote)  # the light driver's own commands work
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == []  # nothing was created


def test_light_install_client_says_why_it_cannot_tokenize(tmp_path):
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.settings import ServeSettings

    code = """
from icefloe.client import Client
from icefloe.config import ClientConfig
for backend in ({"type": "local"}, {"type": "remote"}):
    try:
        client = Client(ClientConfig.from_env(model="tiny:arith", backend=backend))
        client.tokenizer
    except ImportError as exc:
        print(type(exc).__name__, exc)
print(sorted(m for m in ("torch", "transformers", "icefloe.engines") if sys.modules.get(m)))
"""
    with ServerThread(create_app(ServeSettings(data_dir=tmp_path / "serve", port=0))) as base_url:
        done = _light(code, {"ICEFLOE_REMOTE_BASE_URL": base_url})
        jobs = json.loads(_light_cli("jobs", "list", "--json", "--base-url", base_url).stdout)
    assert done.returncode == 0, done.stderr
    local, remote, loaded = done.stdout.splitlines()
    assert local == "ImportError backend.type='local' runs the engines in this process: pip install 'icefloe[torch]'"
    assert remote.startswith("ImportError client.tokenizer loads the model's tokenizer with torch: ")
    assert "pip install 'icefloe[torch]'" in remote
    assert loaded == "[]" and jobs == []


def test_cli_models_export_names_an_unknown_preset_as_typed(tmp_path):
    result = CliRunner().invoke(app, ["models", "export", "tiny:Arith", str(tmp_path / "m")], env={"COLUMNS": "200"})
    assert result.exit_code == 2 and "model 'tiny:Arith' is not a tiny preset" in result.output
    assert not (tmp_path / "m").exists()
