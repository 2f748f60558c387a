"""Faults against real ``icefloe serve`` processes: kill -9 and SIGSTOP, a second service on the same
data dir, clients that vanish or give up, and two saves at one step. Short leases and deadlines come
from the command line, so each fault shows within seconds."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from icefloe.client import Client
from icefloe.config import ClientConfig
from icefloe.protocol import IcefloeTimeoutError, InvalidRequestError

from ..service.service_batches import small_batch
from .serve_process import TRAINING, Serve, gone, stop, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services, 5-15 s each: `make test-slow`


def _client(serve: Serve, **config) -> Client:
    backend = {"type": "remote", "base_url": serve.base_url, "poll_interval_s": 0.05, "poll_max_interval_s": 0.2}
    return Client(ClientConfig.build(model="tiny:arith", backend=backend, **config))


def test_kill9_of_serve_with_queued_requests_then_a_restart_ends_every_accepted_request_with_a_reason(tmp_path):
    data = tmp_path / "serve"
    with Serve(data) as serve:
        job_id = serve.create()
        serve.wait_job(job_id, "running")
        engine = serve.engine_pid(job_id)
        stop(engine)  # nothing runs: every request below is accepted and still queued
        accepted = [serve.submit(job_id, "forward-backward", small_batch(i)) for i in range(3)]
        accepted.append(serve.submit(job_id, "step", {}))
        serve.kill()
        os.kill(engine, signal.SIGKILL)
    with Serve(data) as restarted:
        job = restarted.wait_job(job_id, "failed")
        assert job["reason"] == "service restarted; no checkpoint was saved"
        answers = [restarted.finished(job_id, request_id, timeout_s=10) for request_id in accepted]
        assert [a["status"] for a in answers] == ["failed"] * 4
        assert all("service restarted before the request finished" in a["error"] for a in answers)


def test_a_killed_engine_fails_its_job_and_the_poll_ends(tmp_path):
    with Serve(tmp_path / "serve") as serve:
        job_id = serve.create()
        serve.wait_job(job_id, "running")
        engine = serve.engine_pid(job_id)
        os.kill(engine, signal.SIGKILL)
        answer = serve.finished(job_id, serve.submit(job_id, "forward-backward", small_batch()))
        assert answer["status"] == "failed" and f"the engine process {engine} was killed by signal 9" in answer["error"]
        job = serve.wait_job(job_id, "failed")
        assert f"the engine process {engine} was killed by signal 9 during fwd_bwd" in job["reason"]


def test_a_stopped_engine_fails_its_job_at_the_op_deadline_naming_the_op_and_the_pid(tmp_path):
    """A SIGSTOPped engine used to leave its ops running, and every poll waiting, for good."""
    with Serve(tmp_path / "serve", "--op-deadline-s", "3") as serve:
        job_id = serve.create()
        serve.wait_job(job_id, "running")
        engine = serve.engine_pid(job_id)
        stop(engine)  # fault: a driver call that never returns
        answer = serve.finished(job_id, serve.submit(job_id, "forward-backward", small_batch()), timeout_s=60)
        assert answer["status"] in ("failed", "cancelled") and answer["error"]
        job = serve.wait_job(job_id, "failed")
        assert job["reason"].startswith(f"forward-backward on {job_id}:training:0 did not finish within its deadline")
        assert f"killed the engine process {engine}" in job["reason"]
        wait_for(lambda: gone(engine), 10, f"engine process {engine} ends")
        assert serve.call("GET", "/capacity")["in_use_slots"] == 0


def test_cancelling_a_job_kills_its_stopped_engine(tmp_path):
    with Serve(tmp_path / "serve") as serve:
        job_id = serve.create()
        serve.wait_job(job_id, "running")
        engine = serve.engine_pid(job_id)
        stop(engine)
        request_id = serve.submit(job_id, "forward-backward", small_batch())
        serve.call("POST", f"/{job_id}:cancel")
        assert serve.wait_job(job_id, "terminated")["status"] == "terminated"
        assert gone(engine)  # killed before the job reported itself terminated
        assert serve.finished(job_id, request_id)["status"] == "cancelled"


def test_a_second_serve_on_a_data_dir_in_use_is_refused_and_the_first_is_unharmed(tmp_path):
    """The second service used to fail every running job of the first, even when it then could not bind."""
    data = tmp_path / "serve"
    with Serve(data) as first:
        job_id = first.create()
        first.wait_job(job_id, "running")
        second = Serve(data)
        try:
            assert second.process.wait(120) != 0
            refusals = [line for line in second.output().splitlines() if "in use" in line]
        finally:
            second.__exit__()
        assert refusals == [
            f"icefloe serve: data dir {data} is in use by another icefloe serve (pid {first.process.pid}); "
            "stop it or pick another data dir"
        ]
        assert first.call("GET", f"/{job_id}")["status"] == "running"
        first.run(job_id, "forward-backward", small_batch())
        assert first.run(job_id, "step", {})["global_step"] == 1


def test_a_job_whose_lease_lapses_is_cancelled_and_its_slots_freed_while_a_live_client_keeps_its_own(tmp_path):
    """A job used to outlive its client forever, holding its slots."""
    with Serve(tmp_path / "serve", "--lease-ttl-s", "1") as serve, _client(serve, num_sampling_workers=0) as client:
        orphan = serve.create()  # created over plain HTTP, by a client that then goes away
        serve.wait_job(orphan, "running")
        job = serve.wait_job(orphan, "cancelled", "terminated", renew=False, timeout_s=60)
        assert job["reason"] == "client lease expired"
        wait_for(lambda: serve.call("GET", "/capacity")["in_use_slots"] == 1, 30, "the orphan's slot is free")
        time.sleep(3)  # three lease periods with nothing to send: the client's heartbeat keeps its job
        kept = client.handle()["transport"]["job_id"]
        assert next(j for j in serve.call("GET", "/")["jobs"] if j["job_id"] == kept)["status"] == "running"
        client.fwd_bwd(small_batch())
        assert client.step()["global_step"] == 1


def test_a_client_that_gives_up_waiting_for_slots_says_why_and_cancels_its_job(tmp_path, caplog):
    """A job whose client timed out used to stay placing, then start later and hold slots for nobody."""
    with Serve(tmp_path / "serve") as serve:
        both = {**TRAINING, "training_config": {**TRAINING["training_config"], "n_gpus": 2}}
        holder = serve.create(both)
        serve.wait_job(holder, "running")
        client = _client(serve, job_ready_timeout_s=3, num_sampling_workers=0)
        try:
            with (
                caplog.at_level(logging.WARNING, logger="icefloe.client.remote"),
                pytest.raises(IcefloeTimeoutError) as waited,
            ):
                client.open()
        finally:
            client.shutdown()
        why = "waiting for 1 cpu slot(s): 0 of 2 free, 0 job(s) of yours ahead"
        assert f"is still placing after 3 s ({why})" in str(waited.value)
        assert why in caplog.text
        given_up = next(j for j in serve.call("GET", "/")["jobs"] if j["job_id"] != holder)
        assert given_up["status"] in ("cancelling", "cancelled", "terminated")


def test_two_saves_at_one_step_keep_both_and_loading_the_resumable_one_restores_the_optimizer(tmp_path):
    """The second save used to replace the first under the same id, losing the optimizer state."""
    with Serve(tmp_path / "serve") as serve, _client(serve) as client:
        with pytest.raises(InvalidRequestError, match="needs a fwd_bwd since the last step"):
            client.step()
        client.fwd_bwd(small_batch(0))
        client.step()
        resumable = client.save_checkpoint("resumable")
        weights = client.save_checkpoint("weights-only")
        assert resumable["checkpoint_id"] != weights["checkpoint_id"]
        listed = {c["checkpoint_id"]: c["checkpoint_type"] for c in client.list_checkpoints()}
        assert listed == {resumable["checkpoint_id"]: "resumable", weights["checkpoint_id"]: "weights-only"}
        client.fwd_bwd(small_batch(1))
        stepped = client.step()
        loss_after = client.fwd_bwd(small_batch(2))["loss"]
        client.load_checkpoint(resumable["checkpoint_id"])
        client.fwd_bwd(small_batch(1))
        assert client.step()["grad_norm"] == stepped["grad_norm"]
        assert client.fwd_bwd(small_batch(2))["loss"] == loss_after  # AdamW's moments came back exactly
