"""``--engines process`` (the default): each job's engines in a child process of their own.

What it must show: the engines really run in another process, a crash there fails that job with
the cause and leaves the service and its other jobs serving, engine log records reach the job's
log, tensors cross the pipe bit for bit, every call gets its own reply however many are in flight,
and a stopping job never waits on its engine process for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import socket
import threading
from collections.abc import Iterator

import pytest
import torch

from icefloe.protocol import ClientClosedError, InvalidRequestError, SamplingParams
from icefloe.service.hosts import process as process_host
from icefloe.service.hosts.process import EngineProcessDied, Pipe, ProcessEngineHost, serve
from icefloe.service.hosts.seam import Progress
from icefloe.service.joblog import JobLogRouter
from icefloe.service.schemas import JobCreate
from icefloe.service.specs import sub_job_specs

from ..faults.serve_process import stop
from .service_batches import canonical_batch, small_batch
from .service_client import SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio


def _host(app, job_id: str) -> ProcessEngineHost:
    host = app.state.jobs.live(job_id).engines
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


async def test_a_large_training_batch_reaches_the_engine_process_out_of_band_and_trains_alike(data_dir, monkeypatch):
    """A batch's tensors from 16 KiB up are written to the engine process's pipe from their own memory (not
    copied into the message); a small batch's ride in it. Both train alike."""
    from icefloe.service.hosts import process

    sent: list[tuple[int, int]] = []  # per message: (head bytes, bytes sent out of band)
    write = process._write

    def recorded(sock, head, buffers):
        sent.append((head.nbytes, sum(buffer.raw().nbytes for buffer in buffers)))
        return write(sock, head, buffers)

    monkeypatch.setattr(process, "_write", recorded)
    small = small_batch()
    copies = 1000  # the same four rows again and again: the same token-mean loss, tensors of ~16-128 KB
    large = {
        **small,
        "kwargs": {name: tensor.repeat(copies, 1) for name, tensor in small["kwargs"].items()},
        "context": {name: tensor.repeat(copies, 1) for name, tensor in small["context"].items()},
    }
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.running(TRAINING)
        losses, largest = [], []
        for batch in (small, large):
            sent.clear()
            accepted = (await api.post_frame(job_id, "forward-backward", batch)).json()
            losses.append((await api.result(job_id, accepted["request_id"]))["loss"])
            largest.append(max(sent, key=lambda message: message[1]))
    large_bytes = sum(t.numel() * t.element_size() for s in ("kwargs", "context") for t in large[s].values())
    assert largest[0][1] == 0  # the small batch: all in the message
    assert largest[1][1] >= large_bytes * 0.8 and largest[1][0] < large_bytes * 0.2, largest
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


async def test_a_killed_engine_process_fails_its_job_and_the_service_keeps_serving(data_dir):
    app = make_app(data_dir)
    async with asgi_client(app) as http:
        api = Api(http)
        doomed = await api.create(TRAINING)
        survivor = await api.create(TRAINING)
        await api.wait_status(doomed, "running")
        await api.wait_status(survivor, "running")
        pid = _host(app, doomed).pid
        os.kill(pid, signal.SIGKILL)  # fault: the OOM killer, a CUDA abort; nothing was running
        job = await api.wait_status(doomed, "failed")  # found dead without waiting for an op to fail
        assert job["reason"].startswith(f"the engine process {pid} was killed by signal 9")
        assert job["reason"].endswith("no checkpoint was saved")
        refused = await api.call("POST", f"/{doomed}/step", json={}, check=False)
        assert refused.status_code == 409
        await api.fwd_bwd(survivor)
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


