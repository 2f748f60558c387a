"""Hostile bodies against a real ``icefloe serve``: each is refused with a small 4xx while ``/health``
keeps answering and the service's memory stays near the body's size.

Each body is posted from a process of its own while this one calls ``/health`` and reads the service's
resident memory (``/proc/<pid>/status``); both are compared with an idle baseline taken the same way.
"""

from __future__ import annotations

import json
import shutil
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from icefloe import wire
from icefloe.service.limits import MAX_JSON_BYTES

from .serve_process import PREFIX, TRAINING, Serve
from .tinker_serve import PROTO, TOKENS, Tinker, export_model, tinker_serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # real services: `make test-slow`

_ADMIN = {"Authorization": f"Bearer {TOKENS['admin']}"}
# The service takes token prompts this long; its engine then refuses each past the model's 64 positions.
_SAMPLING = {"job_type": "sampling", "model_name": "tiny:arith", "inference_config": {"max_seq_len": 4096}}
_NOISE_BYTES = 8 * 2**20  # resident memory moves this much between two idle reads of a busy service
_SMALL_ANSWER_BYTES = 4096


@dataclass
class Probe:
    status: int
    text: str
    latencies_s: list[float]
    rss_growth_bytes: int


_CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def _models_with_a_chat_model(root: Path) -> None:
    """``root`` with tiny-chat (as tinker_serve exports it) and tiny-chat-template: the same with a chat template."""
    folder = export_model(root)
    shutil.copytree(folder, root / "tiny-chat-template")
    config = root / "tiny-chat-template" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": _CHAT_TEMPLATE}))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("bounds-faults")
    _models_with_a_chat_model(tmp_path / "models")
    # Slots for every host the module's jobs hold at once: Tinker sessions the tests leave keep theirs until
    # their heartbeat lapses (120 s), and the OpenAI tests load two models of their own after them.
    with tinker_serve(tmp_path, "--sequence-gap-timeout-s", "2", "--slots", "8") as serve:
        yield serve


@pytest.fixture(scope="module")
def job_id(served):
    job = served.create(TRAINING, _SAMPLING)
    served.wait_job(job, "running")
    return job


