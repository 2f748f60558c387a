"""Client and AsyncClient over the local transport (real torch, tiny:arith): order, merging, lifecycle,
as a caller sees them. ``RecordingLocal`` is the real transport plus a list of what it was handed;
``FakeTransport`` is kept for the one fault nothing real makes on demand (an open that fails once)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

import pytest

from icefloe.client import AsyncClient, Client, build_batch
from icefloe.client.transports.fake import FakeTransport
from icefloe.client.transports.local import LocalTransport
from icefloe.config import ClientConfig
from icefloe.protocol import (
    OP_FWD_BWD,
    OP_GENERATE,
    OP_STEP,
    OP_WEIGHT_SYNC,
    ClientClosedError,
    InvalidRequestError,
    Request,
    RequestFailedError,
)

PAD_ID = 0
BATCH = build_batch([[3, 4, 5], [3, 4, 5]], [[6, 7], [8]], [1.0, -1.0], pad_id=PAD_ID)  # ids of tiny:arith's 19
GREEDY = {"max_tokens": 4, "temperature": 0.0}


class RecordingLocal(LocalTransport):
    """The local transport, keeping each request it is handed in call order."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.requests: list[Request] = []

    def handle(self, request: Request) -> Future:
        self.requests.append(request)
        return super().handle(request)


