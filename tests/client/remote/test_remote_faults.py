"""Fault injection between the client and a real service: retries never execute an op twice, never hang.

Counts come from the service's own SQLite store (one row per executed request).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from icefloe.client import AsyncClient, Client, build_batch
from icefloe.client.transports.remote import RemoteTransport
from icefloe.protocol import (
    ChunkGroupConflictError,
    ChunkGroupMissingChunksError,
    ChunkGroupRestartError,
    IcefloeTimeoutError,
    InvalidRequestError,
    RequestFailedError,
)

from .conftest import serve
from .remote_faults import Faults, Rule

_JOB = r"/cortex-training/[0-9a-f-]+"


@pytest.fixture(scope="module")
def gap_service(tmp_path_factory):
    """A service on which a numbered POST waits for a missing number 5 s, not 30, before it is refused."""
    yield from serve(tmp_path_factory, sequence_gap_timeout_s=5.0)


def _client(service, faults: Faults, **backend) -> Client:
    config = service.config(**backend)
    return Client(config, transport=RemoteTransport(config, wrap_http_transport=faults.wrap))


def _big_batch(rows: int = 8, width: int = 64) -> dict:
    """A batch whose DSSST1 frame spans several request chunks at a small POST cap."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 14, (4,), generator=generator).tolist() for _ in range(rows)]
    responses = [torch.randint(1, 14, (width - 4,), generator=generator).tolist() for _ in range(rows)]
    return build_batch(prompts, responses, [float(i % 2) - 0.5 for i in range(rows)], pad_id=0)


def test_remote_lost_responses_are_retried_exactly_once(service):
    """Submit-then-poll: long_poll_s=0 turns off ?wait=, so every op is polled with GETs."""
    faults = Faults(
        Rule("POST", r"/cortex-training/?$", "drop_response"),  # create job
        Rule("POST", _JOB + "/forward-backward$", "drop_response"),
        Rule("POST", _JOB + "/step$", "drop_response"),
        Rule("POST", _JOB + "/generate$", "drop_response"),
        Rule("POST", _JOB + "/operation$", "drop_response"),  # weight-sync
        Rule("GET", _JOB + "/requests/", "drop_response", times=2),
    )
    jobs_before = len(service.app.state.db.fetch_all("SELECT job_id FROM jobs"))
    with _client(service, faults, long_poll_s=0) as client:
        client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
        assert client.step()["global_step"] == 1
        assert len(client.generate([[1, 2, 3]], {"max_tokens": 2, "seed": 0})) == 1
        assert client.sync_weights()["policy_version"] == 1
        counts = service.request_counts(client.handle()["transport"]["job_id"])
    assert all(rule.hits == rule.times for rule in faults.rules)
    assert counts == {"forward-backward": 1, "step": 1, "generate": 1, "weight-sync": 1}
    assert len(service.app.state.db.fetch_all("SELECT job_id FROM jobs")) == jobs_before + 1


def test_remote_lost_inline_answers_are_replayed_not_rerun(service):
    """A POST?wait= answer lost after the service ran the op: the retry gets the kept answer, with its result."""
    faults = Faults(
        Rule("POST", _JOB + "/forward-backward$", "drop_response"),
        Rule("POST", _JOB + "/step$", "drop_response"),
        Rule("POST", _JOB + "/generate$", "drop_response"),
        Rule("POST", _JOB + "/operation$", "drop_response"),
        Rule("GET", _JOB + "/requests/", "drop_response"),  # must stay unused: no op is polled
    )
    with _client(service, faults) as client:
        assert client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))["loss"] is not None
        assert client.step()["global_step"] == 1
        assert len(client.generate([[1, 2, 3]], {"max_tokens": 2, "seed": 0})) == 1
        assert client.sync_weights()["policy_version"] == 1
        counts = service.request_counts(client.handle()["transport"]["job_id"])
    assert [rule.hits for rule in faults.rules] == [1, 1, 1, 1, 0]
    assert counts == {"forward-backward": 1, "step": 1, "generate": 1, "weight-sync": 1}


