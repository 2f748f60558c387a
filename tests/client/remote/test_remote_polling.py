"""Polling backoff math and the three result forms, over canned answers."""

from __future__ import annotations

import time

import pytest

from icefloe import wire
from icefloe.client.remote.polling import Backoff, decode_result, poll_request
from icefloe.protocol import ChunkDigestError, IcefloeTimeoutError, RequestFailedError

from .canned import canned


def test_backoff_grows_by_multiplier_and_caps():
    intervals = Backoff(0.5, 1.25, 6.0).sleeps(time.monotonic() + 1000)
    got = [next(intervals) for _ in range(15)]
    assert got[:4] == pytest.approx([0.5, 0.625, 0.78125, 0.9765625])
    assert max(got) == 6.0 and got[-1] == 6.0


def test_backoff_never_sleeps_past_the_deadline():
    deadline = time.monotonic() + 0.3
    sleeps = Backoff(1.0, 2.0, 10.0).sleeps(deadline)
    assert next(sleeps) <= 0.3


def _poll(bodies, **kwargs):
    """The poll's result and the query params of every GET it sent."""
    kwargs = {"what": "step", "backoff": Backoff(0.001, 2.0, 0.004), "timeout_s": 30, **kwargs}
    with canned(*bodies) as (http, seen):
        value = http.run(poll_request(http, "j", "r", **kwargs))
    return value, [dict(request.url.params) for request in seen]


def _body(status, **extra):
    return {
        "request_id": "r",
        "status": status,
        "result": {},
        "error": "",
        "events": [],
        "next_cursor": "",
        **extra,
    }


def test_poll_request_polls_until_done_and_returns_plain_json():
    value, asked = _poll([_body("pending"), _body("running"), _body("REQUEST_STATE_DONE", result={"global_steps": 3})])
    assert value == {"global_steps": 3} and asked == [{}, {}, {}]


def test_poll_request_uses_long_poll():
    value, asked = _poll([_body("done", result={"ok": 1})], long_poll_s=0.0001)
    assert asked == [{"wait": "0.000"}] and value == {"ok": 1}


def test_poll_request_drains_result_chunks_by_cursor():
    frame = wire.encode({"logprobs": [1.0] * 5000, "tag": "x"})
    events = wire.result_chunk_events(frame, max_bytes=20000)
    assert len(events) > 1
    pages = [
        _body("done", events=[e], next_cursor=str(i + 1) if i + 1 < len(events) else "") for i, e in enumerate(events)
    ]
    value, asked = _poll(pages, what="forward")
    assert value["tag"] == "x" and len(value["logprobs"]) == 5000
    assert [params.get("cursor") for params in asked[1:]] == [str(i) for i in range(1, len(events))]


def test_decode_result_checks_chunk_digest():
    frame = wire.encode({"x": 1})
    event = dict(wire.result_chunk_events(frame, max_bytes=1 << 20)[0], payload_sha256="0" * 64)
    with pytest.raises(ChunkDigestError):
        decode_result({}, [event])


def test_decode_result_reads_inline_envelope_and_empty_success():
    import torch

    envelope = wire.inline_result({"logprobs": torch.ones(2, 3)})
    assert decode_result(envelope, [])["logprobs"].shape == (2, 3)
    assert decode_result({}, []) == {}


def test_poll_request_raises_with_the_service_error():
    with pytest.raises(RequestFailedError, match="step failed: engine exploded"):
        _poll([_body("failed", error="engine exploded")])


def test_poll_request_times_out_with_a_typed_error():
    with pytest.raises(IcefloeTimeoutError, match="still running"):
        _poll([_body("running")] * 10_000, backoff=Backoff(0.001, 1.0, 0.001), timeout_s=0.01)


def test_poll_request_reads_an_answer_the_post_carried_without_polling():
    value, asked = _poll([], long_poll_s=5.0, answered=_body("done", result={"global_step": 2}))
    assert asked == [] and value == {"global_step": 2}


def test_poll_request_long_polls_at_once_when_the_posts_wait_ran_out():
    value, asked = _poll([_body("done", result={"global_step": 2})], long_poll_s=5.0, answered=_body("pending"))
    assert value == {"global_step": 2} and "wait" in asked[0]
