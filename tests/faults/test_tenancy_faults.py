"""Tenancy of a real ``icefloe serve`` process probed as a hostile tenant would: a request naming another
tenant's job or checkpoint, a job id chosen to collide with another tenant's, placing reasons and host
counts read for what others run, a data dir the model root can reach, and answers read for the server's
folders. Each answer must be the one a job that does not exist would get, and name no server folder."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time

import httpx
import pytest

from ..service.service_batches import small_batch
from .serve_process import PREFIX, TRAINING, Serve, free_port
from .tinker_serve import TOKENS, Tinker, tinker_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

LORA = {
    "job_type": "training",
    "model_name": "tiny-chat",
    "training_config": {"max_seq_len": 64, "peft_config": {"peft_type": "Lora", "r": 4}},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with tinker_serve(tmp_path_factory.mktemp("tenancy-faults")) as serve:
        yield serve


def _api(serve: Serve, tenant: str) -> httpx.Client:
    return httpx.Client(base_url=serve.base_url + PREFIX, headers={"Authorization": f"Bearer {TOKENS[tenant]}"},
                        timeout=60)  # fmt: skip


def _trained(serve: Serve, tenant: str, seed: int) -> str:
    """A running job of ``tenant`` after one step and a save (``global_step1``)."""
    with _api(serve, tenant) as api:
        job_id = api.post("/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]
    serve.wait_job(job_id, "running")
    serve.run(job_id, "forward-backward", small_batch(seed))
    serve.run(job_id, "step", {})
    assert serve.run(job_id, "save", {})["checkpoint_id"] == "global_step1"
    return job_id


def _weights_sha256(serve: Serve, job_id: str, checkpoint_id: str) -> str:
    """The sha256 of the checkpoint's model.safetensors, downloaded through its export link."""
    exported = serve.call("POST", f"/{job_id}/checkpoints/{checkpoint_id}:export")
    (link,) = [f["url"] for f in exported["files"] if f["filename"] == "model.safetensors"]
    return hashlib.sha256(httpx.get(link, timeout=60).content).hexdigest()


def _same_404(answer: httpx.Response, unknown: httpx.Response, named: str, instead: str) -> None:
    """``answer`` is exactly ``unknown``'s 404, with the id the caller named in place of the unknown one."""
    assert unknown.status_code == 404, unknown.text
    assert answer.status_code == 404, answer.text
    assert answer.json() == {**unknown.json(), "message": unknown.json()["message"].replace(instead, named)}


def test_h1_a_load_naming_another_tenants_job_is_an_unknown_job_and_leaves_the_weights(served):
    """Alice's load with Bob's source_job_id answered 200, ended done and gave Alice Bob's exact weights
    (same sha256 at her next export); a wrong checkpoint id answered a 404 that confirmed Bob's job existed."""
    bob, alice = _trained(served, "bob", seed=1), _trained(served, "alice", seed=2)
    before = _weights_sha256(served, alice, "global_step1")
    assert before != _weights_sha256(served, bob, "global_step1")
    with _api(served, "alice") as api:

        def load(checkpoint_id: str, source_job_id: str) -> httpx.Response:
            return api.post(f"/{alice}/load", json={"checkpoint_id": checkpoint_id, "source_job_id": source_job_id})

        unknown = load("global_step1", "no-such-job")
        _same_404(load("global_step1", bob), unknown, bob, "no-such-job")
        _same_404(load("no-such-checkpoint", bob), load("no-such-checkpoint", "no-such-job"), bob, "no-such-job")
        # A create-time source is answered alike: Bob's job named, or Bob's checkpoint id alone.
        served.run(bob, "save", {})  # global_step1-2: a checkpoint id only Bob's job has
        source = {"checkpoint_id": "global_step1", "source_job_id": bob}
        created = api.post("/", json={"sub_job_configs": [{**TRAINING, "source_checkpoint_info": source}]})
        unknown = api.post("/", json={"sub_job_configs": [{**TRAINING, "source_checkpoint_info": {
            "checkpoint_id": "global_step1", "source_job_id": "no-such-job"}}]})  # fmt: skip
        _same_404(created, unknown, bob, "no-such-job")
        only_bobs = api.post("/", json={"sub_job_configs": [{**TRAINING, "source_checkpoint_info": {
            "checkpoint_id": "global_step1-2"}}]})  # fmt: skip
        nobodys = api.post("/", json={"sub_job_configs": [{**TRAINING, "source_checkpoint_info": {
            "checkpoint_id": "no-such-checkpoint"}}]})  # fmt: skip
        _same_404(only_bobs, nobodys, "global_step1-2", "no-such-checkpoint")
    served.run(alice, "save", {})
    assert _weights_sha256(served, alice, "global_step1-2") == before  # Alice's weights are her own still
    for job_id in (alice, bob):
        served.call("POST", f"/{job_id}:cancel")


