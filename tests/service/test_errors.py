"""Every malformed call gets its 4xx and exact ``code`` (icefloe.service.errors), never a 500."""

from __future__ import annotations

import json
import pickle

import pytest

from icefloe import wire

from .service_client import PREFIX, SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app

pytestmark = pytest.mark.anyio

JOB = "{job}"
OCTET = "octet"


def _frame(obj) -> bytes:
    return wire.encode(obj)


# (method, path, body, status, code, words the message must contain)
CASES = [
    ("POST", "/", {}, 400, "invalid_argument", "sub_job_configs"),
    ("POST", "/", {"sub_job_configs": []}, 400, "invalid_argument", "sub_job_configs"),
    (
        "POST",
        "/",
        {"sub_job_configs": [{"job_type": "trainer", "model_name": "m"}]},
        400,
        "invalid_argument",
        "job_type",
    ),
    (
        "POST",
        "/",
        {"sub_job_configs": [{"job_type": "training", "model_name": ""}]},
        400,
        "invalid_argument",
        "model_name",
    ),
    (
        "POST",
        "/",
        {"sub_job_configs": [{**TRAINING, "inference_config": {}}]},
        400,
        "invalid_argument",
        "inference_config",
    ),
    (
        "POST",
        "/",
        {"sub_job_configs": [{**TRAINING, "training_config": {"optimizer": {"lr": -1}}}]},
        400,
        "invalid_argument",
        "optimizer.lr",
    ),
    (
        "POST",
        "/",
        {"sub_job_configs": [{**TRAINING, "training_config": {"optimizer": {"name": "SGD"}}}]},
        400,
        "invalid_argument",
        "AdamW",
    ),
    (
        "POST",
        "/",
        {
            "sub_job_configs": [
                {**TRAINING, "source_checkpoint_info": {"checkpoint_id": "global_step7", "source_job_id": "gone"}}
            ]
        },
        404,
        "not_found",
        "global_step7",
    ),
    ("POST", "/", "not json at all", 400, "invalid_argument", "body is not valid JSON"),
    ("POST", "/", {"sub_job_configs": [TRAINING], "job_id": "bad/id"}, 400, "invalid_argument", "job_id"),
    ("GET", "/no-such-job", None, 404, "not_found", "no-such-job"),
    ("POST", "/no-such-job/step", {}, 404, "not_found", "no-such-job"),
    ("POST", f"/{JOB}/step", {"learning_rate": "fast"}, 400, "invalid_argument", "learning_rate"),
    ("POST", f"/{JOB}/step", [1, 2], 400, "invalid_argument", "body"),
    ("POST", f"/{JOB}/step?wait=soon", {}, 400, "invalid_argument", "wait: Input should be a valid number"),
    ("POST", f"/{JOB}/forward-backward?wait=soon", (OCTET, b""), 400, "invalid_argument", "wait: Input should be"),
    ("POST", f"/{JOB}/save", {"checkpoint_type": "partial"}, 400, "invalid_argument", "checkpoint_type"),
    ("POST", f"/{JOB}/load", {}, 400, "invalid_argument", "checkpoint_id"),
    ("POST", f"/{JOB}/load", {"checkpoint_id": "global_step9"}, 404, "not_found", "global_step9"),
    (
        "POST",
        f"/{JOB}/load",
        {"checkpoint_id": "c", "target_sub_job_id": f"{JOB}:sampling:0"},
        501,
        "not_implemented",
        "sampling",
    ),
    (
        "POST",
        f"/{JOB}/load",
        {"checkpoint_id": "c", "target_sub_job_id": "other:training:0"},
        400,
        "invalid_argument",
        "target_sub_job_id",
    ),
    ("POST", f"/{JOB}/forward-backward", (OCTET, b"definitely not a frame"), 400, "invalid_argument", ""),
    ("POST", f"/{JOB}/forward-backward", (OCTET, pickle.dumps({"kwargs": {}})), 400, "invalid_argument", "pickle"),
    ("POST", f"/{JOB}/forward-backward", (OCTET, _frame({"foo": 1})), 400, "invalid_argument", "kwargs"),
    ("POST", f"/{JOB}/generate", (OCTET, _frame({"prompts": []})), 400, "invalid_argument", "prompts"),
    (
        "POST",
        f"/{JOB}/generate",
        (OCTET, _frame({"prompts": [[1]], "sampling_params": {"top_p": 1.5}})),
        400,
        "invalid_argument",
        "sampling_params.top_p",
    ),
    ("POST", f"/{JOB}/generate", (OCTET, _frame({"prompts": [[1] * 64]})), 400, "invalid_argument", "max_seq_len"),
    (
        "POST",
        f"/{JOB}/generate",
        (OCTET, _frame({"prompts": [[1], [2]], "sampling_params": [{}]})),
        400,
        "invalid_argument",
        "sampling_params",
    ),
    (
        "POST",
        f"/{JOB}/generate",
        (OCTET, _frame({"prompts": [[1], [2]], "routing_key": ["a"]})),
        400,
        "invalid_argument",
        "routing_key has 1 entries for 2 prompts",
    ),
    (
        "POST",
        f"/{JOB}/generate",
        (OCTET, _frame({"prompts": [[1], [2]], "routing_key": ["a", "b"]})),
        400,
        "invalid_argument",
        "send the prompts of each key in a generate of their own",
    ),
    ("POST", f"/{JOB}/operation", {}, 400, "invalid_argument", "operation_type"),
    (  # the sampler's worker parked for the first copy and never ran the second: both queues hung
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "weight-sync", "payload": {"target_sub_job_ids": [f"{JOB}:sampling:0"] * 2}},
        400,
        "invalid_argument",
        "more than once",
    ),
    (
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "weight-sync", "sub_job_id": f"{JOB}:training:0", "sub_job_type": "sampling"},
        400,
        "invalid_argument",
        "sub_job_type",
    ),
    ("POST", f"/{JOB}/operation", {"operation_type": "zmd-events"}, 501, "not_implemented", "zmd-events"),
    (
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "bootstrap-router-replay"},
        501,
        "not_implemented",
        "bootstrap-router-replay",
    ),
    (
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "weight-sync", "payload": {"target_sub_job_ids": [f"{JOB}:training:0"]}},
        400,
        "invalid_argument",
        "target_sub_job_ids",
    ),
    (
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "cancel-request", "payload": {}},
        400,
        "invalid_argument",
        "request_id",
    ),
    (
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "tail-logs", "payload": {"cursor": "abc"}},
        400,
        "invalid_argument",
        "cursor",
    ),
    (
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "forward", "payload": {"payload_b64": "%%%"}},
        400,
        "invalid_argument",
        "base64",
    ),
    (
        "POST",
        f"/{JOB}/operation",
        {"operation_type": "forward", "sub_job_type": "sampling", "payload": {"payload_b64": ""}},
        400,
        "invalid_argument",
        "sampling",
    ),
    ("GET", f"/{JOB}/requests/no-such-request", None, 404, "not_found", "no-such-request"),
    ("GET", f"/{JOB}/requests/r?max_events=many", None, 400, "invalid_argument", "max_events"),
    ("POST", f"/{JOB}/checkpoints/global_step5:export", None, 404, "not_found", "global_step5"),
    ("DELETE", f"/{JOB}/checkpoints/global_step5", None, 404, "not_found", "global_step5"),
]