def test_remote_503_and_429_before_and_after_the_service_acted(service):
    faults = Faults(
        Rule("POST", _JOB + "/step$", "status:503", times=2),
        Rule("POST", _JOB + "/step$", "status_after:503"),
        Rule("GET", _JOB + "/requests/", "status:429", times=3),
        Rule("POST", _JOB + "/forward-backward$", "status_after:502"),
    )
    with _client(service, faults) as client:
        for expected in (1, 2):
            client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
            assert client.step()["global_step"] == expected
        counts = service.request_counts(client.handle()["transport"]["job_id"])
    assert counts == {"forward-backward": 2, "step": 2}


def test_remote_chunk_upload_cut_midway_resumes_without_double_execution(service):
    faults = Faults(
        Rule("POST", _JOB + "/forward-backward$", "cut_upload", skip=2),
        Rule("POST", _JOB + "/forward-backward$", "drop_response", skip=1),
    )
    with _client(service, faults, max_post_bytes=12_000) as client:
        result = client.fwd_bwd(_big_batch())
        counts = service.request_counts(client.handle()["transport"]["job_id"])
    assert faults.rules[0].hits == 1 and faults.rules[1].hits == 1
    assert result["num_tokens"] > 0 and counts == {"forward-backward": 1}


def test_remote_lost_chunk_group_is_replayed_once_from_chunk_zero(service):
    faults = Faults(Rule("POST", _JOB + "/forward-backward$", "swallow_chunk"))
    with _client(service, faults, max_post_bytes=12_000) as client:
        assert "loss" in client.fwd_bwd(_big_batch())
        counts = service.request_counts(client.handle()["transport"]["job_id"])
    assert counts == {"forward-backward": 1}


def test_remote_second_group_restart_raises_a_typed_error(service):
    # chunk 0 is swallowed on the first try and on the replay: the service never learns the group.
    faults = Faults(
        Rule("POST", _JOB + "/forward-backward$", "swallow_chunk"),
        Rule("POST", _JOB + "/forward-backward$", "swallow_chunk", skip=1),
    )
    with _client(service, faults, max_post_bytes=12_000) as client:
        with pytest.raises(ChunkGroupRestartError) as info:
            client.fwd_bwd(_big_batch())
        assert info.value.status_code == 409 and info.value.code == "chunk_group_restart_required"
        assert service.request_counts(client.handle()["transport"]["job_id"]) == {}


def test_remote_missing_and_conflicting_chunks_raise_typed_errors_without_retry(service):
    faults = Faults(
        Rule("POST", _JOB + "/forward-backward$", "swallow_chunk", skip=1),
        Rule("POST", _JOB + "/forward-backward$", "rehash_chunk", skip=4),
    )
    with _client(service, faults, max_post_bytes=12_000) as client:
        batch = _big_batch()
        with pytest.raises(ChunkGroupMissingChunksError) as missing:
            client.fwd_bwd(batch)  # chunk 1 never arrives; the final one does
        with pytest.raises(ChunkGroupConflictError) as conflict:
            client.fwd_bwd(batch)  # a chunk of the next group names another frame
        assert service.request_counts(client.handle()["transport"]["job_id"]) == {}
    assert (missing.value.status_code, conflict.value.status_code) == (409, 409)
    assert missing.value.code == "chunk_group_missing_chunks"
    assert conflict.value.code == "chunk_group_conflict"


def test_remote_persistent_failures_end_in_typed_errors_not_hangs(service):
    faults = Faults(
        Rule("POST", _JOB + "/step$", "status:503", times=3),
        Rule("POST", _JOB + "/generate$", "timeout", times=3),
    )
    with _client(service, faults, max_retries=2) as client:
        with pytest.raises(RequestFailedError) as info:
            client.step()
        assert info.value.status_code == 503 and info.value.category == "server"
        with pytest.raises(IcefloeTimeoutError):
            client.generate([[1, 2]], {"max_tokens": 2})
        assert service.request_counts(client.handle()["transport"]["job_id"]) == {}


