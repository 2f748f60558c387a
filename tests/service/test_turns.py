"""The one ordering rule (``Turns``) both APIs use: numbers in order, refusals count as used, gaps time out."""

from __future__ import annotations

import asyncio

import pytest

from icefloe.service.turns import Turns

pytestmark = pytest.mark.anyio


async def test_a_number_waits_for_every_number_before_it_even_those_used_out_of_order():
    turns = Turns(gap_timeout_s=30, first=1)
    third = asyncio.ensure_future(turns.wait(3))
    turns.use(2)  # refused ahead of its turn: used, but 1 is still missing
    await asyncio.sleep(0.01)
    assert not third.done() and turns.next == 1
    turns.use(1)
    assert await third is None and turns.next == 3


async def test_past_the_gap_the_lowest_waiter_gives_up_the_stream_skips_the_gap_and_a_late_number_is_refused():
    turns = Turns(gap_timeout_s=0.1)
    turns.use(0)
    fourth, third = asyncio.ensure_future(turns.wait(4)), asyncio.ensure_future(turns.wait(3))
    assert await third == 1  # 1 and 2 never came: 3 gives up, and counts as used
    assert await fourth is None and turns.next == 4
    assert turns.late(2) and not turns.late(2)  # refused once; a resend after that is a new call
    assert not turns.late(3)  # used, not skipped: a resend passes at once
    assert await turns.wait(3) is None


async def test_the_gap_timeout_restarts_whenever_the_stream_moves():
    turns = Turns(gap_timeout_s=0.3)
    waiting = asyncio.ensure_future(turns.wait(3))
    for number in range(3):  # each step comes within the timeout, the whole chain does not
        await asyncio.sleep(0.2)
        turns.use(number)
    assert await waiting is None and not turns.busy


async def test_a_number_past_the_window_is_beyond_and_skipped_numbers_are_kept_as_ranges():
    """A number 30M ahead made the stream hold a set of every number it skipped (+1.7 GB)."""
    turns = Turns(gap_timeout_s=0.05, window=1000)
    assert turns.beyond(1001) and not turns.beyond(1000)
    turns.use(500)  # refused ahead of its turn: used, so not skipped
    assert await turns.wait(1000) == 0
    assert turns._skipped == [(0, 500), (501, 1000)] and turns.next == 1001
    assert turns.late(250) and not turns.late(250) and turns.late(999) and not turns.late(500)
    assert turns._skipped == [(0, 250), (251, 500), (501, 999)]
    assert not turns.beyond(2001) and turns.beyond(2002)  # the window moves with the stream
