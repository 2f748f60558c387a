"""What an engine logs while it runs a job's op reaches that job's log, on a shared host too.

Job logs were routed by thread name: a shared host's one worker thread (and its one engine-process
thread) runs every run's ops, and no job is named after it, so a warning an engine logged for a run
on a shared host reached no job's log.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings

import pytest

from icefloe import wire
from icefloe.service.hosts.seam import LocalEngineHost
from icefloe.service.joblog import JobLog, JobLogRouter

from .service_batches import canonical_batch
from .service_client import PREFIX
from .service_harness import asgi_client, make_app

TOKENS = {"alice": "tok-alice", "bob": "tok-bob"}
PEFT = {"peft_type": "Lora", "r": 4, "lora_alpha": 8}
LORA_JOB = [
    {"job_type": "training", "model_name": "tiny:arith",
     "training_config": {"optimizer": {"name": "AdamW", "lr": 1e-3}, "max_seq_len": 64, "peft_config": PEFT}},
    {"job_type": "sampling", "model_name": "tiny:arith",
     "inference_config": {"max_seq_len": 64, "n_gpus": 0, "peft_config": PEFT}},
]  # fmt: skip
BAD_STOP = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 3, "seed": 1, "stop_token_ids": [999]}}
PLAIN = {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 3, "seed": 1}}
STOP_WARNING = "sampling_params.stop_token_ids [999] are not ids of this model's vocabulary"


class _Tenant:
    """One tenant's calls to the training API."""

    def __init__(self, http, name: str) -> None:
        self.http, self.headers = http, {"Authorization": f"Bearer {TOKENS[name]}"}

    async def call(self, method: str, path: str, headers: dict | None = None, **kwargs):
        answer = await self.http.request(method, PREFIX + path, headers={**self.headers, **(headers or {})}, **kwargs)
        assert answer.status_code < 300, answer.text
        return answer.json()

    async def job(self) -> str:
        job_id = (await self.call("POST", "/", json={"sub_job_configs": LORA_JOB}))["job_id"]
        while (await self.call("GET", f"/{job_id}"))["status"] != "running":
            await asyncio.sleep(0.05)
        return job_id

    async def submit(self, job_id: str, endpoint: str, body) -> str:
        content, octets = wire.encode(body), {"Content-Type": "application/octet-stream"}
        return (await self.call("POST", f"/{job_id}/{endpoint}", content=content, headers=octets))["request_id"]

    async def result(self, job_id: str, request_id: str):
        while True:
            answer = await self.call("GET", f"/{job_id}/requests/{request_id}", params={"wait": 5})
            if answer["status"] in ("done", "failed", "cancelled"):
                assert answer["status"] == "done", answer
                return answer["result"]

    async def log(self, job_id: str, kind: str) -> list[dict]:
        """The sub-job's log as its owner pages it."""
        body = {"operation_type": "tail-logs", "sub_job_type": kind}
        return (await self.call("POST", f"/{job_id}/operation", json=body))["entries"]


def _warnings(entries: list[dict]) -> list[str]:
    return [e["msg"] for e in entries if e["level"] == "WARNING" and e["logger"].startswith("icefloe.engines")]


@pytest.mark.anyio
@pytest.mark.parametrize("engines", ["local", "process"])
async def test_an_engine_warning_on_a_shared_host_reaches_the_log_of_the_job_whose_op_it_is(data_dir, engines):
    tenants = {name: (token,) for name, token in TOKENS.items()}
    app = make_app(data_dir, slots=1, engines=engines, tenant_tokens=tenants)
    async with asgi_client(app) as http:
        alice, bob = _Tenant(http, "alice"), _Tenant(http, "bob")
        mine, theirs = await alice.job(), await bob.job()
        hosts = {job["job_id"]: job["host"]["host_id"] for job in app.state.jobs.list_public(None)}
        assert hosts[mine] == hosts[theirs], "both runs share one host"

        poisoned = canonical_batch([([1, 2, 3], [4, 5, 6]), ([2, 3, 4], [5, 6, 7])], [float("nan"), 1.0])
        await alice.result(mine, await alice.submit(mine, "forward-backward", poisoned))
        await alice.result(mine, (await alice.call("POST", f"/{mine}/step", json={}))["request_id"])
        await alice.result(mine, await alice.submit(mine, "generate", BAD_STOP))
        await bob.result(theirs, await bob.submit(theirs, "generate", PLAIN))

        trained, sampled = _warnings(await alice.log(mine, "training")), _warnings(await alice.log(mine, "sampling"))
        assert len(trained) == 1 and trained[0].startswith("skipping the optimizer update at step 0: grad_norm is nan")
        assert len(sampled) == 1 and sampled[0].startswith(STOP_WARNING)
        assert not _warnings(await bob.log(theirs, "training")) + _warnings(await bob.log(theirs, "sampling"))


