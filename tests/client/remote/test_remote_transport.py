"""The remote backend against a real ``icefloe serve``: every op, parity with local, re-attach, hygiene."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
import torch

from icefloe.client import AsyncClient, Client, build_batch
from icefloe.client.transports.remote import RemoteTransport
from icefloe.config import ClientConfig
from icefloe.protocol import (
    OP_STEP,
    TARGET_TRAINING,
    ClientClosedError,
    InvalidRequestError,
    JobFailedError,
    NotFoundError,
    Request,
    UnauthenticatedError,
    UnsupportedOpError,
)

PROMPTS = ["12+7=", "3+4=", "25+17="]
LR = 1e-2


def _grpo_trace(client: Client, num_steps: int = 3) -> list[dict]:
    """A few GRPO steps: seeded sampling, a parity reward, group-centred advantages, fwd_bwd, step, sync."""
    tok = client.tokenizer
    prompt_ids_P = [tok(p)["input_ids"] for p in PROMPTS]
    trace = []
    for step in range(num_steps):
        samples = client.generate(prompt_ids_P, {"n": 2, "max_tokens": 4, "seed": 11 + step})
        rewards_D = [float(len(s["token_ids"]) % 2 + s["token_ids"][0] % 3) for s in samples]
        advantages_D = []
        for p in range(len(PROMPTS)):
            group = rewards_D[2 * p : 2 * p + 2]
            advantages_D += [r - sum(group) / 2 for r in group]
        batch = build_batch(
            [ids for ids in prompt_ids_P for _ in range(2)],
            [s["token_ids"] for s in samples],
            advantages_D,
            pad_id=tok.pad_token_id,
        )
        fb = client.fwd_bwd(batch)
        st = client.step()
        client.sync_weights()
        trace.append(
            {
                "tokens": [s["token_ids"] for s in samples],
                "loss": fb["loss"],
                "grad_norm": st["grad_norm"],
                "global_step": st["global_step"],
                "metric_keys": sorted(fb["metrics"]),
            }
        )
    return trace


def test_remote_loop_matches_local_losses_and_tokens(service, tmp_path):
    local_config = ClientConfig.build(model="tiny:arith", seed=0, training={"optimizer": {"lr": LR}})
    with Client(local_config) as local:
        expected = _grpo_trace(local)
    remote_config = ClientConfig.build(
        model="tiny:arith", seed=0, training={"optimizer": {"lr": LR}}, backend=service.config().backend
    )
    with Client(remote_config) as remote:
        got = _grpo_trace(remote)
        job_id = remote.handle()["transport"]["job_id"]
    assert [t["tokens"] for t in got] == [t["tokens"] for t in expected]
    for g, e in zip(got, expected, strict=True):
        assert g["loss"] == pytest.approx(e["loss"], abs=1e-5)
        assert g["grad_norm"] == pytest.approx(e["grad_norm"], abs=1e-5)
        assert g["global_step"] == e["global_step"]
        assert set(e["metric_keys"]) <= set(g["metric_keys"])
    assert service.request_counts(job_id)["forward-backward"] == 3


def test_remote_every_op_returns_the_canonical_shapes(service):
    with Client(service.config()) as client:
        tok = client.tokenizer
        batch = build_batch([tok("1+1=")["input_ids"]] * 2, [[5, 6], [7]], [1.0, -1.0], pad_id=tok.pad_token_id)
        forward = client.forward(batch)
        assert forward["logprobs"].shape == batch["kwargs"]["input_ids"].shape
        assert forward["logprobs"].dtype == torch.float32 and forward["entropy"].shape == forward["logprobs"].shape
        assert set(client.fwd_bwd(batch)) >= {"loss", "avg_loss", "metrics", "num_tokens"}
        assert set(client.step(learning_rate=1e-3)) >= {"global_step", "lr", "grad_norm", "metrics"}
        assert set(client.sync_weights()) >= {"policy_version", "seconds", "bytes"}
        samples = client.generate(["1+1="], {"max_tokens": 3, "seed": 0, "logprobs": True})
        assert isinstance(samples[0]["token_ids"], list) and isinstance(samples[0]["logprobs"], list)
        saved = client.save_checkpoint("weights-only")
        assert saved["checkpoint_id"] == "global_step1" and saved["kind"] == "weights-only" and saved["path"]
        assert [c["checkpoint_id"] for c in client.list_checkpoints()] == ["global_step1"]
        exported = client.get_checkpoint("global_step1")
        assert exported["global_step"] == 1 and {f["filename"] for f in exported["files"]} >= {"model.safetensors"}
        assert client.load_checkpoint("global_step1")["checkpoint_id"] == "global_step1"
        for noop in (
            client.sleep_training,
            client.wake_training,
            client.sleep_inference,
            client.wake_inference,
        ):
            assert noop() == {}
        assert client.reset_prefix_cache() == {}
        assert client.delete_checkpoint("global_step1") == {}
        with pytest.raises(NotFoundError) as info:
            client.delete_checkpoint("global_step1")
        assert info.value.status_code == 404
        with pytest.raises(UnsupportedOpError, match=r"sync_weights\(\)"):
            client.save_weights("/tmp/x")
        with pytest.raises(InvalidRequestError, match="num_log_prob_workers"):
            client.forward(batch, reference=True)


def test_remote_reference_forward_routes_to_the_log_probability_sub_job(service):
    config = ClientConfig.build(num_log_prob_workers=1, backend=service.config().backend)
    with Client(config) as client:
        batch = build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0)
        policy = client.forward(batch)["logprobs"]
        client.fwd_bwd(batch)
        client.step(learning_rate=0.5)
        moved = client.forward(batch)["logprobs"]
        reference = client.forward(batch, reference=True)["logprobs"]
        torch.testing.assert_close(reference, policy)
        assert not torch.allclose(moved, policy)
        assert set(client.handle()["transport"]["sub_jobs"]) == {"training", "sampling", "log_probability"}


def _step(client: Client) -> dict:
    """A step after the fwd_bwd it needs."""
    client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
    return client.step()


def test_remote_handle_reattaches_without_creating_a_job(service):
    with Client(service.config(cancel_on_shutdown=False)) as first:
        _step(first)
        handle = first.handle()
        assert "pat" not in handle["config"]["backend"] and "pat" not in handle["transport"]
        jobs_before = len(service.app.state.db.fetch_all("SELECT job_id FROM jobs"))
        second = Client.from_handle(handle)
        try:
            assert _step(second)["global_step"] == 2
        finally:
            second.shutdown()
        assert len(service.app.state.db.fetch_all("SELECT job_id FROM jobs")) == jobs_before
        status = service.app.state.db.fetch_one(
            "SELECT status FROM jobs WHERE job_id = ?", (handle["transport"]["job_id"],)
        )
        assert status["status"] == "running"  # the re-attached client did not cancel what it did not create


def test_remote_shutdown_cancels_the_created_job_and_blocks_later_ops(service):
    client = Client(service.config()).open()
    job_id = client.handle()["transport"]["job_id"]
    client.shutdown()
    client.shutdown()
    with pytest.raises(ClientClosedError):
        client.step()
    row = service.app.state.db.fetch_one("SELECT status FROM jobs WHERE job_id = ?", (job_id,))
    assert row["status"] in ("cancelling", "cancelled", "terminated")


class _WithoutForward(httpx.AsyncBaseTransport):
    """Passes every request on, but advertises no ``forward`` op (as the managed endpoint lacks it)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if not request.url.path.endswith("/capabilities"):
            return response
        body = json.loads(await response.aread())
        body["ops"] = [op for op in body["ops"] if op != "forward"]
        return httpx.Response(response.status_code, json=body)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_remote_forward_without_service_support_needs_explicit_zero_fill(service):
    batch = build_batch([[3, 4]], [[5, 6, 7]], [1.0], pad_id=0)
    for allow in (False, True):
        config = service.config(allow_zero_logprobs=allow)
        with Client(config, transport=RemoteTransport(config, wrap_http_transport=_WithoutForward)) as client:
            if allow:
                out = client.forward(batch)
                assert out["logprobs"].shape == batch["kwargs"]["input_ids"].shape
                assert not out["logprobs"].any() and "forward" in client.capabilities
            else:
                assert "forward" not in client.capabilities
                with pytest.raises(UnsupportedOpError, match="allow_zero_logprobs"):
                    client.forward(batch)
            assert "forward" not in service.request_counts(client.handle()["transport"]["job_id"])