class _Engines:
    """Stand-in engines behind :func:`serve` on a thread, for faults a real engine cannot make on demand."""

    def __init__(self) -> None:
        self.held, self.release = threading.Event(), threading.Event()
        self.ran: list[int] = []

    def hold(self) -> str:
        self.held.set()
        self.release.wait(30)
        return "held"

    def echo(self, value: object) -> object:
        return value

    def forward(self, tag: int, ids: torch.Tensor) -> dict:
        self.ran.append(tag)
        return {"tag": tag, "logprobs": torch.zeros(1 << 20)}  # 4 MiB back

    def step(self) -> dict:
        logging.getLogger("icefloe.engines.training").warning("odd", extra={"handle": threading.Lock()})
        return {"global_step": 1, "callback": lambda: None}  # neither the result nor the record's extra pickles

    def refuse(self) -> None:
        _STAND_IN_LOG.warning("the batch looks odd")
        raise InvalidRequestError("no such batch")

    def crash(self) -> None:
        raise _Unpicklable("a driver fault")

    def unreadable(self) -> _Unreadable:
        return _Unreadable()


_STAND_IN = "stand-in"  # the sub-job whose pipe leads to the stand-in engines
_STAND_IN_LOG = logging.getLogger("tests.stand-in-engines")


class _Unpicklable(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.handle = threading.Lock()


def _refuse_to_unpickle() -> None:
    raise ValueError("made to fail")


class _Unreadable:
    """Pickles, but never unpickles."""

    def __reduce__(self) -> tuple:
        return _refuse_to_unpickle, ()


@contextlib.contextmanager
def _piped(engines: _Engines) -> Iterator[ProcessEngineHost]:
    """A ProcessEngineHost whose pipe leads to :func:`serve` on a thread (the stand-in engines), over a real
    socket pair, with what the stand-ins log relayed back; call them as sub-job :data:`_STAND_IN`."""
    near, far = socket.socketpair()
    router = JobLogRouter()
    _STAND_IN_LOG.addHandler(router)
    serving = threading.Thread(target=serve, args=(engines, Pipe(far), router), daemon=True)
    serving.start()
    host = ProcessEngineHost([], {}, {})
    host._pipes = {_STAND_IN: Pipe(near)}
    try:
        yield host
    finally:
        engines.release.set()
        host.close()
        serving.join(10)
        far.close()
        _STAND_IN_LOG.removeHandler(router)
    assert not serving.is_alive()  # EOF ends it


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),
        torch.zeros(0, 3),
        torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
        torch.arange(24, dtype=torch.float32).reshape(4, 6)[1:3, ::2],  # a strided view into a larger storage
        torch.randn(2, 3).to(torch.bfloat16),
        torch.tensor(-1.5, dtype=torch.bfloat16),
        torch.zeros(0, 2, dtype=torch.bfloat16),
        torch.randn(2, 3).to(torch.bfloat16).t(),
        torch.tensor([True, False]),
        torch.tensor([-3, 7], dtype=torch.int8),
        torch.tensor([float("nan"), float("inf")], dtype=torch.float64),
        torch.tensor([1.0, 2.0], requires_grad=True),
        torch.tensor([1 + 2j, -3j], dtype=torch.complex64).conj(),
        -torch.tensor([1 + 2j], dtype=torch.complex64).conj().imag,
    ],
    ids=[
        "scalar",
        "empty",
        "strided",
        "view",
        "bfloat16",
        "bfloat16-scalar",
        "bfloat16-empty",
        "bfloat16-strided",
        "bool",
        "int8",
        "non-finite",
        "requires-grad",
        "lazy-conjugate",
        "lazy-negation",
    ],
)
def test_tensors_cross_the_pipe_both_ways_bit_for_bit(tensor):
    with _piped(_Engines()) as host:
        back = host._forward(_STAND_IN, "echo", {"batch": [tensor], "n": 1})["batch"][0]
    assert (back.dtype, back.shape, back.requires_grad) == (tensor.dtype, tensor.shape, tensor.requires_grad)
    as_bytes = [
        t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8) for t in (back, tensor)
    ]
    assert torch.equal(*as_bytes)
    back.detach().zero_()  # its memory is its own, and writable


def test_a_64_mib_tensor_and_the_same_tensor_twice_cross_the_pipe_whole():
    large = torch.randn(16 << 20)
    with _piped(_Engines()) as host:
        back, again = host._forward(_STAND_IN, "echo", (large, large))
    assert torch.equal(back, large) and again is back  # one tensor sent once, as pickle keeps identity