async def test_malformed_calls_get_their_status_and_code(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING, SAMPLING)
        await api.wait_status(job_id, "running")
        wrong = []
        for method, path, body, status, code, words in CASES:
            kwargs = {}
            if isinstance(body, tuple):
                kwargs = {"content": body[1], "headers": {"content-type": "application/octet-stream"}}
            elif isinstance(body, str):
                kwargs = {"content": body, "headers": {"content-type": "application/json"}}
            elif body is not None:
                kwargs = {
                    "content": json.dumps(body).replace(JOB, job_id),
                    "headers": {"content-type": "application/json"},
                }
            response = await api.call(method, path.replace(JOB, job_id), check=False, **kwargs)
            got = response.json()
            if (response.status_code, got.get("code")) != (status, code) or words not in got.get("message", ""):
                wrong.append(f"{method} {path}: wanted {status} {code} {words!r}, got {response.status_code} {got}")
        assert not wrong, "\n".join(wrong)
        assert (await api.job(job_id))["status"] == "running"  # none of it hurt the job


async def test_unknown_paths_are_404_and_the_statements_api_is_501(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        for path in ("/files/not-a-token", "/nothing/here", f"{PREFIX}/a/b/c/d"):
            response = await http.get(path)
            assert (response.status_code, response.json()["code"]) == (404, "not_found"), path
        statements = await http.post("/api/v2/statements", json={"statement": "SELECT 1"})
        assert (statements.status_code, statements.json()["code"]) == (501, "not_implemented")