@pytest.mark.anyio
async def test_an_engine_warning_about_one_call_of_a_shared_batch_reaches_that_calls_log_alone(data_dir, monkeypatch):
    """The decode batch is one engine call of two tenants' calls: a warning about alice's call (it names
    her stop ids) reaches her log, never bob's, though he shared the batch."""
    hold, held, release = threading.Event(), threading.Event(), threading.Event()
    generate_many = LocalEngineHost.generate_many

    def held_first(self, calls):  # fault: a slow batch, so that the next two generates queue up together
        if hold.is_set():
            hold.clear()
            held.set()
            release.wait(30)
        return generate_many(self, calls)

    monkeypatch.setattr(LocalEngineHost, "generate_many", held_first)
    tenants = {name: (token,) for name, token in TOKENS.items()}
    app = make_app(data_dir, slots=1, engines="local", tenant_tokens=tenants)
    async with asgi_client(app) as http:
        alice, bob = _Tenant(http, "alice"), _Tenant(http, "bob")
        mine, theirs, blocking = await alice.job(), await bob.job(), await bob.job()
        hold.set()
        first = await bob.submit(blocking, "generate", PLAIN)  # a lane of its own: it holds none of the two
        await asyncio.to_thread(held.wait, 30)
        together = [await alice.submit(mine, "generate", BAD_STOP), await bob.submit(theirs, "generate", PLAIN)]
        release.set()
        await bob.result(blocking, first)
        await alice.result(mine, together[0])
        await bob.result(theirs, together[1])
        assert [m.startswith(STOP_WARNING) for m in _warnings(await alice.log(mine, "sampling"))] == [True]
        assert [m.startswith(STOP_WARNING) for m in _warnings(await bob.log(theirs, "sampling"))] == []


def test_a_warning_warned_while_a_thread_serves_an_op_lands_in_that_ops_log(tmp_path):
    log = JobLog(tmp_path, ["j:training:0", "j:sampling:0"])
    router, logger = JobLogRouter(), logging.getLogger("icefloe.test-joblog")
    with pytest.warns(UserWarning) as shown:
        router.attach(logger)
        try:
            warnings.warn("outside any op", UserWarning, stacklevel=1)
            with router.serving([(log, "j:training:0")]):
                warnings.warn("a library's warning", UserWarning, stacklevel=1)
        finally:
            router.detach(logger)
    assert [str(w.message) for w in shown] == ["outside any op", "a library's warning"]  # shown as before, too
    entries = log.tail("j:training:0", cursor=None, max_lines=10)["entries"]
    assert [(e["level"], e["logger"]) for e in entries] == [("WARNING", "py.warnings")]
    assert entries[0]["msg"] == "UserWarning: a library's warning"
    assert not log.tail("j:sampling:0", cursor=None, max_lines=10)["entries"]


def test_a_warning_from_one_place_reaches_each_jobs_log_once_and_is_shown_once(tmp_path):
    """Python shows a warning once per place per process, which kept it from every job after the
    first on a shared host; the router lets it through and keeps the rule per job instead."""
    alice, bob = JobLog(tmp_path / "a", ["a:sampling:0"]), JobLog(tmp_path / "b", ["b:sampling:0"])
    router, logger = JobLogRouter(), logging.getLogger("icefloe.test-joblog-once")

    def library_call() -> None:
        warnings.warn("a library's warning", UserWarning, stacklevel=1)

    with warnings.catch_warnings(record=True) as shown:
        warnings.resetwarnings()  # Python's own rule: "default", once per place
        router.attach(logger)
        try:
            for log, sub_job in [(alice, "a:sampling:0"), (bob, "b:sampling:0"), (alice, "a:sampling:0")]:
                with router.serving([(log, sub_job)]):
                    library_call()
        finally:
            router.detach(logger)
        assert ("always", None, Warning, None, 0) not in warnings.filters
    assert [str(w.message) for w in shown] == ["a library's warning"]
    for log, sub_job in [(alice, "a:sampling:0"), (bob, "b:sampling:0")]:
        entries = log.tail(sub_job, cursor=None, max_lines=10)["entries"]
        assert [e["msg"] for e in entries] == ["UserWarning: a library's warning"]


def test_a_record_about_one_sub_job_goes_to_its_log_and_any_other_to_every_log_of_the_op(tmp_path):
    log = JobLog(tmp_path, ["a:sampling:0", "b:sampling:0"])
    router, logger = JobLogRouter(), logging.getLogger("icefloe.test-joblog-owner")
    logger.addHandler(router)
    try:
        with router.serving([(log, "a:sampling:0"), (log, "b:sampling:0")]):
            logger.warning("about a's call", extra={"owner": "a:sampling:0"})
            logger.warning("about the batch")
    finally:
        logger.removeHandler(router)

    def read(sub_job_id: str) -> list[str]:
        return [e["msg"] for e in log.tail(sub_job_id, cursor=None, max_lines=10)["entries"]]

    assert read("a:sampling:0") == ["about a's call", "about the batch"]
    assert read("b:sampling:0") == ["about the batch"]
