"""A real ``icefloe serve`` logs each request it refuses (a 4xx) once: route, tenant and message, never
the body or a token. Before, a refused request left no trace in the server's log."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from icefloe.wire.batch import BATCH_MEDIA_TYPE, BATCH_PATH, pack, unpack
from tests.faults.serve_process import PREFIX, Serve
from tests.faults.tinker_serve import TOKENS, token_file

pytestmark = pytest.mark.integration

_BODY_SECRET = "body-secret-7f3a"  # sent only inside request bodies: it must never reach the log
_WRONG_TOKEN = "tml-wrong-token-91c2"
_BAD_TARGET = {"target": {"type": "model", "note": _BODY_SECRET}}  # only a sampling_session is polled
_LINE = re.compile(r"refused (\S+) (\S+) \(tenant (.+?)\): (\d+) (.*)$")


def _refusal_lines(serve: Serve, expected: int) -> list[str]:
    """The service's ``refused`` lines once ``expected`` of them are written (a line follows its answer)."""
    deadline = time.monotonic() + 30
    while True:
        lines = [line for line in serve.output().splitlines() if " refused " in line]
        if len(lines) >= expected or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def _message(body: bytes) -> str:
    answer = json.loads(body)
    return answer.get("message") or answer["error"]


def test_each_refusal_is_logged_once_with_route_tenant_and_message(tmp_path):
    tokens = token_file(tmp_path / "tokens")
    with Serve(tmp_path / "serve", "--engines", "local", "--token-file", str(tokens)) as serve:
        alice = {"Authorization": f"Bearer {TOKENS['alice']}"}
        bob_tinker = {"X-API-Key": TOKENS["bob"]}  # the Tinker SDK's header
        batch = pack(
            [{"method": "GET", "path": PREFIX + "/"}, {"method": "GET", "path": PREFIX + "/gone-job"}], [b""] * 2
        )
        with httpx.Client(base_url=serve.base_url, timeout=60) as http:
            assert http.get(PREFIX + "/", headers=alice).status_code == 200  # not a refusal: not logged
            answers = [
                http.get(PREFIX + "/", headers={"Authorization": f"Bearer {_WRONG_TOKEN}"}),
                http.get(PREFIX + "/no-such-job", headers=alice),
                http.post(PREFIX + "/", headers=alice, json={"sub_job_configs": [], "note": _BODY_SECRET}),
                http.post("/api/v1/retrieve_futures", headers=bob_tinker, json=_BAD_TARGET),
            ]
            batched = http.post(PREFIX + BATCH_PATH, headers={**alice, "Content-Type": BATCH_MEDIA_TYPE}, content=batch)
        assert [answer.status_code for answer in answers] == [401, 404, 400, 400], [a.text for a in answers]
        assert batched.status_code == 200 and [part["status"] for part, _ in unpack(batched.content)] == [200, 404]
        lines = _refusal_lines(serve, len(answers) + 1)
        log = serve.output()
    expected = [
        ("GET", f"{PREFIX}/", "unknown (no valid token)", "401", _message(answers[0].content)),
        ("GET", f"{PREFIX}/no-such-job", "alice", "404", _message(answers[1].content)),
        ("POST", f"{PREFIX}/", "alice", "400", _message(answers[2].content)),
        ("POST", "/api/v1/retrieve_futures", "bob", "400", _message(answers[3].content)),
        (
            "GET",
            f"{PREFIX}/gone-job",
            "alice",
            "404",
            _message(unpack(batched.content)[1][1]),
        ),  # the part, not the batch
    ]
    # Once each, in order, and nothing for the answers that succeeded.
    assert [_LINE.search(line).groups() if _LINE.search(line) else line for line in lines] == expected
    assert _BODY_SECRET not in log and _WRONG_TOKEN not in log
    assert not any(token in log for token in TOKENS.values())