def test_an_engines_error_and_what_it_logged_cross_the_pipe_to_the_caller(caplog):
    with _piped(_Engines()) as host:
        with caplog.at_level(logging.WARNING), pytest.raises(InvalidRequestError, match="no such batch"):
            host._forward(_STAND_IN, "refuse")
        here = threading.current_thread().name  # the stand-in logged it on the thread that serves the pipe
        relayed = [r for r in caplog.records if r.name == _STAND_IN_LOG.name and r.threadName == here]
        assert [(r.levelname, r.getMessage()) for r in relayed] == [("WARNING", "the batch looks odd")]
        with pytest.raises(RuntimeError, match=r"^_Unpicklable: a driver fault$"):  # made portable there
            host._forward(_STAND_IN, "crash")


def test_a_reply_that_cannot_be_pickled_fails_its_call_and_the_pipe_keeps_serving():
    with _piped(_Engines()) as host:
        with pytest.raises(RuntimeError, match="step returned a result that cannot be sent"):
            host._forward(_STAND_IN, "step")
        assert host._forward(_STAND_IN, "echo", 7) == 7


def test_a_message_one_end_cannot_read_fails_its_call_only():
    with _piped(_Engines()) as host:
        with pytest.raises(RuntimeError, match="the reply to unreadable could not be read: made to fail"):
            host._forward(_STAND_IN, "unreadable")
        with pytest.raises(RuntimeError, match="the engine process could not read the call: made to fail"):
            host._forward(_STAND_IN, "echo", _Unreadable())
        assert host._forward(_STAND_IN, "echo", 8) == 8


def test_large_calls_and_replies_of_concurrent_callers_each_reach_their_own_caller():
    """Callers of 4 MiB calls with 4 MiB replies, queued while the engine is busy: if both ends wrote
    at once on full sockets, both would wait on each other for good."""
    engines = _Engines()
    with _piped(engines) as host:
        held = threading.Thread(target=host._forward, args=(_STAND_IN, "hold"), daemon=True)
        held.start()
        assert engines.held.wait(10)  # the engine is busy: the calls below pile up at the pipe
        results: dict[int, int] = {}

        def forward(tag: int) -> None:
            results[tag] = host._forward(_STAND_IN, "forward", tag, torch.zeros(1 << 19, dtype=torch.int64))["tag"]

        callers = [threading.Thread(target=forward, args=(tag,), daemon=True) for tag in range(4)]
        for caller in callers:
            caller.start()
        engines.release.set()
        for caller in [held, *callers]:
            caller.join(30)
            assert not caller.is_alive(), "a call never got its reply"
    assert results == {tag: tag for tag in range(4)}
    assert sorted(engines.ran) == [0, 1, 2, 3]  # each ran exactly once


def test_an_interrupt_fails_the_waiting_call_and_every_later_one_at_once():
    engines = _Engines()
    with _piped(engines) as host:
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                host._forward(_STAND_IN, "hold")
            except ClientClosedError as exc:
                failed.append(exc)

        waiting = threading.Thread(target=wait, daemon=True)
        waiting.start()
        assert engines.held.wait(10)
        host.interrupt()  # what a stopping job does while the engine is busy
        waiting.join(10)
        assert [str(e) for e in failed] == ["the job is stopping; hold was not completed"]
        with pytest.raises(ClientClosedError, match="the job is stopping; echo was not completed"):
            host._forward(_STAND_IN, "echo", 1)


def test_an_engine_process_killed_mid_call_fails_that_call_with_how_it_ended():
    host, sub_job_id = _started_host("killed")
    try:
        stop(host.pid)  # the call below waits for its reply
        failed: list[BaseException] = []

        def call() -> None:
            try:
                host.call(sub_job_id, "step", (None,))
            except EngineProcessDied as exc:
                failed.append(exc)

        waiting = threading.Thread(target=call, daemon=True)
        waiting.start()
        waiting.join(0.2)
        assert waiting.is_alive()
        os.kill(host.pid, signal.SIGKILL)
        waiting.join(30)
        assert [str(e) for e in failed] == [f"the engine process {host.pid} was killed by signal 9 during step"]
    finally:
        host.close()