def test_remote_job_failure_raises_with_reason_and_sub_jobs(service):
    config = ClientConfig.build(model="tiny:no-such-preset", backend=service.config().backend)
    with pytest.raises(JobFailedError) as info:
        Client(config).open()
    assert info.value.status == "failed" and info.value.sub_jobs


def test_remote_async_client_overlaps_generate_calls(service):
    async def run() -> tuple[list, list]:
        async with AsyncClient(service.config()) as client:
            prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
            params = {"max_tokens": 3, "seed": 5}
            single = await asyncio.gather(*(client.generate([p], params) for p in prompts))
            batched = await client.generate(prompts, params)
            fb, st = await asyncio.gather(client.fwd_bwd(build_batch([[3]], [[4, 5]], [1.0], pad_id=0)), client.step())
            assert st["global_step"] == 1 and "loss" in fb
            return [s[0]["token_ids"] for s in single], [s["token_ids"] for s in batched]

    single, batched = asyncio.run(run())
    assert single == batched


def test_remote_async_client_survives_an_event_loop_change(service):
    client = AsyncClient(service.config())

    async def one_step() -> int:
        await client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
        return (await client.step())["global_step"]

    assert asyncio.run(one_step()) == 1
    assert asyncio.run(one_step()) == 2  # a fresh loop: the transport builds a new HTTP client
    asyncio.run(client.shutdown())


