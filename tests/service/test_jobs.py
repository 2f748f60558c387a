"""Job lifecycle, placement and request execution order (tests of icefloe.service.jobs)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

from icefloe.service import store
from icefloe.service.hosts.seam import LocalEngineHost

from ..refusing_loss import REFUSING_LOSS, register_refusing_loss
from .service_batches import small_batch
from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app, wrap_engine_method

pytestmark = pytest.mark.anyio


async def test_create_with_a_model_that_cannot_load_fails_naming_it(data_dir):
    missing = "tiny:no-such-preset"
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create({**TRAINING, "model_name": missing})
        job = await api.wait_status(job_id, "failed")
        assert "no-such-preset" in job["reason"] and job["reason"].startswith("initializing failed")
        assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 0


async def test_cancel_is_idempotent_while_cancelling_and_conflicts_once_terminated(data_dir, monkeypatch):
    release = threading.Event()
    original_close = LocalEngineHost.close

    def slow_close(self):  # fault: releasing the engines takes a while
        release.wait(30)
        original_close(self)

    monkeypatch.setattr(LocalEngineHost, "close", slow_close)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        assert (await api.call("POST", f"/{job_id}:cancel")).json()["status"] == "cancelling"
        repeat = await api.call("POST", f"/{job_id}:cancel")
        assert repeat.json() == {"job_id": job_id, "status": "cancelling"}
        assert (await api.job(job_id))["status"] == "cancelling"
        release.set()
        await api.wait_status(job_id, "terminated")
        late = await api.call("POST", f"/{job_id}:cancel", check=False)
        assert (late.status_code, late.json()["code"]) == (409, "conflict")
        assert "terminated" in late.json()["message"]


async def test_job_waits_in_placing_until_slots_are_free(data_dir):
    """It slept 0.3 s and then asserted "placing": flaky on a loaded machine; it now waits for the state."""
    async with asgi_client(make_app(data_dir, slots=2)) as http:
        api = Api(http)
        first = await api.create(TRAINING, SAMPLING)
        await api.wait_status(first, "running")
        second = await api.create(TRAINING)
        await api.wait_status(second, "placing", timeout_s=30)
        # Why it waits, in every read of it: GET (the remote client), the list (`icefloe jobs list`), /ui.
        why = "waiting for 1 cpu slot(s): 0 of 2 free, 0 job(s) of yours ahead"
        assert (await api.job(second))["reason"] == why
        listed = (await api.call("GET", "")).json()["jobs"]
        assert [job["reason"] for job in listed if job["job_id"] == second] == [why]
        shown = (await http.get("/ui/api/jobs")).json()["jobs"]
        assert [job["reason"] for job in shown if job["job_id"] == second] == [why]
        assert (await http.get(f"/ui/api/jobs/{second}")).json()["reason"] == why
        logs = (await api.call("POST", f"/{second}/operation", json={"operation_type": "tail-logs"})).json()
        assert logs["eof"] is True and any("placing" in e["msg"] for e in logs["entries"])
        refused = await api.call("POST", f"/{second}/step", json={}, check=False)
        assert refused.status_code == 409 and "placing" in refused.json()["message"]
        await api.call("POST", f"/{first}:cancel")
        await api.wait_status(second, "running")
        assert not (await api.job(second))["reason"]


async def test_listing_jobs_by_an_unknown_status_is_refused_naming_the_states(data_dir):
    """`icefloe jobs list --status bogus` printed an empty table."""
    async with asgi_client(make_app(data_dir)) as http:
        refused = await Api(http).call("GET", "", params={"status": "bogus"}, check=False)
    assert (refused.status_code, refused.json()["code"]) == (400, "invalid_argument")
    assert refused.json()["message"] == (
        "status must be one of canceled, cancelled, cancelling, done, failed, initializing, pending, placing, "
        "running, terminated; got 'bogus'"
    )


async def test_job_needing_more_slots_than_exist_is_refused(data_dir):
    async with asgi_client(make_app(data_dir, slots=1)) as http:
        response = await Api(http).call("POST", "/", json={"sub_job_configs": [TRAINING, SAMPLING]}, check=False)
        assert (response.status_code, response.json()["code"]) == (400, "invalid_argument")
        assert "needs 2 slots" in response.json()["message"]


async def test_engine_crash_fails_the_job_with_its_reason(data_dir, monkeypatch):
    def crash(run, sub_job_id, learning_rate, adam):  # fault: the device went away mid-step
        raise RuntimeError("device lost during optimizer step")

    wrap_engine_method(monkeypatch, "step", crash)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        request_id = (await api.call("POST", f"/{job_id}/step", json={})).json()["request_id"]
        polled = await api.poll(job_id, request_id)
        assert polled["status"] == "failed" and "device lost" in polled["error"]
        job = await api.wait_status(job_id, "failed")
        assert "device lost during optimizer step" in job["reason"] and f"{job_id}:training:0" in job["reason"]
        assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 0


async def test_bad_batch_fails_the_request_but_not_the_job(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        batch = small_batch()
        batch["kwargs"]["input_ids"] = batch["kwargs"]["input_ids"] + 1000  # ids past the vocabulary
        response = await api.post_frame(job_id, "forward-backward", batch, check=False)
        assert (response.status_code, response.json()["code"]) == (400, "invalid_argument")
        assert "kwargs.input_ids" in response.json()["message"]
        assert (await api.job(job_id))["status"] == "running"


async def test_a_training_op_is_validated_once_on_its_way_to_a_local_engine(data_dir, validations):
    """The route validated each batch and the engine again; now the engine takes the route's Frame."""
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running(TRAINING)
        await api.fwd_bwd(job_id)
        accepted = (await api.post_frame(job_id, "forward", small_batch(1))).json()
        assert (await api.result(job_id, accepted["request_id"]))["logprobs"].shape == (4, 7)
    assert validations == [True, False]