@pytest.fixture(scope="module")
def idle(served) -> Probe:
    """/health and memory while nothing is sent: the baseline every hostile body is compared with."""
    return _probe_during(served, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"]))


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _probe_during(serve: Serve, process: subprocess.Popen, answer_file: Path | None = None) -> Probe:
    """/health latencies and the service's peak memory growth while ``process`` runs; the JSON answer it
    wrote to ``answer_file`` (a file, not a pipe: a pipe read only once it exits would hold a large answer)."""
    before, peak, latencies = _rss_bytes(serve.process.pid), 0, []
    with httpx.Client(timeout=60) as http:
        while process.poll() is None:
            started = time.perf_counter()
            assert http.get(f"{serve.base_url}/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            peak = max(peak, _rss_bytes(serve.process.pid))
            time.sleep(0.005)
    out = answer_file.read_text() if answer_file is not None else ""
    answer = json.loads(out) if out else {"status": 0, "text": ""}
    return Probe(answer["status"], answer["text"], latencies, max(0, peak - before))


def _post(serve: Serve, path: str, body: bytes, headers: dict[str, str], tmp_path: Path) -> Probe:
    """POST ``body`` to ``path`` from another process while probing the service."""
    file = tmp_path / "hostile.bin"
    file.write_bytes(body)
    answer = tmp_path / "answer.json"
    answer.unlink(missing_ok=True)  # a child that dies answers nothing, not the last post's answer
    code = (
        "import httpx, json, sys; body = open(sys.argv[2], 'rb').read(); "
        "answer = httpx.post(sys.argv[1], content=body, headers=json.loads(sys.argv[3]), timeout=120); "
        "open(sys.argv[4], 'w').write(json.dumps({'status': answer.status_code, 'text': answer.text}))"
    )
    headers = json.dumps({**_ADMIN, **headers})
    command = [sys.executable, "-c", code, serve.base_url + path, str(file), headers, str(answer)]
    return _probe_during(serve, subprocess.Popen(command), answer)


def _assert_harmless(probe: Probe, idle: Probe, body_bytes: int, *, status: int) -> None:
    """Answered ``status`` in a small answer; /health near its idle latency; memory within 2x the body."""
    median, idle_median = statistics.median(probe.latencies_s), statistics.median(idle.latencies_s)
    print(
        f"status {probe.status}, answer {len(probe.text)} B, /health median {median:.4f} s (idle {idle_median:.4f}), "
        f"max {max(probe.latencies_s):.4f} s (idle {max(idle.latencies_s):.4f}), "
        f"RSS +{probe.rss_growth_bytes / 2**20:.1f} MiB for a {body_bytes / 2**20:.1f} MiB body"
    )
    assert probe.status == status, probe.text[:2000]
    assert len(probe.text) < _SMALL_ANSWER_BYTES, f"a {len(probe.text)}-byte answer: {probe.text[:500]}"
    assert median <= idle_median + 0.1
    assert max(probe.latencies_s) <= max(idle.latencies_s) + 0.5
    assert probe.rss_growth_bytes <= 2 * max(body_bytes, _NOISE_BYTES)


def _frame_of_header(header: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header


# --- H2 -------------------------------------------------------------------------------------------
def test_a_generate_stream_body_of_tiny_prompts_is_refused_before_it_is_parsed(served, job_id, idle, tmp_path):
    """A 1.2 MB {"prompts": [[[1]], ...]} to generate-stream cost +550 MB, 4.8 s and a 22 MB answer with one
    validation error per prompt; at 54 MB it grew the service until the kernel killed it."""
    body = b'{"prompts": [' + b",".join([b"[[1]]"] * 200_000) + b"]}"
    probe = _post(served, f"{PREFIX}/{job_id}/generate-stream", body, {"Content-Type": "application/octet-stream"},
                  tmp_path)  # fmt: skip
    _assert_harmless(probe, idle, len(body), status=413)
    assert "at most 65536 are accepted" in probe.text


def test_a_generate_stream_of_too_many_bad_prompts_names_a_few_then_counts_the_rest(served, job_id, idle, tmp_path):
    """100k prompts of the wrong type answered one error per prompt: a reply many times the body."""
    body = json.dumps({"prompts": [1.5] * 100_000}).encode()
    probe = _post(served, f"{PREFIX}/{job_id}/generate-stream", body, {"Content-Type": "application/octet-stream"},
                  tmp_path)  # fmt: skip
    _assert_harmless(probe, idle, len(body), status=400)
    assert "prompts: List should have at most 16384 items" in probe.text


def test_a_generate_frame_of_bad_prompts_answers_a_small_4xx(served, job_id, idle, tmp_path):
    """A 2.1 MB DSSST1 frame to /generate answered a 33.7 MB error (one per prompt)."""
    body = wire.encode({"prompts": [[[1]]] * 300_000})
    probe = _post(served, f"{PREFIX}/{job_id}/generate", body, {"Content-Type": "application/octet-stream"}, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)


# JSON bodies of dense numbers near the JSON cap (MAX_JSON_BYTES): "1," (a token id, 2 bytes) and "0.5,"
# (4 bytes) each became a Python object of 32 to 36 bytes (a refused body too: checking each float cost ~150
# more), +25 to +210 MiB.
_NUMBERS = pytest.mark.parametrize("number", [b"1", b"0.5"], ids=["ints", "floats"])
_JSON = {"Content-Type": "application/json"}


def _dense(head: bytes, number: bytes, tail: bytes = b"}", *, size: int = MAX_JSON_BYTES - 4096) -> bytes:
    """``head`` + a JSON array of ``number`` repeated + ``tail``, ``size`` bytes or just under."""
    count = (size - len(head) - len(tail) - 2) // (len(number) + 1)
    return head + b"[" + b",".join([number] * count) + b"]" + tail


@_NUMBERS
def test_training_api_json_of_dense_numbers_costs_at_most_twice_its_size(served, job_id, idle, tmp_path, number):
    """Accepted: a step with a key it does not use, a generate-stream of long token prompts (each then refused
    by the engine); refused: the same numbers as a JSON body to forward-backward, which takes DSSST1 frames."""
    step = _dense(b'{"learning_rate": 0.001, "unused": ', number)
    _assert_harmless(_post(served, f"{PREFIX}/{job_id}/step", step, _JSON, tmp_path), idle, len(step), status=200)
    prompt = _dense(b"", number, b"", size=8000)
    prompts = b'{"prompts": [' + b",".join([prompt] * (MAX_JSON_BYTES // (len(prompt) + 1) - 1)) + b"]}"
    probe = _post(
        served, f"{PREFIX}/{job_id}/generate-stream", prompts, {"Content-Type": "application/octet-stream"}, tmp_path
    )
    _assert_harmless(probe, idle, len(prompts), status=200 if number == b"1" else 400)
    frame = _dense(b'{"kwargs": {"input_ids": ', number, b"}}")
    probe = _post(served, f"{PREFIX}/{job_id}/forward-backward", frame, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(frame), status=400)


@_NUMBERS
def test_tinker_api_json_of_dense_numbers_costs_at_most_twice_its_size(served, idle, tmp_path, number):
    """Accepted: an optim_step with a key it does not use; refused: an asample whose prompt is past the model's
    context (ints) or not token ids (floats), and the numbers as JSON to forward_backward, which takes protobuf."""
    alice = Tinker(served, "alice")
    try:
        session_id, model_id = alice.model()
        sampler = alice.sampler(session_id)
        # forward_backward imports torch on first use, which holds the interpreter a moment: not in the probe
        assert alice.post("/forward_backward", content=b"\xff", headers=PROTO).status_code == 400
    finally:
        alice.close()
    key = {"X-API-Key": TOKENS["alice"], **_JSON}
    step = _dense(b'{"model_id": "%s", "adam_params": {"learning_rate": 0.001}, "unused": ' % model_id.encode(), number)
    _assert_harmless(_post(served, "/api/v1/optim_step", step, key, tmp_path), idle, len(step), status=200)
    head = b'{"sampling_session_id": "%s", "prompt": {"chunks": [{"tokens": ' % sampler.encode()
    sample = _dense(head, number, b"}]}}")
    _assert_harmless(_post(served, "/api/v1/asample", sample, key, tmp_path), idle, len(sample), status=400)
    fwd_bwd = _dense(b'{"model_id": "%s", "data": [{"target_tokens": ' % model_id.encode(), number, b"}]}")
    probe = _post(served, "/api/v1/forward_backward", fwd_bwd, key, tmp_path)
    _assert_harmless(probe, idle, len(fwd_bwd), status=400)


# --- H3 -------------------------------------------------------------------------------------------
def test_a_sequence_number_far_ahead_is_refused_at_once_naming_the_window(served, idle, tmp_path):
    """Icefloe-Sequence x:30000000 made the ordering rule build a set of every skipped number (+1.7 GB,
    /health frozen 2.9 s); 10^20 would never finish; 's:²' answered 500. (The header orders the
    training API's POSTs; the Tinker API's own order is its seq_id, below.)"""
    for number in ("3000000", "100000000000000000000"):
        probe = _post(served, f"{PREFIX}/", b"{}", {"Content-Type": "application/json",
                      "Icefloe-Sequence": f"far:{number}"}, tmp_path)  # fmt: skip
        _assert_harmless(probe, idle, 2, status=400)
        assert "sequence window (10000)" in probe.text or "1-19 digits" in probe.text, probe.text
    superscript = httpx.post(f"{served.base_url}{PREFIX}/", json={},
                             headers={**_ADMIN, "Icefloe-Sequence": "s:²".encode()})  # fmt: skip
    assert superscript.status_code == 400 and "1-19 digits 0-9" in superscript.json()["message"]
    in_window = httpx.post(f"{served.base_url}{PREFIX}/", json={"sub_job_configs": []},
                           headers={**_ADMIN, "Icefloe-Sequence": "near:0"})  # fmt: skip
    assert in_window.status_code == 400 and "sub_job_configs" in in_window.json()["message"]  # ordered as before


def test_a_tinker_seq_id_far_ahead_is_refused_naming_the_window(served, idle):
    """seq_id 3,000,000 on a fresh model held the op and then skipped three million numbers (+190 MB)."""
    alice = Tinker(served, "alice")
    try:
        _, model_id = alice.model()
        far = alice.post("/optim_step", {"model_id": model_id, "seq_id": 3_000_000, "adam_params": {}})
        assert far.status_code == 400 and "sequence window (10000)" in far.json()["message"], far.text
        near = alice.ok("/optim_step", {"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-3}})
        outcome = alice.outcome(near["request_id"])  # it ran (or failed in the engine), not held for seq_id 3M
        assert outcome.status_code == 200 and "seq_id" not in outcome.text, outcome.text
    finally:
        alice.close()


# --- M1 -------------------------------------------------------------------------------------------
def test_create_job_with_650k_sub_jobs_is_refused_before_it_is_parsed(served, idle, tmp_path):
    """1.95 MB of empty sub-job configs stalled /health 12 s and answered 65 MB."""
    body = b'{"sub_job_configs": [' + b",".join([b"{}"] * 650_000) + b"]}"
    probe = _post(served, f"{PREFIX}/", body, {"Content-Type": "application/json"}, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)


def test_create_job_with_too_many_sub_jobs_names_the_limit(served):
    configs = [{"job_type": "training", "model_name": "x"}] * 65
    refused = served.http.post("/", json={"sub_job_configs": configs})
    assert refused.status_code == 400 and "at most 64 items" in refused.json()["message"]


def test_create_job_reports_each_top_level_key_it_does_not_use_in_warnings(served):
    """A source_checkpoint_info put beside sub_job_configs, not in one, was dropped without a word: the
    job started from fresh weights."""
    body = {"sub_job_configs": [_SAMPLING], "source_checkpoint_info": {"checkpoint_id": "global_step1"}, "colour": 1}
    answer = served.http.post("/", json={**body, "k" * 100_000: 0})  # a long key is named by its start
    assert answer.status_code == 200, answer.text
    assert answer.json()["warnings"] == [
        "colour is recorded but not used: the create-job body has no such field",
        "k" * 77 + "... is recorded but not used: the create-job body has no such field",
        "source_checkpoint_info is recorded but not used: it is a sub-job field; put it in each entry of "
        "sub_job_configs",
    ]
    assert served.http.post(f"/{answer.json()['job_id']}:cancel").status_code == 200


def test_a_54_mib_requests_batch_head_is_refused_from_its_length(served, idle, tmp_path):
    """A requests:batch head of 54 MiB cost 3.9 s of a frozen loop and +1 GB."""
    head = b"[" + b",".join([b'{"size":0,"method":"POST","path":"/x"}'] * 1_500_000) + b"]"
    body = struct.pack(">I", len(head)) + head
    assert len(body) > 54 * 2**20
    probe = _post(served, f"{PREFIX}/requests:batch", body, {"Content-Type": "application/x-icefloe-batch"}, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)
    assert "part list" in probe.text


def test_a_deeply_nested_requests_batch_head_answers_4xx(served):
    """A head nested thousands deep answered 500 (RecursionError)."""
    head = b"[" * 5000 + b"]" * 5000
    answer = served.http.post("/requests:batch", content=struct.pack(">I", len(head)) + head,
                              headers={"Content-Type": "application/x-icefloe-batch"})  # fmt: skip
    assert answer.status_code == 400 and "nests too deeply" in answer.json()["message"], answer.text


def test_a_57_mib_frame_of_plain_values_is_refused_from_its_header_length(served, job_id, idle, tmp_path):
    """A 57 MiB DSSST1 frame of 15M plain values to forward-backward was accepted after 28 s, with
    /health stalled 4.2 s and +2.4 GB."""
    values = b",".join([b"0"] * 28_000_000)
    tree = b'{\\"v\\":\\"DSSST1\\",\\"tree\\":[\\"j\\",[' + values + b"]]}"
    body = _frame_of_header(b'{"__metadata__":{"dss":"' + tree + b'"}}')
    assert len(body) > 53 * 2**20
    probe = _post(served, f"{PREFIX}/{job_id}/forward-backward", body, {"Content-Type": "application/octet-stream"},
                  tmp_path)  # fmt: skip
    _assert_harmless(probe, idle, len(body), status=413)
    assert "header is at most" in probe.text


# --- bodies built to cost the most per byte -------------------------------------------------------
_OCTET = {"Content-Type": "application/octet-stream"}


def test_a_generate_stream_of_the_most_tiny_prompts_costs_at_most_twice_its_size(served, job_id, idle, tmp_path):
    """16,384 one-token prompts (64 KiB) queued a future, a lock and an item per prompt: +40 MiB."""
    body = json.dumps({"prompts": [[1]] * 16_384, "sampling_params": {"max_tokens": 1}}).encode()
    probe = _post(served, f"{PREFIX}/{job_id}/generate-stream", body, _OCTET, tmp_path)
    _assert_harmless(probe, idle, len(body), status=200)
    assert json.loads(probe.text)["count"] == 16_384


def _strings(head: bytes, tail: bytes = b"}") -> bytes:
    """``head`` + a JSON array of the short string "ab" (about 50 bytes once parsed, for 5) up to the cap."""
    return _dense(head, b'"ab"', tail)


def test_json_of_short_strings_is_refused_before_it_is_parsed_on_every_api(served, job_id, idle, tmp_path):
    """4 MiB of "ab" strings cost +22.7 MiB: each became a Python str of about 50 bytes."""
    step = _strings(b'{"learning_rate": 0.001, "unused": ')
    probe = _post(served, f"{PREFIX}/{job_id}/step", step, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(step), status=413)
    assert "at most 65536 are accepted" in probe.text and "DSSST1" in probe.text, probe.text
    key = {"X-API-Key": TOKENS["alice"], **_JSON}
    step = _strings(b'{"model_id": "none", "adam_params": {"learning_rate": 0.001}, "unused": ')
    probe = _post(served, "/api/v1/optim_step", step, key, tmp_path)
    _assert_harmless(probe, idle, len(step), status=413)
    assert "at most 65536 are accepted" in probe.text, probe.text
    completion = _strings(b'{"model": "tiny-chat", "prompt": ')
    probe = _post(served, "/v1/completions", completion, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(completion), status=413)
    assert "at most 65536 are accepted" in probe.text and "fewer or shorter prompts" in probe.text, probe.text


def test_openai_json_of_containers_or_floats_costs_at_most_twice_its_size(served, idle, tmp_path):
    """The OpenAI API parsed its bodies with json alone: empty lists (56 bytes each for 3) and floats
    (32 bytes for 4) were built whatever their count."""
    containers = _dense(b'{"model": "tiny-chat", "prompt": "hi", "unused": ', b"[]")
    probe = _post(served, "/v1/completions", containers, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(containers), status=413)
    floats = _dense(b'{"model": "tiny-chat", "prompt": "hi", "unused": ', b"0.5")
    probe = _post(served, "/v1/completions", floats, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(floats), status=400)


def _with_last(array_text: bytes, last: bytes) -> bytes:
    """A body of :func:`_dense` whose array's last number is ``last``."""
    head, _, tail = array_text.rpartition(b",")
    return head + b"," + last + tail[tail.index(b"]") :]


_CRAFTED = {
    # one-digit numbers with one that needs int64 or float64: 8 bytes each for the 2 of "1,"
    "int64-mixed": _with_last(_dense(b'{"learning_rate": 0.001, "unused": ', b"1"), b"4611686018427387904"),
    "float64-mixed": _with_last(_dense(b'{"learning_rate": 0.001, "unused": ', b"1"), b"0.1"),
    # one character beyond the BMP: every character of the text it sits in takes 4 bytes
    "emoji": b'{"learning_rate": 0.001, "unused": "' + b"a" * (MAX_JSON_BYTES - 4096) + "\U0001f600".encode() + b'"}',
}


@pytest.mark.parametrize("body", _CRAFTED.values(), ids=_CRAFTED.keys())
def test_bodies_that_cost_four_times_their_text_stay_within_twice_the_body(served, job_id, idle, tmp_path, body):
    _assert_harmless(_post(served, f"{PREFIX}/{job_id}/step", body, _JSON, tmp_path), idle, len(body), status=200)


def test_a_tinker_body_beyond_the_bmp_stays_within_twice_its_size(served, idle, tmp_path):
    key = {"X-API-Key": TOKENS["alice"], **_JSON}
    body = b'{"model_id": "none", "unused": "' + b"a" * (MAX_JSON_BYTES - 4096) + "\U0001f600".encode() + b'"}'
    _assert_harmless(_post(served, "/api/v1/optim_step", body, key, tmp_path), idle, len(body), status=404)


@pytest.mark.parametrize("number", [b"1", b"0.5"], ids=["ints", "floats"])
def test_a_create_job_body_of_unused_numbers_is_bounded(served, idle, tmp_path, number):
    """A create body keeps its arrays as the lists it stores: 8 to 32 bytes per number once parsed."""
    head = b'{"sub_job_configs": [{"job_type": "sampling", "model_name": "no-such-model"}], "unused": '
    body = _dense(head, number)
    probe = _post(served, f"{PREFIX}/", body, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)
    assert "create-job body" in probe.text, probe.text


# --- DSSST1 headers -------------------------------------------------------------------------------
_RANDOM = np.random.default_rng(38)


def _token_prompts(count: int, length: int) -> list[list[int]]:
    """Token ids as a tokenizer of a 50k vocabulary gives them: four and five digits."""
    return _RANDOM.integers(1000, 50_000, size=(count, length)).tolist()


def test_a_generate_frame_of_long_token_prompts_costs_at_most_twice_its_size(served, job_id, idle, tmp_path):
    """A frame's plain values were parsed into Python lists: 1024 prompts of 2048 token ids (a 13 MB header)
    became about 40 bytes an id. The frame is refused by its sampling params, after it was read and
    decoded, so the measure is what the body costs and not what a 1024-prompt prefill does."""
    body = wire.encode({"prompts": _token_prompts(1024, 1900), "sampling_params": {"max_tokens": -1}})
    assert 13 * 10**6 < len(body) < 16 * 2**20
    probe = _post(served, f"{PREFIX}/{job_id}/generate", body, _OCTET, tmp_path)
    _assert_harmless(probe, idle, len(body), status=400)


# --- Tinker protobuf bodies -----------------------------------------------------------------------
def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


def _length_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


_MADE_UP_MODEL = _length_field(1, b"x:train:0")  # ForwardBackwardRequest.model_id: no such model
_EMPTY_MESSAGES = {
    # 25M empty Datum entries (data, field 3): +1,382 MiB and /health stalled 1.13 s, answered 404 after the parse
    "datums": _MADE_UP_MODEL + b"\x1a\x00" * 25_000_000,
    # one datum of 24M empty chunks (Datum.model_input, field 1)
    "chunks": _MADE_UP_MODEL + _length_field(3, b"\x0a\x00" * 24_000_000),
    # one loss input (Datum.loss_fn_inputs, field 2) whose Tensor.shape (field 4, packed) holds 40M ones
    "shape": _MADE_UP_MODEL
    + _length_field(3, _length_field(2, _length_field(2, _length_field(4, b"\x01" * 40_000_000)))),
}


@pytest.mark.parametrize("body", _EMPTY_MESSAGES.values(), ids=_EMPTY_MESSAGES.keys())
def test_a_forward_backward_of_millions_of_empty_messages_is_refused_before_it_is_parsed(served, idle, tmp_path, body):
    """Parsing built an object of 30 to 60 bytes for each 1 to 2 bytes of the body, before the model_id was
    looked up: any key with a made-up model_id could cost the service 1.7 GB a request."""
    assert len(body) > 38 * 2**20
    key = {"X-API-Key": TOKENS["alice"], **PROTO}
    probe = _post(served, "/api/v1/forward_backward", body, key, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)
    assert "at most" in probe.text and "ForwardBackwardRequest" in probe.text, probe.text


# --- JSON that is not a dense array of numbers ----------------------------------------------------
def _long_strings(count: int) -> bytes:
    """A JSON array of ``count`` 26-character strings: under the count of strings, near the 2 MiB cap."""
    return b"[" + b",".join(b'"%026d"' % index for index in range(count)) + b"]"


def _floats_and_a_string(head: bytes) -> bytes:
    """``head`` + an array of "0.5" up to the cap whose last item is a string: not read as machine numbers."""
    return _dense(head, b"0.5", b',"x"]}').replace(b'],"x"]}', b',"x"]}')


def test_tinker_json_of_long_strings_costs_at_most_twice_the_floor(served, idle, tmp_path):
    """65,000 stop strings (1.8 MiB) to asample were queued for the sampler (+21 MiB, and each checked at every
    decode step); an unknown key holding them cost create_model as much: the parse cut each string out of the
    text and joined it back."""
    alice = Tinker(served, "alice")
    try:
        session_id, _ = alice.model()
        sampler = alice.sampler(session_id)
    finally:
        alice.close()
    key = {"X-API-Key": TOKENS["alice"], **_JSON}
    sample = b'{"sampling_session_id": "%s", "prompt": {"chunks": [{"tokens": [1, 2, 3]}]}, ' % sampler.encode()
    sample += b'"sampling_params": {"max_tokens": 4, "stop": ' + _long_strings(65_000) + b"}}"
    probe = _post(served, "/api/v1/asample", sample, key, tmp_path)
    _assert_harmless(probe, idle, len(sample), status=400)
    assert "at most 1024 stop strings or token ids" in probe.text, probe.text
    model = b'{"session_id": "%s", "model_seq_id": 7, "base_model": "tiny-chat", "x": ' % session_id.encode()
    model += _long_strings(65_000) + b"}"
    probe = _post(served, "/api/v1/create_model", model, key, tmp_path)
    _assert_harmless(probe, idle, len(model), status=400)


def _post_eight_at_once(serve: Serve, path: str, body: bytes, headers: dict[str, str], tmp_path: Path) -> Probe:
    """POST ``body`` eight times at once from another process while probing the service."""
    file = tmp_path / "hostile.bin"
    file.write_bytes(body)
    code = (
        "import httpx, json, sys\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "body = open(sys.argv[2], 'rb').read()\n"
        "def post(_):\n"
        "    with httpx.Client(timeout=120) as http:\n"
        "        return http.post(sys.argv[1], content=body, headers=json.loads(sys.argv[3])).status_code\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    statuses = sorted(set(pool.map(post, range(8))))\n"
        "open(sys.argv[4], 'w').write(json.dumps({'status': statuses[0] if len(statuses) == 1 else 0, 'text': ''}))"
    )
    answer = tmp_path / "answer.json"
    answer.unlink(missing_ok=True)
    command = [sys.executable, "-c", code, serve.base_url + path, str(file), json.dumps(headers), str(answer)]
    return _probe_during(serve, subprocess.Popen(command), answer)


def test_eight_bodies_of_floats_and_a_string_at_once_cost_at_most_twice_their_size(served, idle, tmp_path):
    """An array of floats with one string in it is a list of Python floats (32 bytes for the 4 of "0.5,"):
    eight such 2 MiB optim_step bodies at once cost +60 to +90 MiB."""
    key = {"X-API-Key": TOKENS["alice"], **_JSON}
    body = _floats_and_a_string(b'{"model_id": "none", "adam_params": {"learning_rate": 0.001}, "unused": ')
    probe = _post_eight_at_once(served, "/api/v1/optim_step", body, key, tmp_path)
    _assert_harmless(probe, idle, 8 * len(body), status=413)


def test_a_requests_batch_of_json_parts_is_bounded_as_one_json_body(served, job_id, idle, tmp_path):
    """28 step parts of 2 MiB each (56 MiB) were parsed at once: +590 MiB and /health stalled 0.95 s."""
    step = _dense(b'{"learning_rate": 0.001, "unused": ', b"1")
    json_header = [["content-type", "application/json"]]
    part = {"method": "POST", "path": f"{PREFIX}/{job_id}/step", "query": "", "headers": json_header, "size": len(step)}
    parts = [part] * 28
    head = json.dumps(parts).encode()
    body = struct.pack(">I", len(head)) + head + step * 28
    probe = _post(served, f"{PREFIX}/requests:batch", body, {"Content-Type": "application/x-icefloe-batch"}, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)
    assert "JSON parts and frame headers hold" in probe.text, probe.text


def test_a_requests_batch_of_frames_bounds_their_headers_together(served, job_id, idle, tmp_path):
    """Each frame's header may hold 131,072 loose values, and a batch's parts are read at once: 20 frames of
    130,000 floats and a string each would be 2.6 million Python floats."""
    dss = b'{"v": "DSSST1", "tree": ["j", [' + b",".join([b"1.5"] * 130_000) + b',"x"]]}'
    header = b'{"__metadata__":{"dss":"' + dss + b'"}}'
    frame = _frame_of_header(header + b" " * (-len(header) % 8))
    octets = [["content-type", "application/octet-stream"]]
    part = {"method": "POST", "path": f"{PREFIX}/{job_id}/forward-backward", "query": "", "headers": octets,
            "size": len(frame)}  # fmt: skip
    head = json.dumps([part] * 20).encode()
    body = struct.pack(">I", len(head)) + head + frame * 20
    probe = _post(served, f"{PREFIX}/requests:batch", body, {"Content-Type": "application/x-icefloe-batch"}, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)
    assert "JSON parts and frame headers hold" in probe.text, probe.text


# --- the OpenAI endpoint --------------------------------------------------------------------------
def _openai_bodies() -> dict[str, tuple[str, bytes, int, str]]:
    """Bodies under the JSON cap built to cost the most per byte: (route, body, status, what the answer says)."""
    completion, chat = (
        b'{"model": "tiny:arith", "max_tokens": 1, "prompt": ',
        b'{"model": "tiny-chat-template", "messages": ',
    )
    floats = _with_last(_dense(completion, b"1.5"), b'"x"')
    few_floats = _with_last(_dense(completion, b"1.5", size=500_000), b'"x"')  # under the count of values
    text = json.dumps({"model": "tiny:arith", "max_tokens": 1, "prompt": "1+" * (MAX_JSON_BYTES // 2 - 100)})
    texts = json.dumps({"model": "tiny:arith", "max_tokens": 1, "prompt": ["ab"] * 65_000})
    messages = chat + json.dumps([{"role": "user", "content": "a"}] * 16_000).encode() + b"}"
    message = chat + json.dumps([{"role": "user", "content": "ab" * (MAX_JSON_BYTES // 2 - 100)}]).encode() + b"}"
    return {
        "floats-then-a-string": ("/v1/completions", floats, 413, "outside arrays of plain numbers"),
        "fewer-floats-then-a-string": ("/v1/completions", few_floats, 400, "prompt[0] is a number with a fraction"),
        "a-2-mib-text": ("/v1/completions", text.encode(), 400, "no text of more than 1280 characters fits"),
        "65k-short-texts": ("/v1/completions", texts.encode(), 400, "65000 samples; at most 1024"),
        "16k-messages": ("/v1/chat/completions", messages, 400, "no text of more than 10240 characters fits"),
        "a-2-mib-message": ("/v1/chat/completions", message, 400, "no text of more than 10240 characters fits"),
    }


_OPENAI_BODIES = _openai_bodies()


@pytest.fixture(scope="module")
def openai_loaded(served):
    """Both models loaded once: loading a tokenizer imports transformers into the service (about +30 MiB)."""
    for path, body in (
        ("/v1/completions", {"model": "tiny:arith", "prompt": "1+1=", "max_tokens": 1}),
        ("/v1/chat/completions", {"model": "tiny-chat-template", "messages": [{"role": "user", "content": "hi"}]}),
    ):
        answer = httpx.post(served.base_url + path, json={**body, "max_tokens": 1}, headers=_ADMIN, timeout=120)
        assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("case", _OPENAI_BODIES.values(), ids=_OPENAI_BODIES.keys())
def test_openai_prompts_built_to_cost_the_most_are_refused_before_costly_work(
    served, openai_loaded, idle, tmp_path, case
):
    """A prompt of 900k floats ending in a string was validated as a four-way union on the event loop
    (/health 21.8 s, +3.4 GB); 750k short strings and a 3.6 MiB text were tokenized before anything counted
    them (17 s; +1.2 GB); 60,000 chat messages were rendered before any check. Under the 2 MiB cap, on main:
    the floats stalled /health 12.2 s (+226 MiB), the text 2.3 s (+166 MiB), 65k texts 1.1 s."""
    path, body, status, said = case
    probe = _post(served, path, body, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(body), status=status)
    assert said in probe.text, probe.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"model": "\\ud800x", "prompt": "1"}', "model"),
        ("/v1/completions", b'{"model": "tiny:arith", "prompt": "\\ud800", "max_tokens": 1}', "prompt"),
        ("/v1/completions", b'{"model": "tiny:arith", "prompt": ["1", "2\\udfff"], "max_tokens": 1}', "prompt"),
        ("/v1/chat/completions", b'{"model": "tiny-chat-template", "messages": [{"role": "user", "content": "a"}, '
         b'{"role": "user", "content": "\\ud800"}], "max_tokens": 1}', "messages[1].content"),
    ],
    ids=["model", "prompt", "prompts", "message"],
)  # fmt: skip
def test_openai_text_with_a_lone_surrogate_is_a_400_naming_its_param(served, path, body, param):
    """A lone surrogate answered 500: a JobCreate ValidationError for the model, a tokenizer TypeError for a prompt."""
    answer = httpx.post(served.base_url + path, content=body, headers={**_ADMIN, **_JSON}, timeout=120)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["type"] == "invalid_request_error", answer.text
    assert error["param"] == param and "lone surrogate" in error["message"], answer.text


def test_an_openai_model_is_unloaded_when_idle_with_leases_off(tmp_path):
    """With --lease-ttl-s 0, a model the endpoint loaded for one request held its slot forever: tenants
    could fill the slots so that others' training jobs waited."""
    with Serve(tmp_path / "serve", "--lease-ttl-s", "0", "--loaded-model-idle-s", "1") as serve:
        seen: set[str] = set()
        for _ in range(2):  # loaded, unloaded once idle, then loaded again by the next request
            body = {"model": "tiny:arith", "prompt": "1+1=", "max_tokens": 1}
            answer = httpx.post(f"{serve.base_url}/v1/completions", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            (job_id,) = {job["job_id"] for job in serve.call("GET", "/")["jobs"]} - seen
            seen.add(job_id)
            serve.wait_job(job_id, "cancelled", "terminated", timeout_s=60, renew=False)


# --- a second probe: arrays that are not read as machine numbers ----------------------------------
def test_a_frame_of_floats_with_a_string_among_them_is_refused_before_it_is_parsed(served, job_id, idle, tmp_path):
    """A 16 MiB header whose tree holds 4M floats and one string: no array of plain numbers, so each float
    was a Python object (+226 MiB) before the route refused the body (400)."""
    dss = b'{\\"v\\": \\"DSSST1\\", \\"tree\\": [\\"j\\", [' + b",".join([b"1.5"] * 4_000_000) + b',\\"x\\"]]}'
    header = b'{"__metadata__":{"dss":"' + dss + b'"}}'
    body = _frame_of_header(header + b" " * (-len(header) % 8))
    probe = _post(served, f"{PREFIX}/{job_id}/forward-backward", body, _OCTET, tmp_path)
    _assert_harmless(probe, idle, len(body), status=413)
    assert "JSON values outside arrays of plain numbers" in probe.text, probe.text


def test_floats_with_an_integer_no_double_holds_are_refused_past_a_bound(served, openai_loaded, idle, tmp_path):
    """An integer of 2**53 or more among 524k floats kept the array a list of Python floats (+30.7 MiB for a
    2 MiB OpenAI body): the count of values outside number arrays had taken it for one."""
    head = b'{"model": "tiny:arith", "max_tokens": 1, "prompt": '
    body = _with_last(_dense(head, b"1.5"), b"9007199254740993")
    probe = _post(served, "/v1/completions", body, _JSON, tmp_path)
    _assert_harmless(probe, idle, len(body), status=400)
    assert "no machine type holds exactly" in probe.text, probe.text