def test_generate_samples_are_encoded_as_json_in_the_engine_process():
    """A refactor once moved the encoding into the service: 768 samples a demo step crossed the pipe as
    Python objects and were unpickled and encoded there."""
    host, sub_job_id = _started_host("encode", SAMPLING)
    try:
        params = [SamplingParams(max_tokens=3, seed=1)]

        def not_here(*args: object) -> None:
            raise AssertionError("generate ran in the service process")

        host.call = not_here  # type: ignore[method-assign]
        (texts,) = [samples for done in host.generate_many([(sub_job_id, [[1, 2, 3]], params, True, False)])
                    for samples in done.values()]  # fmt: skip
        assert [type(text) for text in texts] == [str]
        assert len(json.loads(texts[0])["token_ids"]) == 3
        with pytest.raises(InvalidRequestError, match="sub-job 'nope' has no engine on this host"):
            list(host.generate_many([("nope", [[1, 2, 3]], params, True, False)]))
    finally:
        host.close()


def test_a_streamed_generate_sends_only_its_new_tokens_across_the_pipe_with_each_slice():
    host, sub_job_id = _started_host("progress", SAMPLING)
    try:
        params = [SamplingParams(max_tokens=60, n=32, seed=2, ignore_eos=True)]
        news: list[Progress] = []
        final = None
        for done in host.generate_many([(sub_job_id, [[1, 2, 3]], params, False, True)]):
            for result in done.values():
                if isinstance(result, Progress):
                    news.append(result)
                else:
                    final = result
        assert news, "no progress came before the result"
        assert final is not None and all(len(step.samples) == 32 for step in news)
        for row in range(32):
            streamed = [token for step in news for token in step.samples[row]["token_ids"]]
            assert 0 < len(streamed) < 60 and streamed == final[row]["token_ids"][: len(streamed)]
    finally:
        host.close()


def _started_host(name: str, sub_job: dict = TRAINING) -> tuple[ProcessEngineHost, str]:
    specs = sub_job_specs(name, JobCreate.model_validate({"sub_job_configs": [sub_job]}))
    sub_job_id = specs[0].sub_job_id
    host = ProcessEngineHost(specs, {sub_job_id: "cpu"}, {})
    host.start(lambda message: None, threading.Event())
    return host, sub_job_id


def test_concurrent_calls_on_one_sub_job_run_once_each_in_order_and_user_errors_keep_it_serving():
    host, sub_job_id = _started_host("calls")
    try:
        batches = [small_batch(seed) for seed in range(3)]
        tokens: dict[int, int] = {}
        callers = [
            threading.Thread(
                target=lambda i=i: tokens.update({i: host.call(sub_job_id, "fwd_bwd", (batches[i],))["num_tokens"]})
            )
            for i in range(3)
        ]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
        assert tokens == {i: int(batch["context"]["loss_mask"].sum()) for i, batch in enumerate(batches)}
        with pytest.raises(InvalidRequestError, match="learning_rate must be >= 0"):
            host.call(sub_job_id, "step", (-1.0,))
        assert host.call(sub_job_id, "step", (None,))["global_step"] == 1
        with pytest.raises(InvalidRequestError, match="step\\(\\) needs a fwd_bwd since the last step"):
            host.call(sub_job_id, "step", (None,))
        host.interrupt()
        with pytest.raises(ClientClosedError, match="the job is stopping; step was not completed"):
            host.call(sub_job_id, "step", (None,))
    finally:
        host.close()
    assert host.exit_code == 0


def test_closing_kills_an_engine_process_that_does_not_exit(monkeypatch):
    monkeypatch.setattr(process_host, "_EXIT_TIMEOUT_S", 0.3)  # how long close waits before it kills
    host, _ = _started_host("stuck")
    stop(host.pid)  # fault: a child wedged in a driver call never exits
    host.close()
    assert host.exit_code == -signal.SIGKILL


