"""Many LoRA jobs on one base model: one host and one slot, each run exactly as alone, each isolated."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import peft as _peft  # noqa: F401 (the dev extra installs it: fail, never skip)
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from icefloe.cli import app as cli

from ..refusing_loss import REFUSING_LOSS, register_refusing_loss
from .service_batches import canonical_batch, small_batch
from .service_client import TRAINING, Api
from .service_harness import asgi_client, make_app, wrap_engine_method

pytestmark = pytest.mark.anyio

MODEL = "arith"  # a folder under the model root: runs with different seeds share its weights
RANKS = [4, 8, 2, 4]


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    assert CliRunner().invoke(cli, ["models", "export", "tiny:arith", str(root / MODEL)]).exit_code == 0
    return root


def lora_job(seed: int, rank: int = 4) -> list[dict]:
    peft = {"peft_type": "Lora", "r": rank, "lora_alpha": 8}
    training = {"optimizer": {"name": "AdamW", "lr": 2e-2}, "max_seq_len": 64, "peft_config": peft}
    return [
        {"job_type": "training", "model_name": MODEL, "seed": seed, "training_config": training},
        {"job_type": "sampling", "model_name": MODEL, "seed": seed,
         "inference_config": {"max_seq_len": 64, "n_gpus": 0, "peft_config": peft}},
    ]  # fmt: skip


async def _run(api: Api, job_id: str, index: int, steps: int, data_dir: Path) -> dict:
    """A run's fixed schedule: steps of forward-backward + step, then a forward, a sync, a generate and a save."""
    losses = []
    for step in range(steps):
        losses.append((await api.fwd_bwd(job_id, seed=10 * index + step))["loss"])
        await api.run(job_id, "POST", "step", json={})
    accepted = (await api.post_frame(job_id, "forward", small_batch(99))).json()
    logprobs = (await api.result(job_id, accepted["request_id"]))["logprobs"]
    sync = {"operation_type": "weight-sync", "sub_job_type": "training", "payload": {}}
    await api.run(job_id, "POST", "operation", json=sync)
    body = {"prompts": [[1, 11, 2]], "sampling_params": {"max_tokens": 5, "n": 3, "seed": 7, "logprobs": True}}
    samples = await api.result(job_id, (await api.post_frame(job_id, "generate", body)).json()["request_id"])
    saved = await api.run(job_id, "POST", "save", json={"checkpoint_type": "weights-only"})
    adapter = load_file(str(data_dir / saved["path"] / "adapter_model.safetensors"))  # a path in the data dir
    return {"losses": losses, "logprobs": logprobs, "samples": samples["results"], "adapter": adapter}


async def _four_runs(app, steps: int) -> tuple[list[dict], list[dict]]:
    async with asgi_client(app) as http:
        api = Api(http)
        job_ids = [await api.create(*lora_job(seed=i + 1, rank=RANKS[i])) for i in range(4)]
        jobs = [await api.wait_status(job_id, "running") for job_id in job_ids]
        data_dir = app.state.settings.data_dir
        results = await asyncio.gather(*(_run(api, job_id, i, steps, data_dir) for i, job_id in enumerate(job_ids)))
        return jobs, list(results)


@pytest.mark.slow  # eight jobs of five steps each: tens of seconds
async def test_four_runs_on_one_host_equal_each_run_alone(tmp_path, model_root):
    shared_jobs, shared = await _four_runs(make_app(tmp_path / "shared", slots=1, model_root=model_root), steps=5)
    alone_app = make_app(tmp_path / "alone", slots=4, max_adapters=1, model_root=model_root)
    alone_jobs, alone = await _four_runs(alone_app, steps=5)
    assert len({job["host"]["host_id"] for job in shared_jobs}) == 1
    assert len({job["host"]["host_id"] for job in alone_jobs}) == 4
    for mine, theirs in zip(shared, alone, strict=True):
        torch.testing.assert_close(torch.tensor(mine["losses"]), torch.tensor(theirs["losses"]), atol=1e-5, rtol=0)
        torch.testing.assert_close(mine["logprobs"], theirs["logprobs"], atol=1e-5, rtol=0)
        assert mine["adapter"].keys() == theirs["adapter"].keys()
        for name, tensor in theirs["adapter"].items():
            torch.testing.assert_close(mine["adapter"][name], tensor, atol=1e-5, rtol=0)
        assert [s["token_ids"] for s in mine["samples"]] == [s["token_ids"] for s in theirs["samples"]]
        assert {s["policy_version"] for s in mine["samples"]} == {5}