async def test_a_full_weight_fwd_bwd_failing_part_way_says_the_runs_gradient_is_gone(data_dir, monkeypatch):
    """A full-weight run keeps no copy of its accumulated gradient: a call failing part-way discards it,
    and the request's error must say so, or the client's retry of that call alone steps on a part of it."""
    register_refusing_loss(monkeypatch)
    training = {**TRAINING["training_config"], "mb_spec": {"max_tokens_per_mb": 24}}
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running({**TRAINING, "training_config": training})
        await api.fwd_bwd(job_id)
        failing = small_batch(1)
        failing["kwargs"], failing["context"] = ({name: t.repeat(3, 1) for name, t in failing[section].items()}
                                                 for section in ("kwargs", "context"))  # fmt: skip
        failing["processing"] = {"loss_fn": REFUSING_LOSS, "config": {"refuse_at_pass": 3}}
        accepted = (await api.post_frame(job_id, "forward-backward", failing)).json()
        polled = await api.poll(job_id, accepted["request_id"])
        assert polled["status"] == "failed" and "refuses pass 3" in polled["error"]
        assert "the gradient accumulated since step 0 is discarded" in polled["error"]
        assert (await api.job(job_id))["status"] == "running"


async def test_requests_to_one_sub_job_run_in_submission_order(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING, SAMPLING)
        await api.wait_status(job_id, "running")
        before = (
            await api.post_frame(job_id, "generate", {"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}})
        ).json()
        ids = []
        for _ in range(3):  # submitted back to back, never awaited in between
            ids.append((await api.post_frame(job_id, "forward-backward", small_batch())).json()["request_id"])
            ids.append((await api.call("POST", f"/{job_id}/step", json={})).json()["request_id"])
        sync = (await api.call("POST", f"/{job_id}/operation", json={"operation_type": "weight-sync"})).json()
        after = (
            await api.post_frame(job_id, "generate", {"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}})
        ).json()
        steps = [await api.result(job_id, rid) for rid in ids[1::2]]
        assert [s["global_step"] for s in steps] == [1, 2, 3]
        assert (await api.result(job_id, sync["request_id"]))["policy_version"] == 3
        assert (await api.result(job_id, before["request_id"]))["results"][0]["policy_version"] == 0
        assert (await api.result(job_id, after["request_id"]))["results"][0]["policy_version"] == 3


async def test_concurrent_generates_to_one_sampler_are_coalesced(data_dir, monkeypatch):
    gate, calls = threading.Event(), []
    original = LocalEngineHost.generate_many

    def gated_generate(self, batch):  # fault: the first batch is slow
        calls.append(sum(len(prompts) for _, prompts, *_ in batch))
        if len(calls) == 1:
            gate.wait(30)
        return original(self, batch)

    monkeypatch.setattr(LocalEngineHost, "generate_many", gated_generate)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.create(TRAINING, SAMPLING)
        await api.wait_status(job_id, "running")
        body = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 3}}
        first = (await api.post_frame(job_id, "generate", body)).json()["request_id"]
        while not calls:
            await asyncio.sleep(0.01)
        queued = [(await api.post_frame(job_id, "generate", body)).json()["request_id"] for _ in range(3)]
        gate.set()
        results = [await api.result(job_id, rid) for rid in [first, *queued]]
        assert calls == [1, 3]
        assert all(len(r["results"]) == 1 for r in results)


async def test_forward_on_a_log_probability_sub_job_matches_the_untrained_policy(data_dir):
    reference = {"job_type": "log_probability", "model_name": "tiny:arith", "inference_config": {"max_seq_len": 64}}
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(reference, TRAINING)
        job = await api.wait_status(job_id, "running")
        assert [s["sub_job_id"] for s in job["sub_jobs"]] == [f"{job_id}:log_prob:0", f"{job_id}:training:0"]
        assert job["sub_jobs"][1]["training_config"]["optimizer"]["lr"] == 1e-3
        outputs = {}
        for kind in ("log_probability", "training"):
            accepted = (await api.post_frame(job_id, "forward", small_batch(), params={"sub_job_type": kind})).json()
            outputs[kind] = await api.result(job_id, accepted["request_id"])
        torch.testing.assert_close(outputs["log_probability"]["logprobs"], outputs["training"]["logprobs"])
        refused = await api.post_frame(job_id, "forward-backward", small_batch(), params={
            "sub_job_id": f"{job_id}:log_prob:0"}, check=False)  # fmt: skip
        assert (refused.status_code, refused.json()["code"]) == (400, "invalid_argument")


async def test_long_poll_answers_when_the_request_finishes(data_dir, monkeypatch):
    gate = threading.Event()

    def gated_step(run, sub_job_id, learning_rate, adam):  # fault: a slow optimizer step
        gate.wait(30)
        return run()

    wrap_engine_method(monkeypatch, "step", gated_step)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        await api.fwd_bwd(job_id)
        request_id = (await api.call("POST", f"/{job_id}/step", json={})).json()["request_id"]
        short = await api.poll(job_id, request_id, wait=0.2)
        assert short["status"] in ("pending", "running") and short["result"] == {}
        waiting = asyncio.ensure_future(api.poll(job_id, request_id, wait=30))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        gate.set()
        done = await asyncio.wait_for(waiting, timeout=25)  # well inside its 30 s wait: woken, not timed out
        assert done["status"] == "done" and done["result"]["global_step"] == 1


async def test_cancel_request_cancels_only_requests_that_have_not_started(data_dir, monkeypatch):
    gate = threading.Event()

    def gated_step(run, sub_job_id, learning_rate, adam):  # fault: a slow optimizer step holds the queue
        gate.wait(30)
        return run()

    wrap_engine_method(monkeypatch, "step", gated_step)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        await api.fwd_bwd(job_id)
        running = (await api.call("POST", f"/{job_id}/step", json={})).json()["request_id"]
        queued = (await api.call("POST", f"/{job_id}/step", json={})).json()["request_id"]
        while (await api.poll(job_id, running, wait=0))["status"] != "running":
            await asyncio.sleep(0.01)
        answers = []
        for request_id in (running, queued):
            answers.append((await api.call("POST", f"/{job_id}/operation", json={
                "operation_type": "cancel-request", "payload": {"request_id": request_id}})).json())  # fmt: skip
        assert [(a["cancelled"], a["status"]) for a in answers] == [(False, "running"), (True, "cancelled")]
        gate.set()
        assert (await api.result(job_id, running))["global_step"] == 1
        cancelled = await api.poll(job_id, queued)
        assert cancelled["status"] == "cancelled" and "cancel-request" in cancelled["error"]
        await api.fwd_bwd(job_id)
        after = await api.run(job_id, "POST", "step", json={})
        assert after["global_step"] == 2  # the cancelled step never ran


async def test_engine_warnings_land_in_the_sub_jobs_log(data_dir, monkeypatch):

    def warning_step(run, sub_job_id, learning_rate, adam):  # what an engine logs on its worker thread
        logging.getLogger("icefloe.engines.training").warning("grad norm is not finite; update skipped")
        return run()

    wrap_engine_method(monkeypatch, "step", warning_step)
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.create(TRAINING, SAMPLING)
        await api.wait_status(job_id, "running")
        await api.fwd_bwd(job_id)
        await api.run(job_id, "POST", "step", json={})
        pages = {}
        for kind in ("training", "sampling"):
            body = {"operation_type": "tail-logs", "sub_job_type": kind}
            pages[kind] = (await api.call("POST", f"/{job_id}/operation", json=body)).json()["entries"]
        routed = [e for e in pages["training"] if e["logger"] == "icefloe.engines.training"]
        assert [(e["level"], e["msg"]) for e in routed] == [("WARNING", "grad norm is not finite; update skipped")]
        assert not [e for e in pages["sampling"] if e["logger"] == "icefloe.engines.training"]


async def test_shutdown_during_engine_start_closes_the_host_once_after_start(data_dir, monkeypatch):
    """Shutdown closed the host while host.start ran, then teardown closed it again; late writes hit a closed db."""
    events: list[str] = []
    entered, release = threading.Event(), threading.Event()
    original_start, original_close = LocalEngineHost.start, LocalEngineHost.close

    def slow_start(self, on_progress, stop):
        entered.set()
        release.wait(30)
        try:
            original_start(self, on_progress, stop)  # gives up: the job is stopping
        finally:
            events.append("start returned")

    def counting_close(self):
        events.append("closed")
        original_close(self)

    monkeypatch.setattr(LocalEngineHost, "start", slow_start)
    monkeypatch.setattr(LocalEngineHost, "close", counting_close)
    app = make_app(data_dir, engines="local")
    async with asgi_client(app) as http:
        job_id = await Api(http).create(TRAINING)
        assert await asyncio.to_thread(entered.wait, 30)
        timer = threading.Timer(0.5, release.set)  # the start finishes while shutdown is already waiting
        timer.start()
    timer.join()
    assert events == ["start returned", "closed"]  # one close, after the start, from the teardown path
    assert not [t for t in threading.enumerate() if t.name == f"icefloe-lifecycle-{job_id}"]
    store.update_job(app.state.db, job_id=job_id, status="failed", reason="late")  # closed store: a no-op
    assert store.get_job(app.state.db, job_id=job_id) is None


async def test_a_per_prompt_routing_key_list_routes_like_its_one_key(data_dir):
    """A list of keys used to be ignored: every such generate went to the first sampler."""
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING, SAMPLING)

        async def sampler_of(routing_key) -> str:
            body = {"prompts": [[1, 2], [3]], "routing_key": routing_key, "sampling_params": {"max_tokens": 1}}
            request_id = (await api.post_frame(job_id, "generate", body)).json()["request_id"]
            await api.result(job_id, request_id)
            return request_id.split(":")[2]

        keyed = {key: await sampler_of(key) for key in ("a", "b")}
        assert keyed["a"] != keyed["b"]  # the two keys land on different samplers
        assert [await sampler_of([None, key]) for key in ("a", "b")] == [keyed["a"], keyed["b"]]


async def test_a_forward_cut_into_slices_answers_the_log_probs_of_one_engine_call(data_dir, monkeypatch):
    from icefloe.service.work import items

    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")

        async def forward() -> dict:
            accepted = (await api.post_frame(job_id, "forward", small_batch(3))).json()
            return await api.result(job_id, accepted["request_id"])

        whole = await forward()
        width = whole["logprobs"].shape[1]
        monkeypatch.setattr(items, "_FORWARD_SLICE_POSITIONS", width)  # one row per engine call (no pass size set)
        sliced = await forward()
        assert sliced["logprobs"].shape == whole["logprobs"].shape == (4, width)
        torch.testing.assert_close(sliced["logprobs"], whole["logprobs"])
        torch.testing.assert_close(sliced["entropy"], whole["entropy"])