def test_remote_an_op_that_fails_on_the_service_fails_only_its_caller(service):
    config = service.config()

    async def run() -> tuple:
        async with AsyncClient(config) as client:
            good = build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0)
            bad = build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0, loss_fn="grpo", loss_config={"loss_agg_mode": "x"})
            return await asyncio.gather(
                client.fwd_bwd(good), client.fwd_bwd(bad), client.step(), return_exceptions=True
            )

    trained, failed, stepped = asyncio.run(run())
    assert trained["loss"] is not None and stepped["global_step"] == 1
    assert isinstance(failed, InvalidRequestError) and "loss_agg_mode" in str(failed)  # as the engine raised it


def test_remote_an_op_refused_by_the_service_does_not_hold_the_ops_after_it(service):
    config = service.config()

    async def run() -> tuple:
        async with AsyncClient(config) as client:
            await client.open()
            await client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
            no_context = build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0)
            del no_context["context"]  # the service refuses it before queuing
            return await asyncio.gather(client.fwd_bwd(no_context), client.step(), return_exceptions=True)

    refused, stepped = asyncio.run(run())
    assert isinstance(refused, InvalidRequestError) and refused.status_code == 400, refused
    assert "context" in str(refused)
    assert stepped["global_step"] == 1  # the schedule counted it, and it ran


def test_remote_async_retries_lost_responses_exactly_once(service):
    faults = Faults(
        Rule("POST", _JOB + "/forward-backward$", "drop_response", times=2),
        Rule("POST", _JOB + "/step$", "drop_response"),
    )
    config = service.config()

    async def run() -> dict[str, int]:
        transport = RemoteTransport(config, wrap_http_transport=faults.wrap)
        async with AsyncClient(config, transport=transport) as client:
            batch = build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0)
            await asyncio.gather(client.fwd_bwd(batch), client.fwd_bwd(batch))
            assert (await client.step())["global_step"] == 1
            return service.request_counts(transport.handle_info()["job_id"])

    assert asyncio.run(run()) == {"forward-backward": 2, "step": 1}


def test_remote_pipelined_ops_reach_the_service_in_call_order(service):
    """Regression: fwd_bwd and step sent at once raced on two connections; a slow upload let step go first."""
    faults = Faults(Rule("POST", _JOB + "/forward-backward$", "delay", times=2))
    config = service.config(batch_requests=False)  # each op's own POST, so the upload can be held back

    async def run() -> list[dict]:
        transport = RemoteTransport(config, wrap_http_transport=faults.wrap)
        async with AsyncClient(config, transport=transport) as client:
            batch = build_batch([[3, 4, 5]], [[6, 7]], [1.0], pad_id=0)
            first = await asyncio.gather(client.fwd_bwd(batch), client.step())
            second = await asyncio.gather(
                client.fwd_bwd(batch),
                client.step(),
                client.sync_weights(),
                client.generate([[1, 2]], {"max_tokens": 2}),
            )
            rows = service.app.state.db.fetch_all(
                "SELECT op FROM requests WHERE job_id = ? ORDER BY created_at, rowid",
                (transport.handle_info()["job_id"],),
            )
            assert [row["op"] for row in rows] == [
                "forward-backward",
                "step",
                "forward-backward",
                "step",
                "weight-sync",
                "generate",
            ]
            return [first[1], second[1]]

    steps = asyncio.run(run())
    assert all(s["grad_norm"] and s["grad_norm"] > 0 for s in steps)
    assert faults.rules[0].hits == 2  # both uploads were held back, and still went first


def test_remote_an_op_whose_caller_gave_up_is_still_submitted_so_its_number_is_not_left_empty(service):
    """A step's upload is slow and its caller cancels it at once: the step still runs, and the ops
    after it are not held by a gap at its number."""
    faults = Faults(Rule("POST", _JOB + "/step$", "delay"))
    config = service.config()

    async def run() -> tuple[dict, dict[str, int]]:
        transport = RemoteTransport(config, wrap_http_transport=faults.wrap)
        async with AsyncClient(config, transport=transport) as client:
            batch = build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0)
            await client.fwd_bwd(batch)
            abandoned = client.step()
            abandoned.cancel()
            await client.fwd_bwd(batch)
            second = await client.step()
            return second, service.request_counts(transport.handle_info()["job_id"])

    second, counts = asyncio.run(run())
    assert faults.rules[0].hits == 1
    assert second["global_step"] == 2 and counts == {"forward-backward": 2, "step": 2}