async def test_lora_jobs_of_one_base_share_one_host_and_one_slot(tmp_path, model_root):
    app = make_app(tmp_path, slots=1, model_root=model_root)
    async with asgi_client(app) as http:
        api = Api(http)
        lora_ids = [await api.create(*lora_job(seed=i)) for i in range(4)]
        hosts = {(await api.wait_status(job_id, "running"))["host"]["host_id"] for job_id in lora_ids}
        assert len(hosts) == 1
        assert (await api.job(lora_ids[0]))["host"]["num_jobs"] == 4
        assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 1
        metrics = (await http.get("/metrics")).text
        assert f'icefloe_host_jobs{{host="{hosts.pop()}",model="{model_root / MODEL}"}} 4.0' in metrics
        full = await api.create(TRAINING)  # full weights: a host of its own, so a slot of its own
        assert (await api.wait_status(full, "placing"))["reason"].startswith("waiting for 1 cpu slot(s)")
        for job_id in lora_ids:
            await api.call("POST", f"/{job_id}:cancel")
        for job_id in lora_ids:
            await api.wait_status(job_id, "cancelled", "terminated")
        await api.wait_status(full, "running")  # the last LoRA job left: the host gave its slot back


async def test_a_nan_step_a_cancel_and_a_lease_lapse_of_one_run_leave_the_others_as_they_were(tmp_path, model_root):
    alone_app = make_app(tmp_path / "alone", slots=1, model_root=model_root)
    async with asgi_client(alone_app) as http:
        api = Api(http)
        solo = await api.running(*lora_job(seed=4, rank=RANKS[3]))
        expected = []
        for seed in range(3):
            expected.append((await api.fwd_bwd(solo, seed=seed))["loss"])
            await api.run(solo, "POST", "step", json={})

    app = make_app(tmp_path / "shared", slots=1, model_root=model_root, lease_ttl_s=3.0)
    async with asgi_client(app) as http:
        api = Api(http)
        runs = [await api.create(*lora_job(seed=i + 1, rank=RANKS[i])) for i in range(4)]
        nan_run, cancelled, lapsed, healthy = runs
        alive = set(runs)

        async def keep_alive() -> None:  # each run's client heartbeats until it goes away
            while True:
                for job_id in list(alive):
                    await api.call("POST", f"/{job_id}:heartbeat", check=False)
                await asyncio.sleep(0.3)

        beating = asyncio.create_task(keep_alive())
        try:
            for job_id in runs:
                await api.wait_status(job_id, "running")
            losses = [(await api.fwd_bwd(healthy, seed=0))["loss"]]
            await api.run(healthy, "POST", "step", json={})

            poisoned = canonical_batch([([1, 2, 3], [4, 5, 6]), ([2, 3, 4], [5, 6, 7])], [float("nan"), 1.0])
            accepted = (await api.post_frame(nan_run, "forward-backward", poisoned)).json()
            await api.result(nan_run, accepted["request_id"])
            skipped = await api.run(nan_run, "POST", "step", json={})
            assert skipped["global_step"] == 1 and skipped["grad_norm"] is None  # NaN (null in JSON): not applied
            await api.call("POST", f"/{cancelled}:cancel")
            await api.wait_status(cancelled, "cancelled", "terminated")
            alive.discard(lapsed)  # its client went away; the stored record is read without renewing its lease
            while (row := app.state.jobs.row(lapsed))["status"] not in ("cancelled", "terminated"):
                await asyncio.sleep(0.1)
            assert row["reason"] == "client lease expired"

            for seed in (1, 2):
                losses.append((await api.fwd_bwd(healthy, seed=seed))["loss"])
                await api.run(healthy, "POST", "step", json={})
            assert (await api.job(nan_run))["status"] == "running"
            assert (await api.fwd_bwd(nan_run, seed=0))["loss"] == (await api.fwd_bwd(nan_run, seed=0))["loss"]
        finally:
            beating.cancel()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), atol=1e-5, rtol=0)


