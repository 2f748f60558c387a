"""Per-step job metrics (engine values and client reports), ``GET /metrics``, and ``Client.log_metrics``."""

from __future__ import annotations

import asyncio
import math
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from icefloe.client import AsyncClient, Client, build_batch
from icefloe.config import ClientConfig
from icefloe.protocol import InvalidRequestError
from icefloe.service.app import ServerThread

from .service_client import PREFIX, SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

anyio = pytest.mark.anyio


async def _train(api: Api, job_id: str, steps: int) -> None:
    for _ in range(steps):
        await api.fwd_bwd(job_id)
        await api.run(job_id, "POST", "step", json={"learning_rate": 1e-3})


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a Prometheus text page: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@anyio
async def test_engine_and_client_values_merge_into_one_point_per_step_and_survive_a_restart(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        caps = (await api.call("GET", "/capabilities")).json()
        assert caps["extensions"]["job_metrics"] is True
        job_id = await api.running(TRAINING)
        await _train(api, job_id, steps=2)
        reported = await api.call("POST", f"/{job_id}/metrics", json={"step": 2, "metrics": {"reward": 0.75, "kl": 0}})
        assert reported.json() == {"job_id": job_id, "step": 2, "recorded": ["kl", "reward"]}
        answer = (await api.call("GET", f"/{job_id}/metrics")).json()
    assert answer["job_id"] == job_id
    points = answer["points"]
    assert [p["step"] for p in points] == [1, 2]  # global_step, as the client's step() reports it
    for point in points:
        assert {"time", "loss", "grad_norm", "lr", "num_tokens", "step_time_s", "tokens_per_s"} <= set(point)
        assert point["lr"] == 1e-3 and point["num_tokens"] == 16 and math.isfinite(point["loss"])
    assert points[1]["reward"] == 0.75 and points[1]["kl"] == 0.0 and "reward" not in points[0]

    async with asgi_client(make_app(data_dir)) as http:  # a new service process on the same data dir
        again = (await Api(http).call("GET", f"/{job_id}/metrics")).json()
    assert again["points"] == points


@anyio
@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"step": "3", "metrics": {"reward": 1.0}}, "step must be an integer >= 0"),
        ({"step": -1, "metrics": {"reward": 1.0}}, "step must be an integer >= 0"),
        ({"step": 2**63, "metrics": {"reward": 1.0}}, "(at most 2**63 - 1)"),
        ({"step": 1, "metrics": {}}, "metrics must be a non-empty object"),
        ({"step": 1, "metrics": [1.0]}, "metrics must be a non-empty object"),
        ({"step": 1, "metrics": {"": 1.0}}, "name '' must be a non-empty string"),
        ({"step": 1, "metrics": {"reward": "high"}}, "metrics.reward must be a finite number; got 'high'"),
        ({"step": 1, "metrics": {"reward": True}}, "metrics.reward must be a finite number"),
        ({"step": 1, "metrics": {"reward": 1.0}, "extra": 1}, "body has unknown keys ['extra']"),
        ({"step": 1, "metrics": {"r" * 257: 1.0}}, "has 257 characters; at most 256"),
    ],
)
async def test_a_bad_report_is_a_400_naming_the_field(data_dir, body, named):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        refused = await api.call("POST", f"/{job_id}/metrics", json=body, check=False)
        assert refused.status_code == 400 and named in refused.json()["message"], refused.text
        overflow = await api.call(
            "POST", f"/{job_id}/metrics", content=b'{"step": 1, "metrics": {"r": 1e400}}', check=False,
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert overflow.status_code == 400
        missing = await api.call("POST", "/no-such-job/metrics", json={"step": 1, "metrics": {"r": 1}}, check=False)
        assert missing.status_code == 404
        assert (await api.call("GET", f"/{job_id}/metrics")).json()["points"] == []


def _report(step: int, names: range, prefix: str = "m") -> dict:
    return {"step": step, "metrics": {f"{prefix}{k}": float(step) for k in names}}


@anyio
async def test_a_job_keeps_its_clients_reports_up_to_its_bounds_and_refuses_past_them_with_409(data_dir):
    """4,000 reports of 256 names each had made 1M rows and a 571 MB database for one job."""
    async with asgi_client(make_app(data_dir, max_job_metric_values=600)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)

        async def report(body: dict) -> httpx.Response:
            return await api.call("POST", f"/{job_id}/metrics", json=body, check=False)

        assert (await report(_report(0, range(256)))).status_code == 200
        wider = await report(_report(1, range(1), prefix="other"))
        assert wider.status_code == 409 and "at most 256 metric names" in wider.json()["message"], wider.text
        assert (await report(_report(0, range(256)))).status_code == 200  # values it already holds: none added
        assert (await report(_report(1, range(256)))).status_code == 200
        full = await report(_report(2, range(100)))
        assert full.status_code == 409, full.text
        assert "at most 600 values" in full.json()["message"] and "holds 512" in full.json()["message"]
        assert (await report(_report(2, range(88)))).status_code == 200  # exactly the bound
        assert (await report(_report(3, range(1)))).status_code == 409
        points = (await api.call("GET", f"/{job_id}/metrics")).json()["points"]
    assert [len(point) - 2 for point in points] == [256, 256, 88]  # what was refused left nothing behind


@anyio
async def test_the_series_is_answered_a_page_of_whole_steps_at_a_time(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        for step in range(40):  # 10,240 values: more than one page holds
            await api.call("POST", f"/{job_id}/metrics", json=_report(step, range(256)))
        first = (await api.call("GET", f"/{job_id}/metrics")).json()
        rest = (await api.call("GET", f"/{job_id}/metrics", params={"after_step": first["next_after_step"]})).json()
        past = await api.call("GET", f"/{job_id}/metrics", params={"after_step": 2**64}, check=False)
    assert past.status_code == 400 and "after_step" in past.json()["message"]  # was a 500: SQLite has 64 bits
    assert [p["step"] for p in first["points"]] == list(range(32)) and first["next_after_step"] == 31
    assert [p["step"] for p in rest["points"]] == list(range(32, 40)) and rest["next_after_step"] is None
    assert all(len(point) == 258 for point in first["points"] + rest["points"])  # whole steps: every name


@anyio
async def test_prometheus_page_counts_requests_jobs_queue_and_weight_syncs(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        await _train(api, job_id, steps=2)
        sync = {"operation_type": "weight-sync", "payload": {"source_sub_job_id": f"{job_id}:training:0"}}
        synced = await api.run(job_id, "POST", "operation", json=sync)
        failed = await api.call("POST", f"/{job_id}/step", json={})  # no fwd_bwd since the last step
        assert (await api.poll(job_id, failed.json()["request_id"]))["status"] == "failed"
        page = await http.get("/metrics")
        points = (await api.call("GET", f"/{job_id}/metrics")).json()["points"]
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    samples = _samples(page.text)
    assert samples[("icefloe_requests_total", (("op", "step"), ("outcome", "done")))] == 2
    assert samples[("icefloe_requests_total", (("op", "step"), ("outcome", "failed")))] == 1
    assert samples[("icefloe_requests_total", (("op", "forward-backward"), ("outcome", "done")))] == 2
    assert samples[("icefloe_request_seconds_count", (("op", "forward-backward"),))] == 2
    assert samples[("icefloe_engine_seconds_count", (("op", "step"),))] == 2
    assert samples[("icefloe_jobs", (("state", "running"),))] == 1
    assert samples[("icefloe_weight_sync_seconds_count", ())] == 1
    assert samples[("icefloe_weight_sync_bytes_total", ())] == synced["bytes"] > 0
    assert samples[("icefloe_chunk_store_bytes", (("job_id", job_id),))] == 0
    assert "# TYPE icefloe_queue_depth gauge" in page.text
    assert points[1]["policy_version"] == 2  # the sync moved the weights of step 1


@anyio
async def test_metrics_page_needs_the_token_unless_public(data_dir, tmp_path):
    async with asgi_client(make_app(data_dir, tokens=("s3cret",))) as http:
        refused = await http.get("/metrics")
        allowed = await http.get("/metrics", headers={"authorization": "Bearer s3cret"})
    assert refused.status_code == 401 and allowed.status_code == 200 and "icefloe_jobs" in allowed.text
    async with asgi_client(make_app(tmp_path / "public", tokens=("s3cret",), metrics_public=True)) as http:
        public = await http.get("/metrics")
        api = await http.get(PREFIX + "/capabilities")
    assert public.status_code == 200 and api.status_code == 401


def _remote(base_url: str) -> ClientConfig:
    fast = {"poll_interval_s": 0.02, "poll_max_interval_s": 0.2}
    return ClientConfig.build(
        {
            "model": "tiny:arith",
            "seed": 0,
            "num_sampling_workers": 1,
            "backend": {"type": "remote", "base_url": base_url, **fast},
        }
    )


def test_remote_client_reports_metrics_next_to_the_engine_values(data_dir):
    with ServerThread(make_app(data_dir)) as base_url, Client(_remote(base_url)) as client:
        tok = client.tokenizer
        prompt = tok("1+2=")["input_ids"]
        samples = client.generate([prompt], {"n": 2, "max_tokens": 3, "seed": 1})
        client.fwd_bwd(
            build_batch([prompt] * 2, [s["token_ids"] for s in samples], [1.0, -1.0], pad_id=tok.pad_token_id)
        )
        step = client.step()["global_step"]  # the point's number, as "step 71" must not say global_step 72
        client.sync_weights()
        assert client.log_metrics({"reward": 0.5}, step=step) is None
        with pytest.raises(InvalidRequestError, match=r"metrics.reward must be a finite number; got nan"):
            client.log_metrics({"reward": float("nan")}, step=step)

        async def report_async() -> None:
            async with AsyncClient(client.config, _handle=client.handle()["transport"]) as other:
                await other.log_metrics({"reward_async": 2}, step=step)

        asyncio.run(report_async())
        job_id = client.handle()["transport"]["job_id"]
        points = httpx.get(f"{base_url}{PREFIX}/{job_id}/metrics").json()["points"]
    assert [point["step"] for point in points] == [step] == [1]
    assert points[0]["reward"] == 0.5 and points[0]["reward_async"] == 2.0 and points[0]["policy_version"] == 1
    assert {"loss", "grad_norm", "lr"} <= set(points[0])


def test_local_client_log_metrics_is_a_no_op_after_checking_its_input():
    client = Client(ClientConfig.build({"model": "tiny:arith", "seed": 0}))
    with pytest.raises(InvalidRequestError, match="metrics: name '' must be a non-empty string"):
        client.log_metrics({"": 1.0}, step=0)
    with pytest.raises(InvalidRequestError, match="step must be an integer >= 0; got -2"):
        client.log_metrics({"reward": 1.0}, step=-2)
    with client:
        assert client.log_metrics({"reward": 1.0}, step=0) is None


@anyio
async def test_reading_a_job_never_renews_its_lease_and_a_heartbeat_does(data_dir):
    """`jobs show` every 10 s, `logs -f` or an open dashboard page kept a job whose client was killed alive."""
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING)
        live = app.state.jobs.live_job(job_id)
        live.lease_until = soon = time.monotonic() + 5.0  # as if the client's last call were long ago
        tail = {"operation_type": "tail-logs", "payload": {"max_lines": 5}}
        for method, path, body in [
            ("GET", f"/{job_id}", None),  # jobs show, the client's own wait for the job to run
            ("GET", f"/{job_id}/metrics", None),  # jobs show
            ("POST", f"/{job_id}/operation", tail),  # logs -f
            ("GET", f"/{job_id}/checkpoints", None),
            ("GET", "", None),  # jobs list
        ]:
            await api.call(method, path, json=body)
            assert live.lease_until == soon, f"{method} {path or '/'} renewed the lease"
        assert (await http.get(f"/ui/api/jobs/{job_id}")).status_code == 200
        assert live.lease_until == soon
        await api.call("POST", f"/{job_id}:heartbeat")
        assert live.lease_until > soon + 60


@anyio
async def test_the_observability_table_lists_every_metric_the_service_exports(data_dir):
    """`icefloe_host_jobs` and `icefloe_job_host` were exported but missing from the table."""
    from pathlib import Path

    table = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    documented = set(re.findall(r"^\| `(icefloe_\w+)` \|", table, re.MULTILINE))
    async with asgi_client(make_app(data_dir)) as http:
        page = (await http.get("/metrics")).text
    families = [f for f in text_string_to_metric_families(page) if f.name.startswith("icefloe_")]
    # The text format also carries each counter's and histogram's creation time as a `<name>_created` gauge.
    names = {f"{f.name}_total" if f.type == "counter" else f.name for f in families}
    exported = {name for name in names if not name.endswith("_created")}
    assert exported == documented
