"""OpBatcher's grouping rules, with recording send functions in place of HTTP (the end-to-end path
runs against a real service in tests/client/remote)."""

from __future__ import annotations

import asyncio

import pytest

from icefloe.client.remote.batching import OpBatcher
from icefloe.client.remote.ordering import RoleTurns, Turn
from icefloe.protocol import OP_FWD_BWD, OP_STEP, TARGET_TRAINING, Request, RequestFailedError


def _op(op: str, tag: int) -> Request:
    return Request(op, TARGET_TRAINING, {"tag": tag})


class Recorder:
    def __init__(self, *, fail_tags: frozenset[int] = frozenset(), refuse: bool = False) -> None:
        self.sent: list[list[int]] = []
        self.fail_tags, self.refuse = fail_tags, refuse
        self.turns = RoleTurns()

    def batcher(self, **limits: int) -> OpBatcher:
        return OpBatcher(
            self.send_one,
            self.send_many,
            lambda: self.turns.take((TARGET_TRAINING,), numbered=True),
            max_ops=limits.get("max_ops", 64),
            max_bytes=limits.get("max_bytes", 1 << 20),
        )

    async def send_one(self, request: Request, turn: Turn) -> int:
        turn.release()
        self.sent.append([request.body["tag"]])
        return request.body["tag"]

    async def send_many(self, requests: list[Request], turn: Turn) -> list[tuple[bool, object]]:
        turn.release()
        self.sent.append([r.body["tag"] for r in requests])
        if self.refuse:
            raise RequestFailedError("refused as a whole", category="user")
        failed = {tag: RequestFailedError(f"op {tag} failed") for tag in self.fail_tags}
        return [(False, failed[t]) if t in failed else (True, t) for t in (r.body["tag"] for r in requests)]


def test_ops_called_in_one_turn_share_a_post_and_later_ones_start_another() -> None:
    recorder = Recorder()

    async def main() -> list:
        batcher = recorder.batcher()
        first = [asyncio.ensure_future(batcher.submit(_op(OP_FWD_BWD, i), 10)) for i in range(3)]
        await asyncio.sleep(0)  # their first steps run: all three join one batch
        second = asyncio.ensure_future(batcher.submit(_op(OP_STEP, 3), 0))
        return await asyncio.gather(*first, second)

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert recorder.sent == [[0, 1, 2], [3]]


@pytest.mark.parametrize(("limits", "expected"), [({"max_ops": 2}, [[0, 1], [2]]), ({"max_bytes": 25}, [[0, 1], [2]])])
def test_a_batch_is_split_at_its_limits(limits: dict, expected: list) -> None:
    recorder = Recorder()

    async def main() -> list:
        batcher = recorder.batcher(**limits)
        return await asyncio.gather(*(batcher.submit(_op(OP_FWD_BWD, i), 10) for i in range(3)))

    assert asyncio.run(main()) == [0, 1, 2]
    assert recorder.sent == expected


def test_seal_keeps_a_later_op_out_of_an_earlier_batch() -> None:
    recorder = Recorder()

    async def main() -> None:
        batcher = recorder.batcher()

        async def calls() -> list:
            early = asyncio.ensure_future(batcher.submit(_op(OP_FWD_BWD, 0), 0))
            await asyncio.sleep(0)
            batcher.seal()  # what a non-batchable op (save, sync) does when it is called
            late = asyncio.ensure_future(batcher.submit(_op(OP_STEP, 1), 0))
            return await asyncio.gather(early, late)

        assert await calls() == [0, 1]

    asyncio.run(main())
    assert recorder.sent == [[0], [1]]


def test_an_op_that_failed_on_the_service_fails_only_its_caller() -> None:
    recorder = Recorder(fail_tags=frozenset({1}))

    async def main() -> list:
        batcher = recorder.batcher()
        return await asyncio.gather(*(batcher.submit(_op(OP_FWD_BWD, i), 0) for i in range(3)), return_exceptions=True)

    ok0, failed, ok2 = asyncio.run(main())
    assert (ok0, ok2) == (0, 2) and isinstance(failed, RequestFailedError) and "op 1" in str(failed)


def test_a_refused_post_fails_every_op_in_it() -> None:
    recorder = Recorder(refuse=True)

    async def main() -> list:
        batcher = recorder.batcher()
        return await asyncio.gather(*(batcher.submit(_op(OP_STEP, i), 0) for i in range(2)), return_exceptions=True)

    assert all(isinstance(r, RequestFailedError) and "refused" in str(r) for r in asyncio.run(main()))


def test_a_caller_cancelled_before_the_post_leaves_is_not_sent() -> None:
    recorder = Recorder()

    async def main() -> int:
        batcher = recorder.batcher()
        cancelled = asyncio.ensure_future(batcher.submit(_op(OP_FWD_BWD, 0), 0))
        kept = asyncio.ensure_future(batcher.submit(_op(OP_STEP, 1), 0))
        await asyncio.sleep(0)
        cancelled.cancel()
        return await kept

    assert asyncio.run(main()) == 1
    assert recorder.sent == [[1]]


@pytest.mark.parametrize(
    ("events", "skipped"),
    [((), True), (("written",), False), (("written", "lost"), True), (("written", "lost", "written"), False)],
)
def test_a_numbered_op_given_up_is_skipped_only_if_its_last_attempt_never_went_out(
    events: tuple, skipped: bool
) -> None:
    """A POST already written reaches the service, which uses its number itself; a skip sent for it
    could get in while its body still uploads and let the ops behind it overtake it. An attempt that
    failed (a dropped connection, a 503 the service keeps the place for) needs the skip again."""
    reported: list[str] = []

    async def main() -> None:
        turn = RoleTurns(on_unanswered=reported.append).take((TARGET_TRAINING,), numbered=True)
        for event in events:
            getattr(turn, event)()
        turn.given_up()
        turn.release()

    asyncio.run(main())
    assert bool(reported) is skipped