async def test_a_killed_host_fails_every_job_on_it_naming_the_crash_and_where_each_can_resume(tmp_path, model_root):
    app = make_app(tmp_path, slots=1, model_root=model_root)
    async with asgi_client(app) as http:
        api = Api(http)
        job_ids = [await api.running(*lora_job(seed=i)) for i in range(3)]
        await api.fwd_bwd(job_ids[0])
        await api.run(job_ids[0], "POST", "step", json={})
        await api.run(job_ids[0], "POST", "save", json={"checkpoint_type": "resumable"})
        engines = app.state.jobs.live(job_ids[0]).engines
        long = {"prompts": [[1, 11, 2]] * 64, "sampling_params": {"max_tokens": 60, "seed": 7}}
        running = (await api.post_frame(job_ids[1], "generate", long)).json()["request_id"]
        while (await api.poll(job_ids[1], running, wait=0))["status"] not in ("running", "streaming"):
            await asyncio.sleep(0.01)
        os.kill(engines.pid, signal.SIGKILL)  # fault: the OOM killer takes the shared engine process
        jobs = [await api.wait_status(job_id, "failed", timeout_s=30) for job_id in job_ids]
        error = (await api.poll(job_ids[1], running))["error"]  # it was running: its engines died under it
        assert f"the engine process {engines.pid} was killed by signal 9" in error and "before" not in error, error
        for job in jobs:
            assert f"the engine process {engines.pid} was killed by signal 9" in job["reason"]
        assert jobs[0]["reason"].endswith("resume from checkpoint global_step1")
        assert all(job["reason"].endswith("no checkpoint was saved") for job in jobs[1:])
        assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 0
        again = await api.running(*lora_job(seed=0))  # a new host starts for the next LoRA job
        assert (await api.fwd_bwd(again))["num_tokens"] > 0


async def test_a_job_that_stops_while_starting_a_shared_host_leaves_it_to_the_next(tmp_path, model_root, monkeypatch):
    """The host of a cancelled starter was marked dead, and every job waiting for it failed."""
    from icefloe.service.hosts.process import ProcessEngineHost
    from icefloe.service.hosts.seam import stop_check

    entered, release = threading.Event(), threading.Event()
    original = ProcessEngineHost.start

    def held_start(self, on_progress, stop):  # fault: a slow start (a big model), during which its job is cancelled
        entered.set()
        release.wait(30)
        stop_check(stop)
        return original(self, on_progress, stop)

    monkeypatch.setattr(ProcessEngineHost, "start", held_start)
    app = make_app(tmp_path, slots=1, model_root=model_root)
    async with asgi_client(app) as http:
        api = Api(http)
        starter = await api.create(*lora_job(seed=1))
        assert await asyncio.to_thread(entered.wait, 30)
        waiting = await api.create(*lora_job(seed=2))
        assert (await api.wait_status(waiting, "placing"))["reason"].endswith("to start")
        await api.call("POST", f"/{starter}:cancel")
        release.set()  # the start goes on, sees its job stopped, and gives up
        await api.wait_status(starter, "cancelled", "terminated")
        job = await api.wait_status(waiting, "running", timeout_s=300)
        assert job["host"]["num_jobs"] == 1 and (await api.fwd_bwd(waiting))["num_tokens"] > 0