def _worker_threads() -> list[str]:
    """The engine host's role workers still alive (``icefloe-training``, ``icefloe-sampling``, ...)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("icefloe-") and t.name != "icefloe-fake-io"]


@pytest.fixture
def transport(tmp_path) -> RecordingLocal:
    config = {
        "model": "tiny:arith",
        "seed": 0,
        "training": {"optimizer": {"lr": 1e-2}, "checkpoint_dir": str(tmp_path)},
    }
    return RecordingLocal(ClientConfig.build(config))


def test_async_ops_called_before_open_keep_their_call_order(transport):
    async def run() -> list:
        client = AsyncClient(transport=transport)
        done = await asyncio.gather(
            client.fwd_bwd(BATCH), client.step(), client.sync_weights(), client.fwd_bwd(BATCH), client.step()
        )
        await client.shutdown()
        return done

    _, first, synced, _, second = asyncio.run(run())
    assert [first["global_step"], second["global_step"]] == [1, 2]
    assert synced["policy_version"] == 1  # it ran after the first step and before the second
    assert [r.op for r in transport.requests] == [OP_FWD_BWD, OP_STEP, OP_WEIGHT_SYNC, OP_FWD_BWD, OP_STEP]
    assert not _worker_threads()  # closed with the client


def test_async_op_is_handed_over_when_called_not_when_awaited(transport):
    async def run() -> dict:
        async with AsyncClient(transport=transport) as client:
            gradients = client.fwd_bwd(BATCH)
            pending = client.step()
            assert [r.op for r in transport.requests] == [OP_FWD_BWD, OP_STEP]  # before any await
            stepped = await pending  # awaited first: it still runs after the fwd_bwd called before it
            await gradients
            return stepped

    stepped = asyncio.run(run())
    assert stepped["global_step"] == 1 and stepped["grad_norm"] > 0


def test_gathered_generates_travel_as_one_request_and_each_caller_gets_its_own_samples(transport):
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]

    async def run() -> tuple[list, list]:
        async with AsyncClient(transport=transport) as client:
            merged = await asyncio.gather(
                client.generate([prompts[0]], {**GREEDY, "n": 2}),
                client.generate(prompts[1:], {"max_tokens": 4}),
                client.generate([prompts[2]], {"n": 3, "max_tokens": 2}),
            )
            alone = [await client.generate([prompt], GREEDY) for prompt in prompts[:2]]
            return merged, alone

    (first, second, third), alone = asyncio.run(run())
    assert [s["token_ids"] for s in first] == [alone[0][0]["token_ids"]] * 2  # greedy: the prompt's own answer
    assert len(second) == 2 and len(third) == 3 and all(len(s["token_ids"]) <= 2 for s in third)
    assert [len(r.body["prompts"]) for r in transport.requests[:1]] == [4]  # one request for the three calls
    assert [r.op for r in transport.requests] == [OP_GENERATE] * 3


def test_an_op_called_between_generates_keeps_its_place(transport):
    async def run() -> list:
        async with AsyncClient(transport=transport) as client:
            await client.fwd_bwd(BATCH)
            await client.step()
            return await asyncio.gather(
                client.generate([[3, 4]], GREEDY), client.sync_weights(), client.generate([[3, 4]], GREEDY)
            )

    before, synced, after = asyncio.run(run())
    assert [before[0]["policy_version"], synced["policy_version"], after[0]["policy_version"]] == [0, 1, 1]
    assert [(r.op, r.body.get("prompts")) for r in transport.requests[2:]] == [
        (OP_GENERATE, [[3, 4]]),
        (OP_WEIGHT_SYNC, None),
        (OP_GENERATE, [[3, 4]]),
    ]


def test_a_merged_generate_refused_for_one_prompt_fails_only_its_caller(transport):
    async def run() -> list:
        async with AsyncClient(transport=transport) as client:
            return await asyncio.gather(
                client.generate([[3]], GREEDY),
                client.generate([[4, 99]], GREEDY),  # 99 is outside tiny:arith's vocabulary
                client.generate([[5]], GREEDY),
                return_exceptions=True,
            )

    good, bad, other = asyncio.run(run())
    assert not isinstance(good, BaseException) and not isinstance(other, BaseException), (good, other)
    assert len(good) == 1 and len(other) == 1
    assert isinstance(bad, InvalidRequestError) and "prompts[0] holds token ids outside" in str(bad)  # its own index


def test_a_sampler_op_does_not_wait_behind_a_training_op_in_flight(transport):
    """Each role has its own ordered worker: a short generate sent after a long fwd_bwd is not held behind it."""
    rows = 256
    long_batch = build_batch([[3, 4, 5] * 10] * rows, [[6, 7] * 15] * rows, [1.0, -1.0] * (rows // 2), pad_id=PAD_ID)
    finished: list[str] = []

    async def run() -> None:
        async with AsyncClient(transport=transport) as client:
            await client.generate([[3]], {"max_tokens": 1})  # both roles warm
            training = client.fwd_bwd(long_batch)
            training.add_done_callback(lambda _: finished.append("fwd_bwd"))
            await asyncio.sleep(0)
            sampled = await client.generate([[3]], {"max_tokens": 1})
            finished.append("generate")
            assert len(sampled) == 1
            await training

    asyncio.run(run())
    assert finished == ["generate", "fwd_bwd"]


def test_shutdown_is_idempotent_and_later_ops_say_why_they_fail(transport):
    client = Client(transport=transport)
    client.fwd_bwd(BATCH)
    assert client.step()["global_step"] == 1
    client.shutdown()
    client.shutdown()
    assert client.closed
    with pytest.raises(ClientClosedError, match="shut down"):
        client.step()
    with pytest.raises(InvalidRequestError, match="learning_rate"):
        Client(transport=transport).step(learning_rate=-1.0)  # refused before any transport is asked
    assert not _worker_threads()


def _answer(request: Request) -> dict:
    return {"global_step": 1} if request.op == OP_STEP else {}


def test_a_failed_open_fails_the_ops_waiting_on_it_and_a_later_open_tries_again():
    class FlakyOpen(FakeTransport):
        def __init__(self) -> None:
            super().__init__(_answer)
            self.failures = 1

        def open(self) -> None:
            if self.failures:
                self.failures -= 1
                raise RequestFailedError("service not up yet")
            super().open()

    transport = FlakyOpen()

    async def run() -> dict:
        client = AsyncClient(transport=transport)
        with pytest.raises(RequestFailedError, match="not up yet"):
            await client.step()
        try:
            return await client.step()
        finally:
            await client.shutdown()

    assert asyncio.run(run())["global_step"] == 1
    assert [r.op for r in transport.requests] == ["step"]
