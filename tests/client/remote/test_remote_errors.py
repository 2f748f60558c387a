"""Error bodies of every shape the training API produces, and the PAT redactor."""

from __future__ import annotations

import json

import pytest

from icefloe.client.remote.errors import (
    Redactor,
    error_from_failed_request,
    error_from_response,
    error_message,
    find_error_code,
)
from icefloe.protocol import (
    ChunkGroupConflictError,
    ChunkGroupMissingChunksError,
    ChunkGroupRestartError,
    ConflictError,
    ExpiredError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
    RequestFailedError,
    SequenceGapError,
    UnauthenticatedError,
    UnsupportedOpError,
)

_GS_WRAPPED = {
    "code": "517604",
    "message": "Cortex training forwardBackward failed: ZMD returned 409: "
    + json.dumps({"detail": {"code": "chunk_group_restart_required", "message": "restart", "chunk_group_id": "g"}}),
}


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"code": "invalid_argument", "message": "bad"}, "invalid_argument"),
        ({"detail": {"code": "chunk_group_conflict", "chunk_group_id": "g"}}, "chunk_group_conflict"),
        (_GS_WRAPPED, "chunk_group_restart_required"),
        (
            {"message": "request chunk group is missing chunks", "chunk_group_id": "g"},
            "chunk_group_missing_chunks",
        ),
        ({"error": "target is not a training sub-job"}, None),
        ({"detail": [{"loc": ["body", "x"], "msg": "field required", "type": "missing"}]}, None),
        ("plain text", None),
    ],
)
def test_find_error_code_searches_nested_and_embedded_json(body, code):
    assert find_error_code(body) == code


def test_find_error_code_stops_at_depth_eight():
    body: object = {"code": "chunk_group_conflict"}
    for _ in range(12):
        body = {"wrapped": json.dumps(body)}
    assert find_error_code(body) is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"code": "x", "message": "the message"}, "the message"),
        ({"error": "load target missing"}, "load target missing"),
        ({"detail": "Not Found"}, "Not Found"),
        ({"detail": [{"loc": ["body", "prompts"], "msg": "field required"}]}, "body.prompts: field required"),
        (None, "HTTP 500"),
    ],
)
def test_error_message_reads_every_shape(body, message):
    assert error_message(body, "HTTP 500") == message


@pytest.mark.parametrize(
    ("body", "error_class"),
    [
        (_GS_WRAPPED, ChunkGroupRestartError),
        ({"code": "chunk_group_conflict", "message": "m"}, ChunkGroupConflictError),
        (
            {"message": "request chunk group is missing chunks", "chunk_group_id": "g"},
            ChunkGroupMissingChunksError,
        ),
        ({"code": "517604", "message": "job is pending"}, RequestFailedError),
    ],
)
def test_error_from_response_types_chunk_group_errors(body, error_class):
    error = error_from_response(409, body, what="forward-backward", request_id="r1", redactor=Redactor())
    assert type(error) is error_class
    assert error.status_code == 409 and error.category == "user" and error.request_id == "r1"


@pytest.mark.parametrize(
    ("status", "code", "error_class"),
    [
        (400, "invalid_argument", InvalidRequestError),
        (401, "unauthenticated", UnauthenticatedError),
        (404, "not_found", NotFoundError),
        (410, "not_found", ExpiredError),
        (409, "conflict", ConflictError),
        (409, "sequence_gap", SequenceGapError),
        (413, "payload_too_large", PayloadTooLargeError),
        (501, "not_implemented", UnsupportedOpError),
        (503, "unavailable", RequestFailedError),
    ],
)
def test_error_from_response_raises_the_class_the_services_code_names(status, code, error_class):
    body = {"code": code, "message": "m"}
    error = error_from_response(status, body, what="step", request_id=None, redactor=Redactor())
    assert type(error) is error_class and (error.status_code, error.code) == (status, code)
    assert str(error).startswith("step failed: m")


@pytest.mark.parametrize(
    ("status", "error", "error_class"),
    [
        ("failed", "InvalidRequestError: processing.config.loss_agg_mode must be one of ...", InvalidRequestError),
        ("failed", "NotFoundError: checkpoint 'x' does not exist", NotFoundError),
        ("failed", "RuntimeError: CUDA out of memory", RequestFailedError),
        ("cancelled", "InvalidRequestError: looks named, but the request was cancelled", RequestFailedError),
    ],
)
def test_error_from_failed_request_raises_the_engines_class_when_named(status, error, error_class):
    raised = error_from_failed_request("fwd_bwd", status, error, request_id="r1")
    assert type(raised) is error_class and str(raised).startswith(f"fwd_bwd {status}: ")


def test_error_from_response_marks_429_and_5xx_as_server_side():
    assert error_from_response(429, {}, what="x", request_id=None, redactor=Redactor()).category == "server"
    assert error_from_response(503, {}, what="x", request_id=None, redactor=Redactor()).category == "server"


def test_redactor_scrubs_the_pat_from_error_messages():
    secret = "pat-SECRET-123"
    error = error_from_response(
        401, {"message": f"token {secret} rejected"}, what="x", request_id=None, redactor=Redactor(secret)
    )
    assert secret not in str(error) and "***" in str(error)