def _passes_of_24(seed: int) -> list[dict]:
    """A LoRA trainer on tiny:arith whose passes hold 24 positions (a call of eight rows takes several)."""
    training = {"optimizer": {"name": "AdamW", "lr": 2e-2}, "max_seq_len": 64, "mb_spec": {"max_tokens_per_mb": 24},
                "peft_config": {"peft_type": "Lora", "r": 4, "lora_alpha": 8}}  # fmt: skip
    return [{"job_type": "training", "model_name": "tiny:arith", "seed": seed, "training_config": training}]


def _rows(seed: int, num_rows: int, **config) -> dict:
    generator = torch.Generator().manual_seed(seed)
    rows = [([1, *torch.randint(1, 15, (3,), generator=generator).tolist()],
             torch.randint(1, 15, (4,), generator=generator).tolist()) for _ in range(num_rows)]  # fmt: skip
    batch = canonical_batch(rows, torch.randn(num_rows, generator=generator).tolist())
    batch["processing"] = {"loss_fn": REFUSING_LOSS, "config": config}
    return batch


async def test_a_fwd_bwd_failing_part_way_in_shared_passes_leaves_each_run_the_gradient_of_its_successes(
    tmp_path, monkeypatch
):
    """Two runs' forward-backwards shared passes and B's failed in its third: the service ran the batch again
    call by call, so A's gradient held A's call twice (the shared passes' part, then all of it) and B's held
    B's passes before the failure. Each run's step must see exactly its calls that succeeded."""
    register_refusing_loss(monkeypatch)
    release, holding = threading.Event(), threading.Event()

    def held_save(run, sub_job_id, *args):  # occupies the host's one worker while both calls queue
        holding.set()
        release.wait(30)
        return run()

    wrap_engine_method(monkeypatch, "save_checkpoint", held_save)
    async with asgi_client(make_app(tmp_path, slots=1, engines="local")) as http:
        api = Api(http)
        run_a, run_b, alone_a, alone_b = [await api.running(*_passes_of_24(seed=3)) for _ in range(4)]
        assert len({(await api.job(job_id))["host"]["host_id"] for job_id in (run_a, run_b)}) == 1

        async def fwd_bwd(job_id: str, batch: dict) -> dict:
            accepted = (await api.post_frame(job_id, "forward-backward", batch)).json()
            return await api.poll(job_id, accepted["request_id"])

        for job_id, batch in (
            (run_a, _rows(1, 4)),
            (run_b, _rows(2, 4)),
            (alone_a, _rows(1, 4)),
            (alone_b, _rows(2, 4)),
        ):
            assert (await fwd_bwd(job_id, batch))["status"] == "done"
        saving = (await api.call("POST", f"/{run_a}/save", json={"checkpoint_type": "weights-only"})).json()
        assert await asyncio.to_thread(holding.wait, 30)
        queued = [(await api.post_frame(job_id, "forward-backward", batch)).json()["request_id"]
                  for job_id, batch in ((run_a, _rows(3, 8)), (run_b, _rows(4, 8, refuse_at_pass=3)))]  # fmt: skip
        release.set()
        await api.result(run_a, saving["request_id"])
        assert (await api.poll(run_a, queued[0]))["status"] == "done"
        failed = await api.poll(run_b, queued[1])
        assert failed["status"] == "failed" and "refuses pass 3" in failed["error"]
        assert (await fwd_bwd(alone_a, _rows(3, 8)))["status"] == "done"

        norms = {}
        for job_id in (run_a, run_b, alone_a, alone_b):
            norms[job_id] = (await api.run(job_id, "POST", "step", json={}))["grad_norm"]
    assert norms[run_a] == pytest.approx(norms[alone_a], abs=1e-5)
    assert norms[run_b] == pytest.approx(norms[alone_b], abs=1e-5)