@contextlib.contextmanager
def _killed_after(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` now (fault: a driver call that never returns); SIGKILL it whatever the test did."""
    stop(pid)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_a_stream_on_a_stopped_engine_fails_its_job_at_the_op_deadline(data_dir):
    """A stream batch was never watched: the job stayed running, holding its slots, for good."""
    app = make_app(data_dir, op_deadlines_s={"generate-stream": 0.5})
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        pid = _host(app, job_id).pid
        assert pid is not None
        with _killed_after(pid):
            body = json.dumps({"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}}).encode()
            octet = {"content-type": "application/octet-stream"}
            await api.call("POST", f"/{job_id}/generate-stream", content=body, headers=octet)
            job = await api.wait_status(job_id, "failed", timeout_s=30)
        assert job["reason"] == (
            f"generate-stream on {job_id}:sampling:0 did not finish within its deadline of 0.5 s; "
            f"killed the engine process {pid}; no checkpoint was saved"
        )
        assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 0


async def test_cancelling_a_job_whose_engine_process_hangs_while_starting_kills_it(data_dir, monkeypatch):
    """The job thread waited up to 600 s for the engine process: the job stayed cancelling, holding its slot."""
    stopped: list[int] = []
    original = ProcessEngineHost.start

    def start_then_hang(self, on_progress, *rest):  # fault: the child hangs while it loads its engines
        def progress(message: str) -> None:
            if self.pid is not None and not stopped:
                stop(self.pid)
                stopped.append(self.pid)
            on_progress(message)

        return original(self, progress, *rest)

    monkeypatch.setattr(ProcessEngineHost, "start", start_then_hang)
    monkeypatch.setattr(process_host, "_EXIT_TIMEOUT_S", 0.3)  # how long close waits before it kills
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "initializing")
        while not stopped:
            await asyncio.sleep(0.01)
        with _killed_after(stopped[0]):
            assert (await api.call("POST", f"/{job_id}:cancel")).json()["status"] == "cancelling"
            await api.wait_status(job_id, "terminated", timeout_s=30)
            assert (await api.call("GET", "/capacity")).json()["in_use_slots"] == 0
            with pytest.raises(ProcessLookupError):  # killed and reaped before the job said terminated
                os.kill(stopped[0], 0)


async def test_a_weight_sync_deadline_counts_from_its_copy_not_from_waiting_for_queued_generates(data_dir, monkeypatch):
    """The clock started before the sync waited for the samplers to drain: a healthy engine was killed."""
    entered, release = threading.Event(), threading.Event()
    original = ProcessEngineHost.generate_many

    def held_generate(self, batch):  # a long rollout queued ahead of the sync
        entered.set()
        release.wait(60)
        return original(self, batch)

    monkeypatch.setattr(ProcessEngineHost, "generate_many", held_generate)
    deadline_s = 0.5
    app = make_app(data_dir, op_deadlines_s={"weight-sync": deadline_s})
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        rollout = await api.post_frame(job_id, "generate", {"prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}})
        assert await asyncio.to_thread(entered.wait, 30)
        sync = {"operation_type": "weight-sync", "payload": {}}
        sync_id = (await api.call("POST", f"/{job_id}/operation", json=sync)).json()["request_id"]
        waiting = await api.poll(job_id, sync_id, wait=4 * deadline_s)  # well past the deadline, still waiting
        assert waiting["status"] == "running" and (await api.job(job_id))["status"] == "running"
        release.set()
        await api.result(job_id, rollout.json()["request_id"])
        assert (await api.result(job_id, sync_id))["policy_version"] == 0
        assert (await api.job(job_id))["status"] == "running"
        pid = _host(app, job_id).pid
        assert pid is not None
        with _killed_after(pid):  # the copy itself is still watched
            await api.call("POST", f"/{job_id}/operation", json=sync)
            job = await api.wait_status(job_id, "failed", timeout_s=30)
        assert job["reason"].startswith(f"weight-sync on {job_id}:training:0 did not finish within its deadline")
