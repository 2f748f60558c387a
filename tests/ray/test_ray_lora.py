"""LoRA on Ray: the broadcast moves only adapters and the sampler then scores like the trainer,
through the Ray transport and through ``icefloe serve --engines ray``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import peft  # noqa: F401 (the dev extra installs it: fail, never skip)
import pytest
import ray  # noqa: F401 (the dev extra installs it: fail, never skip)
import torch

from icefloe.client import Client
from icefloe.client.batch import build_batch
from icefloe.config import LoraConfig
from icefloe.engines.training import TrainingEngine
from icefloe.protocol import InvalidRequestError
from icefloe.service.app import ServerThread, create_app
from icefloe.service.hosts.slots import SlotPool
from icefloe.service.settings import ServeSettings

from ..service.service_client import Api

pytestmark = pytest.mark.integration

LORA = {"rank": 4, "alpha": 8}
BATCH = build_batch([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [1.0, -1.0], pad_id=0)


def _train_sync_and_compare(client: Client) -> dict:
    base = client.forward(BATCH)["logprobs"]  # fresh adapters are a no-op
    for _ in range(2):
        client.fwd_bwd(BATCH)
        client.step()
    synced = client.sync_weights()
    prompt = [1, 2, 3]
    sample = client.generate([prompt], {"max_tokens": 6, "logprobs": True, "seed": 5})[0]
    assert sample["policy_version"] == 2
    scored = build_batch([prompt], [sample["token_ids"]], [0.0], pad_id=0)
    trainer = client.forward(scored)["logprobs"][0]
    mask = scored["context"]["loss_mask"][0].bool()
    torch.testing.assert_close(trainer[mask], torch.tensor(sample["logprobs"]), atol=1e-5, rtol=0)
    # the reference policy is the base model: the trainers with their adapters disabled
    torch.testing.assert_close(client.forward(BATCH, reference=True)["logprobs"], base, atol=1e-6, rtol=0)
    return synced


@pytest.mark.slow  # ~11 s for its own actors; adapter-only syncs run in make test on the other backends
def test_ray_transport_syncs_only_adapters(ray_session, model_dir, tmp_path):
    config = {
        "model": str(model_dir),
        "max_seq_len": 48,
        "lora": LORA,
        "num_training_workers": 2,
        "num_log_prob_workers": 1,  # with LoRA the trainers score the reference: no reference actor starts
        "training": {"optimizer": {"lr": 2e-2}, "checkpoint_dir": str(tmp_path)},
        "backend": {"type": "ray", "namespace": "icefloe-tests", "num_cpus_per_worker": 0.25},
    }
    with Client(config) as client:
        with pytest.raises(InvalidRequestError, match="moves full weights"):
            client.sync_weights(weight_format="vllm")
        synced = _train_sync_and_compare(client)
        assert client.handle()["transport"]["actors"]["reference"] == []
        policy = client.forward(BATCH)["logprobs"]
        saved = client.save_checkpoint("weights-only")
        local = TrainingEngine(client.config, model_dir=model_dir)
    assert synced["bytes"] == sum(t.numel() * t.element_size() for _, t in local.named_weights())
    local.load_checkpoint(saved["path"])  # the ranks' adapters, as one PEFT folder
    torch.testing.assert_close(local.forward(BATCH)["logprobs"], policy, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_serve_with_ray_engines_starts_a_lora_sampler_from_an_adapter_checkpoint(ray_session, model_dir, tmp_path):
    """--engines ray once started a sampler from the checkpoint folder itself, which holds no base model."""
    settings = ServeSettings(data_dir=tmp_path / "serve", engines="ray", model_root=model_dir.parent)
    app = create_app(settings, pool=SlotPool("cpu", 2))
    greedy = {"max_tokens": 6, "temperature": 0.0, "logprobs": True}
    with ServerThread(app) as base_url:
        config = _remote_lora_config(model_dir, base_url)
        with Client(config) as client:
            for _ in range(2):
                client.fwd_bwd(BATCH)
                client.step()
            client.sync_weights()
            synced = client.generate([[1, 2, 3]], greedy)[0]
            saved = client.save_checkpoint("weights-only")
            job_id = client.handle()["transport"]["job_id"]
        # The first job has ended (its slots are free); the checkpoint outlives it.
        served = asyncio.run(_sample_from_checkpoint(base_url, model_dir, job_id, saved["checkpoint_id"], greedy))
    assert served["token_ids"] == synced["token_ids"] and served["policy_version"] == 0
    torch.testing.assert_close(torch.tensor(served["logprobs"]), torch.tensor(synced["logprobs"]), atol=1e-5, rtol=0)


def _remote_lora_config(model_dir: Path, base_url: str) -> dict:
    return {
        "model": str(model_dir),
        "max_seq_len": 48,
        "lora": LORA,
        "training": {"optimizer": {"lr": 2e-2}},
        "backend": {"type": "remote", "base_url": base_url},
    }


async def _sample_from_checkpoint(base_url: str, model_dir: Path, job_id: str, checkpoint_id: str, params: dict):
    """A sampling-only job started from a weights-only LoRA checkpoint; its sample of ``[1, 2, 3]``."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        api = Api(http)
        sampler = {
            "job_type": "sampling",
            "model_name": model_dir.name,
            "inference_config": {"max_seq_len": 48, "peft_config": LoraConfig(**LORA).to_peft_config()},
            "source_checkpoint_info": {"checkpoint_id": checkpoint_id, "source_job_id": job_id},
        }
        served = await api.create(sampler)
        await api.wait_status(served, "running", timeout_s=240)
        body = {"prompts": [[1, 2, 3]], "sampling_params": params}
        accepted = (await api.post_frame(served, "generate", body)).json()
        return (await api.result(served, accepted["request_id"]))["results"][0]


@pytest.mark.slow  # ~10 s: a service, its Ray actors and a whole train-sync-sample round
def test_serve_with_ray_engines_syncs_lora_adapters(ray_session, model_dir, tmp_path):
    settings = ServeSettings(data_dir=tmp_path / "serve", engines="ray", model_root=model_dir.parent)
    app = create_app(settings, pool=SlotPool("cpu", 2))
    with ServerThread(app) as base_url:
        config = _remote_lora_config(model_dir, base_url)
        with Client(config) as client:
            with pytest.raises(InvalidRequestError, match="moves full weights"):
                client.sync_weights(weight_format="hf")
            synced = _train_sync_and_compare(client)  # no log_probability sub-job: the trainer scores it
        adapters = TrainingEngine(client.config, model_dir=model_dir).named_weights()
    assert synced["bytes"] == sum(t.numel() * t.element_size() for _, t in adapters)
