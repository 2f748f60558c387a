"""Client and AsyncClient over a ``FakeTransport``: order, merging, lifecycle, as a caller sees them."""

from __future__ import annotations

import asyncio
import threading

import pytest

from icefloe.client import AsyncClient, Client
from icefloe.client.transports.fake import FakeTransport
from icefloe.protocol import OP_GENERATE, OP_STEP, ClientClosedError, InvalidRequestError, Request, RequestFailedError


def _samples(request: Request) -> dict:
    """A generate answer: one sample per prompt per ``n``, named after its prompt."""
    params = request.body["sampling_params"]
    params = params if isinstance(params, list) else [params] * len(request.body["prompts"])
    samples = [
        {"token_ids": list(prompt), "sample": i}
        for prompt, p in zip(request.body["prompts"], params, strict=True)
        for i in range(p.n)
    ]
    return {"results": samples}


def _answer(request: Request) -> dict:
    if request.op == OP_GENERATE:
        if any(len(prompt) > 3 for prompt in request.body["prompts"]):
            raise RequestFailedError("prompt too long", category="user", status_code=400)
        return _samples(request)
    if request.op == OP_STEP:
        return {"global_step": 1}
    return {}


def test_async_ops_called_before_open_keep_their_call_order():
    transport = FakeTransport(_answer)

    async def run() -> None:
        client = AsyncClient(transport=transport)
        done = await asyncio.gather(client.step(), client.sync_weights(), client.step())
        assert [d["global_step"] for d in done[0::2]] == [1, 1]
        await client.shutdown()

    asyncio.run(run())
    assert [r.op for r in transport.requests] == ["step", "weight-sync", "step"]
    assert transport.opened and transport.closed


def test_async_op_is_handed_over_when_called_not_when_awaited():
    transport = FakeTransport(_answer)

    async def run() -> None:
        async with AsyncClient(transport=transport) as client:
            pending = client.step()
            assert [r.op for r in transport.requests] == ["step"]  # before any await
            assert (await pending)["global_step"] == 1

    asyncio.run(run())


def test_gathered_generates_travel_as_one_request_and_each_caller_gets_its_own_samples():
    transport = FakeTransport(_answer)

    async def run() -> list:
        async with AsyncClient(transport=transport) as client:
            return await asyncio.gather(
                client.generate([[1]], {"n": 2}), client.generate([[2], [3]]), client.generate([[4]], {"n": 3})
            )

    first, second, third = asyncio.run(run())
    assert [s["token_ids"] for s in first] == [[1], [1]]
    assert [s["token_ids"] for s in second] == [[2], [3]]
    assert [s["token_ids"] for s in third] == [[4]] * 3
    assert [len(r.body["prompts"]) for r in transport.requests] == [4]


def test_an_op_called_between_generates_keeps_its_place():
    transport = FakeTransport(_answer)

    async def run() -> None:
        async with AsyncClient(transport=transport) as client:
            await asyncio.gather(client.generate([[1]]), client.sync_weights(), client.generate([[2]]))

    asyncio.run(run())
    assert [(r.op, r.body.get("prompts")) for r in transport.requests] == [
        ("generate", [[1]]),
        ("weight-sync", None),
        ("generate", [[2]]),
    ]


def test_a_merged_generate_refused_for_one_prompt_fails_only_its_caller():
    transport = FakeTransport(_answer)

    async def run() -> list:
        async with AsyncClient(transport=transport) as client:
            return await asyncio.gather(
                client.generate([[1]]), client.generate([[1, 2, 3, 4]]), client.generate([[2]]), return_exceptions=True
            )

    good, bad, other = asyncio.run(run())
    assert [s["token_ids"] for s in good] == [[1]] and [s["token_ids"] for s in other] == [[2]]
    assert isinstance(bad, RequestFailedError) and bad.status_code == 400


def test_coroutine_handlers_overlap():
    """The second request releases the first: handled one at a time, this would never finish."""
    released = asyncio.Event()

    async def answer(request: Request) -> dict:
        if request.op == OP_STEP:
            await released.wait()
        else:
            released.set()
        return {"global_step": 1} if request.op == OP_STEP else {}

    async def run() -> list:
        async with AsyncClient(transport=FakeTransport(answer)) as client:
            return await asyncio.wait_for(asyncio.gather(client.step(), client.sync_weights()), timeout=60)

    stepped, synced = asyncio.run(run())
    assert stepped["global_step"] == 1 and synced == {}


def test_shutdown_is_idempotent_and_later_ops_say_why_they_fail():
    transport = FakeTransport(_answer)
    client = Client(transport=transport)
    assert client.step()["global_step"] == 1
    client.shutdown()
    client.shutdown()
    assert transport.closed and client.closed
    with pytest.raises(ClientClosedError, match="shut down"):
        client.step()
    with pytest.raises(InvalidRequestError, match="learning_rate"):
        Client(transport=FakeTransport(_answer)).step(learning_rate=-1.0)
    assert "icefloe-fake-io" not in {thread.name for thread in threading.enumerate()}


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
