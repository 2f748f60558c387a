"""The Ray backend end to end on a local 2-CPU Ray: data parallelism, weight sync, placement, failures, re-attach.

One Ray session (``ray_session`` in conftest) serves the module. ``dp_client`` (2 training ranks
+ 1 sampler, a quarter CPU each) serves the training and sync tests, ``fsdp_client`` the same
sharded with FSDP2; ``colocated_client`` (1 + 1 sharing one bundle) serves the placement test and,
last, the failure tests that kill its actors.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
import transformers  # noqa: F401 (the dev extra installs it: fail, never skip)
from safetensors.torch import load_file

from icefloe.client import AsyncClient, Client
from icefloe.client.batch import build_batch
from icefloe.config import ClientConfig
from icefloe.engines.training import TrainingEngine
from icefloe.protocol import JobFailedError

pytestmark = pytest.mark.integration

LR = 1e-3  # large enough that a wrong gradient shows in the weights, small enough for Adam's sign-like first step


def make_batch(num_rows: int = 5, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    prompts = [[1 + (i % 5), 2, 3][: 2 + i % 2] for i in range(num_rows)]
    responses = [[int(t) for t in torch.randint(3, 18, (2 + i % 4,), generator=generator)] for i in range(num_rows)]
    advantages = [float(a) for a in torch.randn(num_rows, generator=generator)]
    return build_batch(prompts, responses, advantages, pad_id=0)


def ray_config(model_dir: Path, checkpoints: Path, **backend) -> ClientConfig:
    return ClientConfig.build(
        model=str(model_dir),
        max_seq_len=48,
        training={"optimizer": {"lr": LR}, "checkpoint_dir": str(checkpoints)},
        num_training_workers=backend.pop("num_training_workers", 1),
        backend={"type": "ray", "namespace": "icefloe-tests", **backend},
    )


@pytest.fixture(scope="module")
def dp_client(ray_session, model_dir, tmp_path_factory):
    config = ray_config(model_dir, tmp_path_factory.mktemp("ckpt"), num_training_workers=2, num_cpus_per_worker=0.25)
    client = Client(config).open()
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def fsdp_client(ray_session, model_dir, tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("ckpt")
    config = ray_config(model_dir, checkpoints, num_training_workers=2, num_cpus_per_worker=0.25, fsdp=True)
    client = Client(config).open()
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def colocated_client(ray_session, model_dir, tmp_path_factory):
    config = ray_config(model_dir, tmp_path_factory.mktemp("ckpt"), colocate=True, num_cpus_per_worker=0.25)
    client = Client(config).open()
    yield client
    client.shutdown()


def on_actors(client: Client, role: str, fn) -> list:
    """``fn(actor)`` run inside each actor of ``role``, found by the names in the client's handle."""
    info = client.handle()["transport"]
    actors = [ray.get_actor(name, namespace=info["namespace"]) for name in info["actors"][role]]
    return ray.get([actor.__ray_call__.remote(fn) for actor in actors])


def test_fwd_bwd_dp2_equals_dp1_loss_metrics_and_weights(dp_client, model_dir, tmp_path):
    torch.set_num_threads(1)
    single = TrainingEngine(dp_client.config, model_dir=model_dir)
    expected = single.fwd_bwd(make_batch())
    expected_step = single.step()

    result = dp_client.fwd_bwd(make_batch())
    step = dp_client.step()

    assert result["num_tokens"] == expected["num_tokens"]
    assert result["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    for name in ("entropy", "approx_kl", "clip_ratio"):
        assert result["metrics"][name] == pytest.approx(expected["metrics"][name], abs=1e-5)
    assert step["grad_norm"] == pytest.approx(expected_step["grad_norm"], rel=1e-5)
    weights = on_actors(dp_client, "training", lambda actor: dict(actor.engine.named_weights()))
    for name, tensor in weights[0].items():  # both ranks hold identical weights
        assert torch.equal(weights[1][name], tensor), name
    saved = dp_client.save_checkpoint("weights-only")
    weights = load_file(str(Path(saved["path"]) / "model.safetensors"))
    for name, tensor in single.named_weights():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0)


