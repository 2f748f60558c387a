"""One gathering: samples of both APIs, of a LoRA run and of the base model, queued together on one
model host, decode as one batch."""

from __future__ import annotations

import asyncio
import threading

import pytest
from typer.testing import CliRunner

from icefloe.cli import app
from icefloe.engines.sampling import SamplingEngine
from icefloe.service.hosts.seam import LocalEngineHost

from .service_client import Api
from .service_harness import make_app, uvicorn_client

pytestmark = pytest.mark.anyio

API_KEY = "tml-icefloe-gathering"
PEFT = {"peft_type": "Lora", "r": 4, "lora_alpha": 8}


@pytest.fixture
def model(tmp_path) -> str:
    folder = str(tmp_path / "models" / "tiny-chat")
    assert CliRunner().invoke(app, ["models", "export", "tiny:chat", folder]).exit_code == 0
    return folder


async def _tinker_sample(http, sampling_session_id: str, seq_id: int) -> str:
    body = {"sampling_session_id": sampling_session_id, "seq_id": seq_id, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
            "sampling_params": {"max_tokens": 3, "stop": [], "seed": seq_id}}  # fmt: skip
    answer = await http.post("/api/v1/asample", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["request_id"]


async def _tinker_outcome(http, future_id: str) -> bytes:
    while True:
        answer = await http.post("/api/v1/retrieve_future", json={"request_id": future_id})
        if answer.headers["content-type"] == "application/x-protobuf":
            return answer.content
        assert answer.json().get("type") == "try_again", answer.text


async def test_a_tinker_sample_and_a_training_api_generate_of_two_runs_decode_as_one_batch(
    tmp_path, model, monkeypatch
):
    """A Tinker sample waited in a gathering window of its own, and the generate batch key held the
    samples' encoding: a Tinker sample never shared a decode with a training-API generate on its host."""
    batches: list[list[str]] = []  # the sub-jobs of each engine batch, in order
    decodes: list[int] = []  # decode calls per engine batch
    hold, held, release = threading.Event(), threading.Event(), threading.Event()
    generate_many, decode = LocalEngineHost.generate_many, SamplingEngine._decode_steps

    def observed_generate_many(self, calls):
        batches.append([sub_job_id for sub_job_id, *_ in calls])
        decodes.append(0)
        if hold.is_set():  # fault: this batch is slow, so the next calls queue up behind it
            hold.clear()
            held.set()
            release.wait(30)
        return generate_many(self, calls)

    def counted_decode(self, rows, pass_s=None):  # one call per decode batch, its steps one next() each
        decodes[-1] += 1
        return decode(self, rows, pass_s)

    monkeypatch.setattr(LocalEngineHost, "generate_many", observed_generate_many)
    monkeypatch.setattr(SamplingEngine, "_decode_steps", counted_decode)
    service_app = make_app(
        tmp_path / "serve", slots=1, engines="local", tokens=[API_KEY], model_root=tmp_path / "models"
    )
    headers = {"Authorization": f"Bearer {API_KEY}", "X-API-Key": API_KEY}
    async with uvicorn_client(service_app, headers=headers) as http:
        api = Api(http)
        lora = {"peft_config": PEFT, "max_seq_len": 64}
        job_id = await api.running(
            {"job_type": "training", "model_name": model, "training_config": {**lora, "optimizer": {"name": "AdamW"}}},
            {"job_type": "sampling", "model_name": model, "inference_config": lora},
        )
        session_id = (await http.post("/api/v1/create_session", json={})).json()["session_id"]
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": model}
        sampler = (await http.post("/api/v1/create_sampling_session", json=body)).json()["sampling_session_id"]
        await _tinker_outcome(http, await _tinker_sample(http, sampler, 1))  # its job runs, on the same host
        generate = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 3, "seed": 1}}

        hold.set()
        blocker = (await api.post_frame(job_id, "generate", generate)).json()["request_id"]
        await asyncio.to_thread(held.wait, 30)
        before = len(batches)
        future_id = await _tinker_sample(http, sampler, 2)
        trained = (await api.post_frame(job_id, "generate", generate)).json()["request_id"]
        release.set()  # both are queued (each POST is answered once its item is in its lane)
        await _tinker_outcome(http, future_id)
        generated = await api.result(job_id, trained)
        await api.result(job_id, blocker)

    assert len(generated["results"]) == 1 and len(generated["results"][0]["token_ids"]) == 3
    sampler_sub_jobs = {sub for batch in batches[:before] for sub in batch}
    assert len(sampler_sub_jobs) == 2  # the training API's sampler and the Tinker base-model sampler
    assert len(batches) == before + 1  # the two queued calls ran as one engine batch ...
    assert sorted(sub.startswith(job_id) for sub in batches[before]) == [False, True]  # ... one of each job
    assert decodes[before] == 1  # ... in one decode call