def test_remote_pat_never_reaches_repr_logs_or_errors(service, tmp_path, caplog):
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.hosts.slots import SlotPool
    from icefloe.service.settings import ServeSettings

    secret = "pat-TOP-SECRET-42"
    app = create_app(ServeSettings(data_dir=tmp_path / "auth", tokens=[secret]), pool=SlotPool("cpu", 2))
    with ServerThread(app) as base_url, caplog.at_level(logging.DEBUG):
        good = ClientConfig.from_env(
            backend={
                "type": "remote",
                "base_url": base_url,
                "retry_initial_s": 0.01,
                "poll_interval_s": 0.02,
            },
            environ={"CORTEX_PAT": secret},
        )
        client = Client(good)
        assert secret not in repr(client) and secret not in repr(good) and secret not in str(good.model_dump())
        with client:
            _step(client)
            assert secret not in str(client.handle())
        bad = ClientConfig.from_env(
            backend={"type": "remote", "base_url": base_url, "max_retries": 0},
            environ={"CORTEX_PAT": secret + "-wrong"},
        )
        with pytest.raises(UnauthenticatedError) as info:
            Client(bad).open()
        assert info.value.status_code == 401
        assert secret not in str(info.value) and secret not in repr(info.value.args)
    assert secret not in caplog.text


def test_remote_concurrent_generates_each_get_their_own_samples_and_fail_alone(service):
    async def run() -> None:
        async with AsyncClient(service.config()) as client:
            prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
            params = {"max_tokens": 3, "seed": 5, "n": 2}
            results = await asyncio.gather(*(client.generate([p], params) for p in prompts))
            alone = [await client.generate([p], params) for p in prompts]
            assert [[s["token_ids"] for s in r] for r in results] == [[s["token_ids"] for s in r] for r in alone]
            too_long = [5] * 600  # over max_seq_len: the service refuses this call only
            good, bad = await asyncio.gather(
                client.generate([[1, 2]], params), client.generate([too_long], params), return_exceptions=True
            )
            assert isinstance(good, list) and len(good) == 2
            assert isinstance(bad, InvalidRequestError) and bad.status_code == 400 and "max_seq_len" in str(bad)

    asyncio.run(run())


def test_remote_steps_follow_the_lr_schedule_like_local(service):
    training = {
        "optimizer": {"lr": 0.01},
        "lr_schedule": {"kind": "cosine", "warmup_steps": 2, "total_steps": 5},
    }
    with Client(ClientConfig.build(training=training)) as local:
        expected = [_step(local)["lr"] for _ in range(6)]
    config = ClientConfig.build(training=training, backend=service.config().backend)
    with Client(config) as remote:
        got = [_step(remote)["lr"] for _ in range(3)]
        saved = remote.save_checkpoint()
        got += [_step(remote)["lr"] for _ in range(3)]
        remote.load_checkpoint(saved["checkpoint_id"])  # back to step 3: the schedule resumes there
        assert _step(remote)["lr"] == pytest.approx(expected[3])
    assert got == pytest.approx(expected)


def test_remote_a_failed_step_does_not_advance_the_lr_schedule_as_on_local(service):
    """The remote client counted a step when it was called: after one that failed, its warm-up ran a step ahead."""
    training = {"optimizer": {"lr": 1e-2}, "lr_schedule": {"warmup_steps": 4}}

    def rates(client: Client) -> list[float]:
        with pytest.raises(InvalidRequestError, match="needs a fwd_bwd"):
            client.step()
        return [_step(client)["lr"] for _ in range(2)]

    with Client(ClientConfig.build(training=training)) as local:
        expected = rates(local)
    with Client(ClientConfig.build(training=training, backend=service.config().backend)) as remote:
        got = rates(remote)
    assert expected == pytest.approx([0.0025, 0.005])  # the failed step advanced nothing
    assert got == pytest.approx(expected)


def test_remote_a_step_that_cannot_be_sent_is_refused_before_it_takes_the_next_ops_turn(service):
    """learning_rate=inf took a sequence number and then failed to encode: the POST with that number
    never left, so every later op of the role waited for it and failed with SequenceGapError."""
    config = service.config()
    transport = RemoteTransport(config)
    with Client(config, transport=transport) as client:
        client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
        with pytest.raises(InvalidRequestError, match="learning_rate must be > 0 and finite"):
            client.step(learning_rate=float("inf"))
        with pytest.raises(ValueError, match="JSON"):  # past the client's check: refused by the call itself
            transport.handle(Request(OP_STEP, TARGET_TRAINING, {"learning_rate": float("inf")}))
        assert client.step()["global_step"] == 1


def test_probe_capabilities_asks_the_service_without_creating_a_job(service):
    from icefloe.client.remote.admin import ServiceAdmin
    from icefloe.client.transports import probe_capabilities
    from icefloe.protocol import OP_FORWARD

    config = service.config()
    with ServiceAdmin(config.backend) as admin:
        before = {job["job_id"] for job in admin.list_jobs()}
        assert OP_FORWARD in probe_capabilities(config)
        assert {job["job_id"] for job in admin.list_jobs()} == before


def test_remote_step_reports_peak_memory_when_the_config_asks(service):
    base = service.config()
    config = base.model_copy(update={"training": base.training.model_copy(update={"peak_memory_log": True})})
    with Client(config) as client:
        client.fwd_bwd(build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0))
        peak = client.step()["peak_memory"]
    assert peak["gpu_peak"] == 0 and peak["cpu_peak"] > 0  # the service's engine process, measured there