@pytest.mark.slow  # ~9 s for its own actors; FSDP's math runs in make test (test_distributed.py)
def test_fsdp_dp2_trains_like_one_engine_and_syncs_full_weights(fsdp_client, model_dir):
    torch.set_num_threads(1)
    single = TrainingEngine(fsdp_client.config, model_dir=model_dir)
    expected = single.fwd_bwd(make_batch())
    expected_step = single.step()

    result = fsdp_client.fwd_bwd(make_batch())
    step = fsdp_client.step()
    assert result["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert step["grad_norm"] == pytest.approx(expected_step["grad_norm"], rel=1e-5)
    assert fsdp_client.sync_weights()["policy_version"] == 1

    sample = fsdp_client.generate([[1, 2, 3]], {"max_tokens": 5, "logprobs": True, "seed": 2})[0]
    batch = build_batch([[1, 2, 3]], [sample["token_ids"]], [0.0], pad_id=0)
    expected_logprobs = single.forward(batch)["logprobs"][0][batch["context"]["loss_mask"][0].bool()]
    torch.testing.assert_close(torch.tensor(sample["logprobs"]), expected_logprobs, atol=1e-4, rtol=0)
    saved = fsdp_client.save_checkpoint("weights-only")
    weights = load_file(str(Path(saved["path"]) / "model.safetensors"))
    for name, tensor in single.named_weights():
        torch.testing.assert_close(weights[name], tensor, atol=1e-5, rtol=0)
    resumable = fsdp_client.save_checkpoint("resumable")  # replaces the weights-only folder of step 1

    def sample_logprobs() -> torch.Tensor:
        fsdp_client.sync_weights()
        again = fsdp_client.generate([[1, 2, 3]], {"max_tokens": 5, "logprobs": True, "seed": 2})[0]
        assert again["token_ids"] == sample["token_ids"]
        return torch.tensor(again["logprobs"])

    fsdp_client.fwd_bwd(make_batch(seed=9))
    second = fsdp_client.step()  # the weights move on ...
    step2_weights = load_file(str(Path(fsdp_client.save_checkpoint("weights-only")["path"]) / "model.safetensors"))
    assert fsdp_client.load_checkpoint(resumable["checkpoint_id"])["global_step"] == 1  # ... and come back
    torch.testing.assert_close(sample_logprobs(), expected_logprobs, atol=1e-4, rtol=0)

    fsdp_client.fwd_bwd(make_batch(seed=9))  # the restored AdamW moments reproduce step 2 exactly
    replayed = fsdp_client.step()
    assert replayed["global_step"] == 2
    assert replayed["grad_norm"] == pytest.approx(second["grad_norm"], rel=1e-6)
    replayed_weights = load_file(str(Path(fsdp_client.save_checkpoint("weights-only")["path"]) / "model.safetensors"))
    for name, tensor in step2_weights.items():
        torch.testing.assert_close(replayed_weights[name], tensor, atol=1e-6, rtol=0)


def test_sync_weights_sampler_logprobs_equal_trainer_logprobs(dp_client):
    dp_client.fwd_bwd(make_batch(seed=3))
    stepped = dp_client.step()
    synced = dp_client.sync_weights()
    assert synced["policy_version"] == stepped["global_step"]
    assert synced["bytes"] > 0

    prompt = [1, 2, 3]
    sample = dp_client.generate([prompt], {"max_tokens": 6, "logprobs": True, "seed": 5})[0]
    assert sample["policy_version"] == stepped["global_step"]
    batch = build_batch([prompt], [sample["token_ids"]], [0.0], pad_id=0)
    trainer = dp_client.forward(batch)["logprobs"][0]
    mask = batch["context"]["loss_mask"][0].bool()
    torch.testing.assert_close(trainer[mask], torch.tensor(sample["logprobs"]), atol=1e-4, rtol=0)


def test_async_generate_does_not_block_the_event_loop(dp_client):
    async def run() -> tuple[int, int]:
        client = await AsyncClient.from_handle(dp_client.handle()).open()  # attach first: only generate awaits
        in_flight = 0
        ticks_while_sampling = 0

        async def tick() -> None:
            nonlocal ticks_while_sampling
            while True:
                ticks_while_sampling += in_flight > 0
                await asyncio.sleep(0.001)

        async def sample() -> list:
            nonlocal in_flight
            in_flight += 1
            try:
                return await client.generate([[1, 2]], {"max_tokens": 4})
            finally:
                in_flight -= 1

        ticker = asyncio.create_task(tick())
        samples = await asyncio.gather(*[sample() for _ in range(3)])
        ticker.cancel()
        await client.shutdown()
        return ticks_while_sampling, len(samples)

    ticks_while_sampling, answered = asyncio.run(run())
    assert answered == 3
    assert ticks_while_sampling > 0  # a blocking call would never let the ticker run while one is in flight


def test_handle_reattaches_from_another_process(dp_client, tmp_path):
    handle = dp_client.handle()
    expected = dp_client.forward(make_batch(seed=4))["logprobs"]
    assert set(handle["transport"]) >= {"job_name", "namespace", "address", "actors"}
    script = (
        "import json, sys, torch\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from icefloe.client import Client\n"
        "from test_ray_transport import make_batch\n"
        "client = Client.from_handle(json.loads(open(sys.argv[1]).read()))\n"
        "logprobs = client.forward(make_batch(seed=4))['logprobs']\n"
        "torch.save(logprobs, sys.argv[3])\n"
        "client.shutdown()\n"
    )
    (tmp_path / "handle.json").write_text(json.dumps(handle))
    out = tmp_path / "logprobs.pt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "handle.json"), str(Path(__file__).parent), str(out)],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(torch.load(out, weights_only=True), expected)
    assert dp_client.forward(make_batch(seed=4))["logprobs"].shape == expected.shape  # the owner still works


def test_colocated_workers_share_one_bundle_with_fractional_cpus(colocated_client):
    def placement(actor) -> dict:
        context = ray.get_runtime_context()
        return {"group": context.get_placement_group_id(), "resources": context.get_assigned_resources()}

    placements = [p for role in ("training", "sampling") for p in on_actors(colocated_client, role, placement)]
    assert len(placements) == 2
    assert placements[0]["group"] == placements[1]["group"] is not None  # both in the job's one placement group
    table = ray.util.placement_group_table()[placements[0]["group"]]
    assert list(table["bundles"].values()) == [{"CPU": 0.5}]  # ... of one bundle, each holding a quarter CPU
    assert [p["resources"] for p in placements] == [{"CPU": pytest.approx(0.25)}] * 2
    assert colocated_client.generate([[1, 2]], {"max_tokens": 2})[0]["token_ids"]


def kill_actor(name: str, namespace: str = "icefloe-tests") -> None:
    """``ray.kill`` the named actor and return once it is dead: the kill goes through Ray's control
    store while a call goes straight to the actor, so a call made right after it may still be answered."""
    actor = ray.get_actor(name, namespace=namespace)
    ray.kill(actor)
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return
        assert time.monotonic() < deadline, f"actor {name} still answers after ray.kill"
        time.sleep(0.05)


def test_killed_sampler_surfaces_as_job_failed_error(colocated_client):
    sampler = colocated_client.handle()["transport"]["actors"]["sampling"][0]
    kill_actor(sampler)
    with pytest.raises(JobFailedError) as raised:
        colocated_client.generate([[1, 2]], {"max_tokens": 2})
    assert sampler in str(raised.value)
    assert raised.value.sub_jobs == {sampler: "dead"}
    assert isinstance(raised.value.__cause__, ray.exceptions.RayActorError)
    with pytest.raises(JobFailedError, match=sampler):
        colocated_client.sync_weights()  # the trainer's broadcast breaks too; the error names the dead sampler


def test_killed_trainer_mid_run_surfaces_as_job_failed_error(colocated_client):
    trainer = colocated_client.handle()["transport"]["actors"]["training"][0]
    colocated_client.fwd_bwd(make_batch())
    kill_actor(trainer)
    with pytest.raises(JobFailedError, match=trainer):
        colocated_client.step()


def gpu_config(model_dir: Path, checkpoints: Path, engine: str) -> ClientConfig:
    """Trainer and sampler sharing one GPU; a sliver of CPU each, since the CPU fixtures hold the rest."""
    config = ray_config(
        model_dir, checkpoints, colocate=True, num_gpus_per_worker=0.5, num_cpus_per_worker=0.01
    ).model_dump()
    config["sampling"] = {
        "engine": engine,
        "engine_kwargs": {"gpu_memory_utilization": 0.3} if engine == "vllm" else {},
    }
    return ClientConfig.build(config, job_ready_timeout_s=120)


def check_sampler_matches_trainer(client: Client, atol: float) -> None:
    sample = client.generate([[1, 2, 3]], {"max_tokens": 4, "logprobs": True})[0]
    batch = build_batch([[1, 2, 3]], [sample["token_ids"]], [0.0], pad_id=0)
    trainer = client.forward(batch)["logprobs"][0][batch["context"]["loss_mask"][0].bool()]
    torch.testing.assert_close(torch.tensor(sample["logprobs"]), trainer.cpu(), atol=atol, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL broadcast, CUDA IPC)")
@pytest.mark.parametrize("cuda_ipc", [False, True], ids=["nccl", "cuda-ipc"])
def test_gpu_weight_sync_nccl_and_cuda_ipc(ray_session, model_dir, tmp_path, cuda_ipc):
    with Client(gpu_config(model_dir, tmp_path, "torch")) as client:
        client.fwd_bwd(make_batch())
        client.step()
        assert client.sync_weights(cuda_ipc=cuda_ipc)["policy_version"] == 1
        check_sampler_matches_trainer(client, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (vLLM)")
def test_gpu_vllm_sampler_receives_synced_weights(ray_session, model_dir, tmp_path):
    pytest.importorskip("vllm")
    with Client(gpu_config(model_dir, tmp_path, "vllm")) as client:
        client.fwd_bwd(make_batch())
        client.step()
        assert client.sync_weights()["policy_version"] == 1
        check_sampler_matches_trainer(client, atol=2e-2)


def test_bad_requests_sft_and_checkpoint_listings_match_the_local_backend(dp_client, model_dir, tmp_path):
    """Last in the module: it trains ``dp_client`` on. Its SFT batch is split over the two ranks."""
    from tests.client.remote.test_remote_parity import BAD_CALLS, cross_entropy_frame, errors_loss_and_listing

    local = ClientConfig.build(model=str(model_dir), max_seq_len=48, training={"checkpoint_dir": str(tmp_path)})
    with Client(local) as client:
        local_errors, _, local_listed = errors_loss_and_listing(client)
    same_weights_loss = dp_client.fwd_bwd(cross_entropy_frame())["loss"]
    ray_errors, ray_loss, ray_listed = errors_loss_and_listing(dp_client)
    assert ray_errors == local_errors and set(ray_errors) == set(BAD_CALLS)
    assert ray_loss == pytest.approx(same_weights_loss, abs=1e-6)
    types = {tuple(sorted((k, type(v)) for k, v in c.items())) for c in ray_listed + local_listed}
    assert len(types) == 1  # every field of every listed checkpoint has one type on both backends


@pytest.mark.slow  # a Python with Ray and torch, and a Ray start of its own: ~10 s
def test_a_failed_open_shuts_down_the_local_ray_it_started():
    """The model is resolved after ray.init; its error left this process's Ray running (close() had no host)."""
    script = (
        "import ray\n"
        "from icefloe.client import Client\n"
        "from icefloe.protocol import ConfigError\n"
        "client = Client({'model': '/no/such/model', 'backend': {'type': 'ray', 'num_cpus_per_worker': 0.25}})\n"
        "try:\n"
        "    client.open()\n"
        "except ConfigError as exc:\n"
        "    print('open failed:', exc)\n"
        "print('ray running:', ray.is_initialized())\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}  # a Ray of its own
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "open failed: model must be" in done.stdout and "ray running: False" in done.stdout, done.stdout