def test_l2_job_ids_placing_reasons_and_host_counts_tell_nothing_of_another_tenants_jobs(tmp_path):
    """Creating a job with another tenant's job id answered 409 "already exists"; a waiting job's reason
    counted other tenants' jobs ahead of it, and a shared host's record counted their jobs on it."""
    with tinker_serve(tmp_path, "--slots", "1") as serve, _api(serve, "alice") as alice, _api(serve, "bob") as bob:
        bobs_lora = bob.post("/", json={"sub_job_configs": [LORA]}).json()["job_id"]
        serve.wait_job(bobs_lora, "running")  # a shared host of tiny-chat, on the one slot
        alices_lora = alice.post("/", json={"sub_job_configs": [LORA]}).json()["job_id"]
        host = serve.wait_job(alices_lora, "running")["host"]
        assert host["shared"] and host["num_jobs"] == 1  # Alice's, not Bob's beside it
        ui = httpx.get(f"{serve.base_url}/ui/api/jobs", headers={"Authorization": f"Bearer {TOKENS['alice']}"})
        assert [row["host"] for row in ui.json()["jobs"]] == [f"{host['host_id']} (1/32)"]

        # Job ids: Bob's choice and Alice's of the same name are two jobs; "already exists" is Alice's own.
        body = {"sub_job_configs": [TRAINING], "job_id": "nightly"}
        bobs = bob.post("/", json=body)
        assert bobs.status_code == 200, bobs.text
        queued_behind = bob.post("/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]
        serve.wait_job(queued_behind, "placing")
        alices = alice.post("/", json=body)
        assert alices.status_code == 200, alices.text
        assert alices.json()["job_id"] != bobs.json()["job_id"]
        again = alice.post("/", json=body)
        assert again.status_code == 409 and again.json()["message"] == (
            f"job {alices.json()['job_id']} already exists; omit job_id to get a fresh one"
        )
        named = alice.post("/", json={**body, "job_id": bobs.json()["job_id"]})
        other = alice.post("/", json={**body, "job_id": "nightly@nobody"})
        assert named.status_code == other.status_code == 400
        assert named.json()["message"] == other.json()["message"].replace("nightly@nobody", bobs.json()["job_id"])

        # Alice's job waits behind Bob's two: its reason says the slots, not how many of Bob's jobs wait.
        waiting = serve.wait_job(alices.json()["job_id"], "placing")
        assert waiting["reason"] == "waiting for 1 cpu slot(s): 0 of 1 free, 0 job(s) of yours ahead"
        for job in serve.call("GET", "/")["jobs"]:
            serve.call("POST", f"/{job['job_id']}:cancel")


def test_l3_serve_refuses_a_data_dir_inside_the_model_root(tmp_path):
    """With --data-dir inside --model-root, model_name 'serve/jobs/<job>/checkpoints/global_step1' loaded
    another tenant's checkpoint as a model: the service now refuses that layout before it starts."""
    root = tmp_path / "models"
    root.mkdir()
    port = free_port()
    command = [sys.executable, "-m", "icefloe.cli", "serve", "--data-dir", str(root / "serve"),
               "--model-root", str(root), "--port", str(port), "--engines", "local"]  # fmt: skip
    wide = {**os.environ, "COLUMNS": "1000"}  # the error box would break a long tmp path mid-word
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=wide) as process:
        deadline = time.monotonic() + 120
        while process.poll() is None:
            try:
                started = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                started = False
            if started or time.monotonic() > deadline:
                process.terminate()
                process.wait(30)
                raise AssertionError(f"icefloe serve started with its data dir inside the model root ({started=})")
            time.sleep(0.2)
        output = process.stdout.read() if process.stdout is not None else ""
    said = " ".join(output.replace("│", " ").split())  # the error box's borders and line breaks
    assert process.returncode != 0
    assert f"data_dir '{root / 'serve'}' and model_root '{root}' overlap" in said, output
    assert "every tenant could load the service's checkpoints as a model" in said
    assert "(icefloe serve --data-dir outside --model-root)" in said
    assert not (root / "serve" / "icefloe.sqlite3").exists()


def test_l7_no_answer_names_a_server_folder(served):
    """A Tinker job's training-API record showed its base model's server path (host.base_model), its log
    the same path, and save and load results named the checkpoint's folder on the server."""
    folder = str(served.data_dir.parent)  # holds the data dir and the model root
    alice = Tinker(served, "alice")
    try:
        _, model_id = alice.model()
    finally:
        alice.close()
    texts = []
    with _api(served, "alice") as api:
        (tinker_job,) = [j["job_id"] for j in api.get("/").json()["jobs"] if j["experiment_name"] == model_id]
        record = api.get(f"/{tinker_job}")
        assert record.json()["host"]["base_model"] == "<model root>/tiny-chat"
        job_id = api.post("/", json={"sub_job_configs": [TRAINING]}).json()["job_id"]
        served.wait_job(job_id, "running")
        served.run(job_id, "forward-backward", small_batch())
        served.run(job_id, "step", {})
        saved = served.run(job_id, "save", {})
        assert saved["path"] == saved["checkpoint_path"] == f"jobs/{job_id}/checkpoints/global_step1"
        loaded = served.run(job_id, "load", {"checkpoint_id": "global_step1"})
        assert loaded["path"] == f"jobs/{job_id}/checkpoints/global_step1"
        logs = {
            job: api.post(f"/{job}/operation", json={"operation_type": "tail-logs", "sub_job_type": "training"}).text
            for job in (tinker_job, job_id)
        }
        assert "shared base '<model root>/tiny-chat'" in logs[tinker_job]  # the base it runs on, by the root's name
        for job in (tinker_job, job_id):
            texts.append(httpx.get(f"{served.base_url}/ui/api/jobs/{job}", headers=api.headers).text)
        texts += [record.text, str(saved), str(loaded), api.get("/").text, *logs.values()]
        served.call("POST", f"/{job_id}:cancel")
    leaks = [text for text in texts if folder in text]
    assert not leaks, leaks