def test_remote_ops_sent_behind_an_op_that_never_reached_the_service_still_run(gap_service):
    """Regression: a fwd_bwd whose first chunk could not be sent never sent its number (its last chunk
    carries it), so the service held every later op of the client until each failed with 409 sequence_gap."""
    faults = Faults(Rule("POST", _JOB + "/forward-backward$", "unreachable"))
    config = gap_service.config(max_post_bytes=12_000, max_retries=0)

    async def run() -> tuple[list, dict[str, int]]:
        transport = RemoteTransport(config, wrap_http_transport=faults.wrap)
        async with AsyncClient(config, transport=transport) as client:
            await client.open()
            outcomes = await asyncio.gather(  # the POSTs of the later ops wait on the service for the lost number
                client.fwd_bwd(_big_batch()),
                client.step(),
                client.fwd_bwd(_big_batch()),
                client.step(),
                return_exceptions=True,
            )
            return outcomes, gap_service.request_counts(transport.handle_info()["job_id"])

    (lost, refused, trained, stepped), counts = asyncio.run(run())
    assert isinstance(lost, RequestFailedError) and "cannot connect" in str(lost), lost
    assert isinstance(refused, InvalidRequestError) and "needs a fwd_bwd" in str(refused)  # let in, in its turn
    assert "loss" in trained and stepped["global_step"] == 1
    assert faults.rules[0].hits == 1 and counts == {"forward-backward": 1, "step": 2}


def test_remote_a_failed_op_whose_number_could_not_be_spent_either_does_not_hold_the_next_op(gap_service):
    faults = Faults(
        Rule("POST", _JOB + "/forward-backward$", "unreachable"),
        Rule("POST", _JOB + ":heartbeat$", "unreachable"),  # the POST that spends the failed op's number
    )
    with _client(gap_service, faults, max_post_bytes=12_000, max_retries=0) as client:
        with pytest.raises(RequestFailedError, match="cannot connect"):
            client.fwd_bwd(_big_batch())
        assert "loss" in client.fwd_bwd(_big_batch())  # its number waited for the one spent just before it
        assert client.step()["global_step"] == 1
    assert [rule.hits for rule in faults.rules] == [1, 1]


@pytest.mark.timeout(120)
def test_after_a_service_restart_the_clients_next_op_fails_with_the_jobs_reason(tmp_path, caplog):
    """It waited 30 s for POST 0 of a session the restarted service never knew (SequenceGapError), and
    closing then logged "could not cancel job": the job's reason (resume from checkpoint ...) never came."""
    import socket

    from icefloe.protocol import ConflictError, SequenceGapError
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.hosts.slots import SlotPool
    from icefloe.service.settings import ServeSettings

    from .conftest import Service

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    def app():
        return create_app(ServeSettings(data_dir=tmp_path, engines="local"), pool=SlotPool("cpu", 4))

    with ServerThread(app(), port=port) as base_url:
        client = Client(Service(base_url, None, tmp_path).config()).open()
        client.fwd_bwd(build_batch([[3, 4]], [[5, 6]], [1.0], pad_id=0))
        client.step()
        client.save_checkpoint()
    with ServerThread(app(), port=port), caplog.at_level("WARNING", logger="icefloe.client.remote"):
        restarted = r"is failed \(service restarted; resume from checkpoint global_step1 "
        with pytest.raises(ConflictError, match=restarted) as info:
            client.step()
        assert not isinstance(info.value, SequenceGapError)
        client.shutdown()
    assert not [r.getMessage() for r in caplog.records if "could not cancel" in r.getMessage()]
