"""The error tree is picklable (Ray carries errors) and keeps its stdlib bases."""

import pickle

import pytest

from icefloe import protocol as p


@pytest.mark.parametrize(
    "error",
    [
        p.ConfigError("bad field"),
        p.InvalidRequestError("bad batch"),
        p.FrameFormatError("bad frame"),
        p.ClientClosedError("closed"),
        p.UnsupportedOpError("no forward"),
        p.RequestFailedError("boom", category="user", status_code=400, code="invalid_argument", request_id="r1"),
        p.ChunkGroupConflictError("conflict", status_code=409, code=p.CODE_CHUNK_GROUP_CONFLICT),
        p.JobFailedError("job-1", "failed", "out of memory", {"job-1:training:0": "failed"}),
        p.IcefloeTimeoutError("late"),
    ],
)
def test_errors_round_trip_through_pickle(error):
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert str(clone) == str(error)
    assert vars(clone) == vars(error)


def test_errors_keep_their_stdlib_bases():
    assert issubclass(p.ConfigError, ValueError)
    assert issubclass(p.WireError, ValueError)
    assert issubclass(p.RequestFailedError, RuntimeError)
    assert issubclass(p.UnsupportedOpError, NotImplementedError)
    assert issubclass(p.IcefloeTimeoutError, TimeoutError)
    assert all(issubclass(cls, p.IcefloeError) for cls in (p.ChunkGroupRestartError, p.JobFailedError))


def test_job_failed_message_names_reason_and_sub_jobs():
    error = p.JobFailedError("j", "failed", "model not found", {"j:sampling:0": "failed", "j:training:0": "running"})
    assert str(error) == "job j is failed: model not found (sub-jobs: j:sampling:0=failed, j:training:0=running)"


def test_request_rejects_unknown_ops_and_targets():
    with pytest.raises(p.InvalidRequestError, match=r"Request\.op"):
        p.Request("fly", "training")
    with pytest.raises(p.InvalidRequestError, match=r"Request\.target"):
        p.Request(p.OP_STEP, "moon")


@pytest.mark.parametrize(("raw", "state"), [("JOB_STATE_RUNNING", "running"), ("Failed", "failed"), (7, "7")])
def test_normalize_job_state(raw, state):
    assert p.normalize_job_state(raw) == state


@pytest.mark.parametrize(
    ("raw", "job_type"),
    [("JOB_TYPE_LOG_PROB", "log_probability"), (" Training", "training"), ("logprob", "log_probability"), ("x", "x")],
)
def test_normalize_job_type_reads_every_spelling_of_a_job_type(raw, job_type):
    assert p.normalize_job_type(raw) == job_type
    assert job_type not in p.SEGMENT_BY_JOB_TYPE or p.normalize_job_type(p.SEGMENT_BY_JOB_TYPE[job_type]) == job_type


def test_sampling_params_accept_vllm_logprobs_ints():
    assert p.SamplingParams(logprobs=0).logprobs is True
    assert p.SamplingParams(logprobs=None).logprobs is False
