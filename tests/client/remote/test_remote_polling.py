"""Polling backoff math and the three result forms, driven without a network."""

from __future__ import annotations

import time

import pytest

from icefloe import wire
from icefloe.client.remote.exchange import Call, Reply, Sleep
from icefloe.client.remote.polling import Backoff, decode_result, poll_request
from icefloe.protocol import ChunkDigestError, IcefloeTimeoutError, RequestFailedError


def test_backoff_grows_by_multiplier_and_caps():
    intervals = Backoff(0.5, 1.25, 6.0).intervals()
    got = [next(intervals) for _ in range(15)]
    assert got[:4] == pytest.approx([0.5, 0.625, 0.78125, 0.9765625])
    assert max(got) == 6.0 and got[-1] == 6.0


def test_backoff_never_sleeps_past_the_deadline():
    deadline = time.monotonic() + 0.3
    sleeps = Backoff(1.0, 2.0, 10.0).sleeps(deadline)
    assert next(sleeps) <= 0.3


def _drive(exchange, replies):
    """Feed canned poll bodies; record what the exchange asked for."""
    asked, value = [], None
    try:
        step = next(exchange)
        while True:
            asked.append(step)
            step = exchange.send(Reply(200, replies.pop(0)) if isinstance(step, Call) else None)
    except StopIteration as stop:
        value = stop.value
    return asked, value


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


def test_poll_request_backs_off_until_done_and_returns_plain_json():
    asked, value = _drive(
        poll_request("j", "r", what="step", backoff=Backoff(0.01, 2.0, 0.04), timeout_s=30),
        [_body("pending"), _body("running"), _body("REQUEST_STATE_DONE", result={"global_steps": 3})],
    )
    assert value == {"global_steps": 3}
    assert [round(s.seconds, 3) for s in asked if isinstance(s, Sleep)] == [0.01, 0.02]


def test_poll_request_uses_long_poll_without_sleeping():
    asked, value = _drive(
        poll_request("j", "r", what="step", backoff=Backoff(), timeout_s=30, long_poll_s=0.0001),
        [_body("done", result={"ok": 1})],
    )
    assert asked[0].params == {"wait": "0.000"} and value == {"ok": 1}


def test_poll_request_drains_result_chunks_by_cursor():
    frame = wire.encode({"logprobs": [1.0] * 5000, "tag": "x"})
    events = wire.result_chunk_events(frame, max_bytes=20000)
    assert len(events) > 1
    pages = [
        _body("done", events=[e], next_cursor=str(i + 1) if i + 1 < len(events) else "") for i, e in enumerate(events)
    ]
    asked, value = _drive(poll_request("j", "r", what="forward", backoff=Backoff(), timeout_s=30), pages)
    assert value["tag"] == "x" and len(value["logprobs"]) == 5000
    assert [c.params.get("cursor") for c in asked[1:]] == [str(i) for i in range(1, len(events))]
    assert not any(isinstance(s, Sleep) for s in asked)


def test_decode_result_checks_chunk_digest():
    frame = wire.encode({"x": 1})
    event = dict(wire.result_chunk_events(frame, max_bytes=1 << 20)[0], payload_sha256="0" * 64)
    with pytest.raises(ChunkDigestError):
        decode_result({}, [event])


def test_decode_result_reads_inline_envelope_and_empty_success():
    torch = pytest.importorskip("torch")
    envelope = wire.inline_result({"logprobs": torch.ones(2, 3)})
    assert decode_result(envelope, [])["logprobs"].shape == (2, 3)
    assert decode_result({}, []) == {}


def test_poll_request_raises_with_the_service_error():
    with pytest.raises(RequestFailedError, match="step failed: engine exploded"):
        _drive(
            poll_request("j", "r", what="step", backoff=Backoff(), timeout_s=30),
            [_body("failed", error="engine exploded")],
        )


def test_poll_request_times_out_with_a_typed_error():
    with pytest.raises(IcefloeTimeoutError, match="still running"):
        _drive(
            poll_request("j", "r", what="step", backoff=Backoff(0.001, 1.0, 0.001), timeout_s=0.01),
            [_body("running")] * 10_000,
        )


def _transport_with_job():
    from icefloe.client.remote.jobs import MANAGED_OPS, JobRef, ServiceInfo
    from icefloe.client.transports.remote import RemoteTransport
    from icefloe.config import ClientConfig

    transport = RemoteTransport(ClientConfig.build(backend={"type": "remote", "base_url": "http://127.0.0.1:9"}))
    transport._job = JobRef("j", {"training": ["j:training:0"], "sampling": ["j:sampling:0"]})
    transport._service = ServiceInfo(managed=True, ops=MANAGED_OPS)
    return transport


def test_operation_inline_answer_is_the_result_for_inline_types_only():
    transport = _transport_with_job()
    asked, value = _drive(transport._operation("reset-prefix-cache", {"drain": True}), [{"status": "ok"}])
    assert value == {"status": "ok"} and asked[0].json["operation_type"] == "reset-prefix-cache"
    with pytest.raises(RequestFailedError, match="without a request_id"):
        _drive(transport._operation("weight-sync", {}), [{"status": "ok"}])
    transport.close()


def test_operation_weight_sync_routes_to_the_training_sub_job_and_polls():
    from icefloe.protocol import Request

    transport = _transport_with_job()
    asked, value = _drive(
        transport._exchange(Request("weight-sync", "training", {"cuda_ipc": False})),
        [{"request_id": "r", "job_id": "j"}, _body("done", result={"policy_version": 2})],
    )
    post = asked[0]
    assert (post.path, post.json["sub_job_id"], post.json["sub_job_type"]) == (
        "/j/operation",
        "j:training:0",
        "training",
    )
    assert post.json["payload"] == {
        "source_sub_job_id": "j:training:0",
        "target_sub_job_ids": ["j:sampling:0"],
        "weight_format": "vllm",
    }
    assert post.idempotency_key and value == {"policy_version": 2}
    transport.close()


def test_poll_request_reads_an_answer_the_post_carried_without_polling():
    asked, value = _drive(
        poll_request(
            "j",
            "r",
            what="step",
            backoff=Backoff(),
            timeout_s=30,
            long_poll_s=5.0,
            answered=_body("done", result={"global_step": 2}),
        ),
        [],
    )
    assert asked == [] and value == {"global_step": 2}


def test_poll_request_long_polls_at_once_when_the_posts_wait_ran_out():
    asked, value = _drive(
        poll_request(
            "j", "r", what="step", backoff=Backoff(), timeout_s=30, long_poll_s=5.0, answered=_body("pending")
        ),
        [_body("done", result={"global_step": 2})],
    )
    assert value == {"global_step": 2}
    assert [type(step) for step in asked] == [Call] and "wait" in asked[0].params
