"""The ``/ui`` dashboard: its auth, the JSON it draws from, and the rendered page in headless Chromium."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from icefloe.client import Client, build_batch
from icefloe.config import ClientConfig

from ..faults.serve_process import Serve
from .service_client import PREFIX, SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT_ENV_VAR = "ICEFLOE_UI_SCREENSHOT"  # also copy the browser test's screenshot here


@pytest.mark.anyio
async def test_dashboard_pages_need_a_login_whose_cookie_holds_a_session_id_not_the_token(data_dir):
    async with asgi_client(make_app(data_dir, tokens=("s3cret",))) as http:
        for page in ("/ui", "/ui/jobs/some-job"):
            redirected = await http.get(page)
            assert (redirected.status_code, redirected.headers["location"]) == (303, "/ui/login")
        assert (await http.get("/ui/api/jobs")).status_code == 401
        assert 'name="token"' in (await http.get("/ui/login")).text
        assert (await http.get("/ui/static/app.js")).status_code == 200

        wrong = await http.post("/ui/login", content=b"token=guess", headers=_FORM)
        assert wrong.headers["location"] == "/ui/login?failed=1" and "set-cookie" not in wrong.headers
        right = await http.post("/ui/login", content=b"token=s3cret", headers=_FORM)
        cookie = right.headers["set-cookie"]
        session_id = cookie.removeprefix("icefloe_session=").split(";")[0]
        assert right.headers["location"] == "/ui" and len(session_id) >= 40 and "s3cret" not in cookie
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Max-Age=" in cookie

        signed_in = {"cookie": f"icefloe_session={session_id}"}
        page = await http.get("/ui", headers=signed_in)
        assert 'id="jobs"' in page.text
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["content-security-policy"] == "frame-ancestors 'none'"
        assert (await http.get("/ui/api/jobs", headers=signed_in)).json() == {"jobs": []}
        assert (await http.get(PREFIX + "/capabilities", headers=signed_in)).status_code == 200
        assert (await http.get("/metrics", headers=signed_in)).status_code == 200
        assert (await http.get("/ui", headers={"cookie": "icefloe_session=guess"})).status_code == 303
        assert (await http.get("/ui", headers={"cookie": "icefloe_token=s3cret"})).status_code == 303  # no token cookie

        csrf = (await http.get("/ui/api/session", headers=signed_in)).json()
        assert csrf["tenant"] == "default" and csrf["csrf_token"]
        assert (await http.post("/ui/logout", headers=signed_in)).status_code == 403  # no Origin, no CSRF token
        out = await http.post("/ui/logout", headers={**signed_in, "x-csrf-token": csrf["csrf_token"]})
        assert out.status_code == 303 and out.headers["location"] == "/ui/login"
        assert (await http.get("/ui/api/jobs", headers=signed_in)).status_code == 401  # the session is revoked


_FORM = {"content-type": "application/x-www-form-urlencoded"}


@pytest.mark.anyio
async def test_dashboard_json_has_the_jobs_row_queue_failures_checkpoints_and_log(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        await api.fwd_bwd(job_id)
        await api.run(job_id, "POST", "step", json={})
        await api.call("POST", f"/{job_id}/metrics", json={"step": 1, "metrics": {"reward": 0.25}})
        saved = await api.run(job_id, "POST", "save", json={})
        failed = (await api.call("POST", f"/{job_id}/step", json={})).json()  # no fwd_bwd since the last step
        assert (await api.poll(job_id, failed["request_id"]))["status"] == "failed"
        (row,) = (await http.get("/ui/api/jobs")).json()["jobs"]
        detail = (await http.get(f"/ui/api/jobs/{job_id}")).json()
        assert (await http.get("/ui/api/jobs/no-such-job")).status_code == 404
    assert row["job_id"] == job_id and row["status"] == "running" and row["mode"] == "full"
    assert row["model"] == "tiny:arith" and row["step"] == 1 and row["reward"] == 0.25 and "loss" in row
    assert row["lease"].startswith("expires in")
    assert [s["job_type"] for s in detail["sub_jobs"]] == ["training", "sampling"]
    assert detail["queue"] == []
    assert detail["failed"][0]["op"] == "step" and "call fwd_bwd first" in detail["failed"][0]["error"]
    assert [c["checkpoint_id"] for c in detail["checkpoints"]] == [saved["checkpoint_id"]]
    messages = [entry["msg"] for entry in detail["log"]]
    assert "job is running" in messages and messages.count("job is running") == 1  # a job-wide line, shown once


# --- in a real browser against a real `icefloe serve` ----------------------------------------------
def _chromium(profile: Path, *args: str) -> str:
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--virtual-time-budget=6000", *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install chromium; .ci/run installs it)")
def test_job_page_renders_charts_log_and_checkpoints_in_headless_chromium(tmp_path):
    steps = 3
    with Serve(tmp_path / "serve") as serve:
        base_url = serve.base_url
        config = ClientConfig.build(
            {
                "model": "tiny:arith",
                "seed": 0,
                "num_sampling_workers": 1,
                "backend": {"type": "remote", "base_url": base_url, "poll_interval_s": 0.02},
            }
        )
        with Client(config) as client:
            tok = client.tokenizer
            prompts = [tok(p)["input_ids"] for p in ("1+2=", "3+4=")]
            for step in range(steps):
                samples = client.generate(prompts, {"n": 2, "max_tokens": 3, "seed": step})
                rewards = [float(len(s["token_ids"]) % 2) for s in samples]
                batch = build_batch(
                    [p for p in prompts for _ in range(2)],
                    [s["token_ids"] for s in samples],
                    [r - sum(rewards) / len(rewards) for r in rewards],
                    pad_id=tok.pad_token_id,
                )
                client.fwd_bwd(batch)
                client.step()
                client.sync_weights()
                client.log_metrics({"reward": sum(rewards) / len(rewards)}, step=step + 1)  # the global_step
            checkpoint = client.save_checkpoint()
            job_id = client.handle()["transport"]["job_id"]

            page = f"{base_url}/ui/jobs/{job_id}"
            dom = _chromium(tmp_path / "profile", "--dump-dom", page)
            jobs_dom = _chromium(tmp_path / "profile", "--dump-dom", f"{base_url}/ui")
            screenshot = tmp_path / "ui-screenshot.png"
            _chromium(tmp_path / "profile", f"--screenshot={screenshot}", "--window-size=1400,1000", page)

    (tmp_path / "job-page.html").write_text(dom)
    if os.environ.get(SCREENSHOT_ENV_VAR):
        target = Path(os.environ[SCREENSHOT_ENV_VAR])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, target)
    assert f'data-job-id="{job_id}"' in dom and f'data-job-id="{job_id}"' in jobs_dom
    for metric in ("loss", "reward", "grad_norm", "lr", "step_time_s", "tokens_per_s", "policy_version"):
        # every chart on one x range: reward and policy_version started one step off the others
        assert re.search(rf'data-metric="{metric}" data-points="{steps}" data-steps="1-{steps}"', dom), metric
    assert dom.count("<canvas") >= 7  # uPlot drew each chart
    assert "job is running" in dom and checkpoint["checkpoint_id"] in dom
    assert screenshot.stat().st_size > 10_000
    output = serve.output()
    assert f"job {job_id} is running" in output and f"job {job_id} step {steps} loss" in output
