"""``--engines process`` (the default): each job's engines in a child process of their own.

What it must show: the engines really run in another process, a crash there fails that job with
the cause and leaves the service and its other jobs serving, engine log records reach the job's
log, and tensors cross the process boundary bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from icefloe.engines.worker import RoleWorker
from icefloe.protocol import InvalidRequestError
from icefloe.service.models import JobCreate
from icefloe.service.process_host import ProcessEngineHost, _CallRecords, _dumps, _loads, _serve
from icefloe.service.runtime import queued_call
from icefloe.service.specs import sub_job_specs

from .service_batches import canonical_batch, small_batch
from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


def _host(app, job_id: str) -> ProcessEngineHost:
    host = app.state.jobs.live(job_id).host
    assert isinstance(host, ProcessEngineHost)
    return host


async def test_engines_run_in_a_child_process_and_train(data_dir):
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        host = _host(app, job_id)
        assert host.pid is not None and host.pid != os.getpid()
        os.kill(host.pid, 0)  # alive
        accepted = (await api.post_frame(job_id, "forward-backward", small_batch())).json()
        trained = await api.result(job_id, accepted["request_id"])
        stepped = await api.run(job_id, "POST", "step", json={})
        assert math.isfinite(trained["loss"]) and stepped["global_step"] == 1 and stepped["grad_norm"] > 0
        synced = await api.run(job_id, "POST", "operation", json={"operation_type": "weight-sync", "payload": {}})
        assert synced["policy_version"] == 1
        samples = await api.result(
            job_id,
            (
                await api.post_frame(job_id, "generate", {"prompts": [[1, 2, 3]], "sampling_params": {"max_tokens": 2}})
            ).json()["request_id"],
        )
        assert len(samples["results"]) == 1 and len(samples["results"][0]["token_ids"]) >= 1
        pid = host.pid
        await api.call("POST", f"/{job_id}:cancel")
        await api.wait_status(job_id, "terminated")
        assert host.exit_code == 0  # released its engines and exited on its own
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def test_a_killed_engine_process_fails_its_job_and_the_service_keeps_serving(data_dir):
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        doomed = await api.create(TRAINING)
        survivor = await api.create(TRAINING)
        await api.wait_status(doomed, "running")
        await api.wait_status(survivor, "running")
        os.kill(_host(app, doomed).pid, signal.SIGKILL)  # fault: the OOM killer, a CUDA abort
        request_id = (await api.call("POST", f"/{doomed}/step", json={})).json()["request_id"]
        polled = await api.poll(doomed, request_id)
        assert polled["status"] == "failed" and "killed by signal 9" in polled["error"]
        job = await api.wait_status(doomed, "failed")
        assert "killed by signal 9" in job["reason"]
        stepped = await api.run(survivor, "POST", "step", json={})
        assert stepped["global_step"] == 1


async def test_engine_log_records_from_the_child_land_in_the_jobs_log(data_dir):
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        rows = [([1, 2, 3], [4, 5, 6]), ([2, 3, 4], [5, 6, 7])]
        poisoned = canonical_batch(rows, [float("nan"), 1.0])  # a NaN advantage makes the gradient NaN
        accepted = (await api.post_frame(job_id, "forward-backward", poisoned)).json()
        await api.result(job_id, accepted["request_id"])
        await api.run(job_id, "POST", "step", json={})
        pages = {}
        for kind in ("training", "sampling"):
            body = {"operation_type": "tail-logs", "sub_job_type": kind}
            pages[kind] = (await api.call("POST", f"/{job_id}/operation", json=body)).json()["entries"]
        routed = [e for e in pages["training"] if e["logger"] == "icefloe.engines.training"]
        assert [e["level"] for e in routed] == ["WARNING"]
        assert "skipping the optimizer update" in routed[0]["msg"] and "nan" in routed[0]["msg"]
        assert not [e for e in pages["sampling"] if e["logger"] == "icefloe.engines.training"]


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),
        torch.zeros(0, 3),
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
        torch.randn(2, 3).to(torch.bfloat16),
        torch.tensor([True, False]),
        torch.tensor([float("nan"), float("inf")], dtype=torch.float64),
    ],
    ids=["scalar", "empty", "strided", "bfloat16", "bool", "non-finite"],
)
def test_tensors_cross_the_pipe_bit_for_bit(tensor):
    back = _loads(_dumps({"batch": [tensor], "n": 1}))["batch"][0]
    assert (back.dtype, back.shape) == (tensor.dtype, tensor.shape)
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (back, tensor)]
    assert torch.equal(*as_bytes)


class _FaultyEngines:
    """Stand-in engines for faults a real engine cannot be made to produce on demand."""

    def step(self, sub_job_id: str, learning_rate: float | None) -> dict:
        logging.getLogger("icefloe.engines.training").warning("odd", extra={"handle": threading.Lock()})
        return {"global_step": 1, "callback": lambda: None}  # neither the result nor the record's extra pickles

    def forward(self, sub_job_id: str, batch: dict) -> dict:
        return {"logprobs": batch["x"] * 2}


def test_a_reply_that_cannot_be_pickled_fails_its_call_and_the_serving_thread_keeps_serving():
    parent, child = multiprocessing.Pipe()
    records = _CallRecords()
    logging.getLogger("icefloe").addHandler(records)
    serving = threading.Thread(target=_serve, args=(_FaultyEngines(), child, records), daemon=True)
    serving.start()
    try:
        parent.send_bytes(_dumps(("step", ("sub", None))))
        kind, error, _ = _loads(parent.recv_bytes())
        assert kind == "error" and "step returned a result that cannot be sent" in str(error)
        parent.send_bytes(_dumps(("forward", ("sub", {"x": torch.ones(2)}))))
        kind, value, _ = _loads(parent.recv_bytes())
        assert kind == "ok" and torch.equal(value["logprobs"], torch.full((2,), 2.0))
    finally:
        logging.getLogger("icefloe").removeHandler(records)
        parent.close()
        serving.join(timeout=10)
    assert not serving.is_alive()  # EOF ends it


def test_tickets_collect_their_own_reply_and_skip_one_nobody_waits_for(tmp_path):
    job = JobCreate.model_validate({"sub_job_configs": [TRAINING]})
    specs = sub_job_specs("tickets", job)
    sub_job_id = specs[0].sub_job_id
    host = ProcessEngineHost(specs, {sub_job_id: "cpu"}, {})
    host.start(lambda message: None)
    try:
        first = host.send(sub_job_id, "step", sub_job_id, None)  # its request was dropped: never waited for
        second = host.send(sub_job_id, "step", sub_job_id, None)
        assert host.wait(sub_job_id, second)["global_step"] == 2  # both ran, in order; the first reply is skipped
        assert host.step(sub_job_id, None)["global_step"] == 3
        with pytest.raises(InvalidRequestError, match="learning_rate must be >= 0"):
            host.wait(sub_job_id, host.send(sub_job_id, "step", sub_job_id, -1.0))
        assert first < second
    finally:
        host.close()
    assert host.exit_code == 0


@contextlib.contextmanager
def _served_host(engines: object) -> Iterator[ProcessEngineHost]:
    """A ProcessEngineHost whose sub-job ``t`` talks over a real pipe to ``_serve`` on a thread."""
    host = ProcessEngineHost([SimpleNamespace(sub_job_id="t")], {}, {})
    parent, child = multiprocessing.Pipe()
    host._pipes = {"t": parent}
    serving = threading.Thread(target=_serve, args=(engines, child, _CallRecords()), daemon=True)
    serving.start()
    try:
        yield host
    finally:
        parent.close()
        serving.join(timeout=10)
        child.close()


class _SlowEngines:
    """Stands in for the engines behind ``_serve``: each forward takes a while and answers 4 MiB."""

    def __init__(self) -> None:
        self.ran: list[int] = []

    def forward(self, sub_job_id: str, batch: dict) -> dict:
        self.ran.append(int(batch["tag"]))
        time.sleep(0.05)
        return {"logprobs": torch.zeros(1 << 20), "tag": int(batch["tag"])}


def test_large_calls_and_replies_in_both_directions_at_once_never_deadlock_the_pipe():
    """The service writes the op queued behind (4 MiB) while the engine writes the reply of the one
    in front (4 MiB): each side must keep reading, or both wait on each other for good."""
    engines = _SlowEngines()
    with _served_host(engines) as host:
        worker = RoleWorker("t", linger_s=0.0)
        release = threading.Event()
        try:
            worker.submit(release.wait, 5)  # a save still running: the forwards queue behind it

            def forward(tag: int):
                batch = {"tag": tag, "ids": torch.zeros(1 << 19, dtype=torch.int64)}  # 4 MiB
                send_ahead, call = queued_call(host, "t", "forward", batch)
                return worker.submit_ahead(send_ahead, lambda: call()["tag"])

            futures = [forward(tag) for tag in range(3)]
            release.set()
            assert [f.result(timeout=20) for f in futures] == [0, 1, 2]
            assert engines.ran == [0, 1, 2]
        finally:
            worker.close()


class _SmallReplies:
    def forward(self, sub_job_id: str, batch: dict) -> dict:
        time.sleep(batch.get("sleep", 0.0))
        return {"logprobs": torch.zeros(8192)}  # ~32 KiB: written by the serving thread itself


def test_a_stopping_job_interrupts_its_pipes_so_teardown_never_waits_on_them():
    """Ops handed ahead are skipped once the job stops, so nobody reads their replies: the engine
    blocks writing them and stops reading, while the service blocks sending a large op behind."""
    with _served_host(_SmallReplies()) as host:
        worker = RoleWorker("t", linger_s=0.0)
        stopping = threading.Event()

        def submit(batch: dict) -> None:
            send_ahead, call = queued_call(host, "t", "forward", batch)
            worker.submit_ahead(
                lambda: None if stopping.is_set() else send_ahead(), lambda: None if stopping.is_set() else call()
            )

        submit({"sleep": 0.5})  # the engine is busy: everything behind waits in the pipe
        for _ in range(20):
            submit({"ids": torch.zeros(16)})
        submit({"ids": torch.zeros(1 << 20)})  # 8 MiB: the sender blocks writing it
        time.sleep(0.2)
        stopping.set()
        host.interrupt()  # what JobManager._teardown does for an engine process
        closing = threading.Thread(target=worker.close, daemon=True)
        closing.start()
        closing.join(10)
        assert not closing.is_alive(), "worker.close() still blocked on the engine pipe"
