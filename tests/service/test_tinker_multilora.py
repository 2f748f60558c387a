"""Sixteen unmodified ``tinker`` SDK clients, each with a LoRA training client of its own, on a server
with one slot: their runs share one engine process and one copy of the base model."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import tinker
from safetensors import safe_open
from tinker import types
from typer.testing import CliRunner

from icefloe.cli import app
from icefloe.service.app import ServerThread
from icefloe.service.settings import SHARED_TENANT
from icefloe.service.tinker.state import CheckpointPath
from tests.service.service_harness import make_app

API_KEY = "tml-icefloe-multilora"
NUM_RUNS = 16
PREFIX = "/api/v2/databases/DB/schemas/SC/cortex-training"


def _one_run(base_url: str, model: str, index: int, all_created: threading.Barrier) -> dict:
    """What one user's RL round does: sample, score, train, step, sync a sampler."""
    with tinker.ServiceClient(base_url=base_url, api_key=API_KEY) as service:
        training = service.create_lora_training_client(base_model=model, rank=8).result()
        all_created.wait(300)  # every run's job is live at once from here on
        tokenizer = training.get_tokenizer()
        sampler = training.save_weights_and_get_sampling_client()
        prompt = tokenizer.encode(f"Q{index}: ")
        params = types.SamplingParams(max_tokens=6, stop=[], seed=index)
        sampled = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=params).result()
        data = []
        for rank, sequence in enumerate(sampled.sequences):
            tokens = prompt + list(sequence.tokens)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * (len(prompt) - 1) + list(sequence.logprobs),
                        "advantages": [0.0] * (len(prompt) - 1) + [1.5 - rank] * len(sequence.tokens),
                    },
                )
            )
        trained = training.forward_backward(data, "importance_sampling").result()
        stepped = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = training.save_weights_and_get_sampling_client()
        again = after.sample(types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params).result()
        return {
            "model_id": training.model_id,
            "loss": trained.metrics["loss:sum"],
            "grad_norm": stepped.metrics["grad_norm:mean"],
            "tokens": len(again.sequences[0].tokens),
        }


@pytest.mark.slow  # sixteen SDK clients, each an RL round: tens of seconds
def test_sixteen_sdk_runs_share_one_slot_and_one_host(tmp_path):
    root = tmp_path / "models"
    model = str(root / "tiny-chat")
    assert CliRunner().invoke(app, ["models", "export", "tiny:chat", model]).exit_code == 0
    service_app = make_app(tmp_path / "serve", slots=1, tokens=[API_KEY], model_root=root)
    seen: list[dict] = []
    with ServerThread(service_app) as base_url:
        headers = {"Authorization": f"Bearer {API_KEY}"}

        def snapshot() -> None:  # run by the last run to arrive, while all sixteen jobs are live
            seen.extend(httpx.get(f"{base_url}{PREFIX}/", headers=headers).json()["jobs"])
            seen.append(httpx.get(f"{base_url}{PREFIX}/capacity", headers=headers).json())

        all_created = threading.Barrier(NUM_RUNS, action=snapshot)
        with ThreadPoolExecutor(NUM_RUNS) as pool:
            runs = list(pool.map(lambda i: _one_run(base_url, model, i, all_created), range(NUM_RUNS)))
    assert len({run["model_id"] for run in runs}) == NUM_RUNS
    assert all(run["tokens"] == 6 and run["grad_norm"] > 0 for run in runs)
    *jobs, capacity = seen
    running = [job for job in jobs if job["status"] == "running"]
    assert len(running) == NUM_RUNS and capacity["in_use_slots"] == 1
    assert {(job["host"]["host_id"], job["host"]["num_jobs"]) for job in running} == {("host-1", NUM_RUNS)}


def test_each_runs_lora_layers_are_honoured_and_travel_with_its_weights(tmp_path):
    """train_mlp=False was refused; train_unembed (the SDK's default) trained nothing on the output layer."""
    root = tmp_path / "models"
    model = str(root / "tiny-chat")
    assert CliRunner().invoke(app, ["models", "export", "tiny:chat", model]).exit_code == 0
    service_app = make_app(tmp_path / "serve", slots=1, engines="local", tokens=[API_KEY], model_root=root)
    with ServerThread(service_app) as base_url, tinker.ServiceClient(base_url=base_url, api_key=API_KEY) as service:
        narrow = service.create_lora_training_client(base_model=model, rank=4, train_mlp=False).result()
        default = service.create_lora_training_client(base_model=model, rank=4).result()
        saved = {}
        for name, training in (("narrow", narrow), ("default", default)):
            path = training.save_weights_for_sampler(name).result().path
            record = service_app.state.tinker.checkpoint_record(CheckpointPath.parse(path), SHARED_TENANT)
            folder = Path(record["path"])
            with safe_open(str(folder / "adapter_model.safetensors"), "pt") as tensors:
                saved[name] = list(tensors.keys())
            sampler = service.create_sampling_client(model_path=path).result()  # a sampler of its own, same layers
            prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("hi"))
            assert len(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=3, stop=[])).result().sequences) == 1
    assert not any(".mlp." in key for key in saved["narrow"]) and any(".self_attn." in key for key in saved["narrow"])
    assert any("lm_head" in key for key in saved["default"]) and any(".mlp." in key for key in saved["default"])
