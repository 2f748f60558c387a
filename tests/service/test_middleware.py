"""The ASGI layers (icefloe.service.middleware): bearer token first, size cap, Idempotency-Key, JSON bounds."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import httpx
import pytest

from icefloe.service import store
from icefloe.service.app import ServerThread

from .service_batches import small_batch
from .service_client import PREFIX, SAMPLING, TRAINING, Api
from .service_harness import asgi_client, make_app, uvicorn_client

pytestmark = pytest.mark.anyio


def _token() -> str:
    return "serve-token-" + uuid.uuid4().hex


async def test_every_route_but_health_needs_a_valid_token(data_dir):
    token = _token()
    async with asgi_client(make_app(data_dir, tokens=(token,))) as http:
        assert (await http.get("/health")).status_code == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Basic {token}"},
            {"Authorization": f"Bearer {token}", "X-Snowflake-Authorization-Token-Type": "OAUTH"},
        ):
            for path in (f"{PREFIX}/capacity", "/no-such-path"):
                response = await http.get(path, headers=headers)
                assert (response.status_code, response.json()["code"]) == (401, "unauthenticated"), headers
                assert token not in response.text
        refused = await http.post(f"{PREFIX}/", json={"sub_job_configs": [TRAINING]})
        assert refused.status_code == 401
        pat = {"Authorization": f"Bearer {token}", "X-Snowflake-Authorization-Token-Type": "PROGRAMMATIC_ACCESS_TOKEN"}
        assert (await http.get(f"{PREFIX}/", headers=pat)).json() == {"jobs": []}  # the refused create made nothing
        assert (await http.get(f"{PREFIX}/capacity", headers={"Authorization": f"Bearer {token}"})).status_code == 200


async def test_api_docs_need_the_token_and_load_their_assets_from_the_service(data_dir):
    """/docs, /redoc and /openapi.json answered 200 without a token, and the pages loaded their scripts from a CDN."""
    token = _token()
    async with asgi_client(make_app(data_dir, tokens=(token,))) as http:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert (await http.get(path)).status_code == 401, path
        auth = {"Authorization": f"Bearer {token}"}
        assert (
            "/api/v2/databases/{database}/schemas/{schema}/{endpoint}/"
            in (await http.get("/openapi.json", headers=auth)).json()["paths"]
        )
        for page in ("/docs", "/redoc"):
            html = (await http.get(page, headers=auth)).text
            assert "//" not in html, page  # no http://, https:// or protocol-relative URL: nothing remote
            assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html) + re.findall(r"url: ?'([^']+)'", html)
            assert any(a.endswith(".js") for a in assets), page
            for asset in assets:
                assert asset.startswith("/"), (page, asset)
                assert (await http.get(asset)).status_code == 401, asset
                loaded = await http.get(asset, headers=auth)
                assert loaded.status_code == 200 and loaded.content, asset


async def test_an_unauthenticated_malformed_body_gets_401(data_dir):
    """The JSON body was parsed before the token dependency ran: a bad body without a token got 400."""
    async with asgi_client(make_app(data_dir, tokens=(_token(),))) as http:
        for content in (b"{not json", b"[" * 5000):
            response = await http.post(f"{PREFIX}/", content=content, headers={"content-type": "application/json"})
            assert (response.status_code, response.json()["code"]) == (401, "unauthenticated")


async def test_an_unauthenticated_large_body_is_refused_before_any_of_it_is_sent(data_dir):
    """A 50 MiB body without a token was read and parsed (~146 MiB of RSS) before its 401."""
    with ServerThread(make_app(data_dir, tokens=(_token(),))) as base_url:
        host, port = base_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"POST {PREFIX}/ HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * 1024 * 1024}\r\n\r\n"
        )
        writer.write(head.encode())  # the headers only: the server must answer without waiting for the body
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=60)  # read() returns once the server closes
        writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 401 Unauthorized"
    assert b"connection: close" in rest.lower() and b'"unauthenticated"' in rest


async def test_an_unauthenticated_numbered_post_neither_holds_nor_advances_its_session(data_dir):
    """Icefloe-Sequence was handled before the token check: a POST without a token moved the session on."""
    token = _token()
    async with asgi_client(make_app(data_dir, tokens=(token,), sequence_gap_timeout_s=0.5)) as http:
        auth = {"Authorization": f"Bearer {token}"}
        http.headers.update(auth)
        job_id = await Api(http).running(TRAINING)  # a job this service runs: its numbered POSTs are ordered
        del http.headers["Authorization"]

        async def step(number: int, headers: dict[str, str]) -> tuple[int, str | None]:
            numbered = {"Icefloe-Sequence": f"session-1:{number}", **headers}
            response = await http.post(f"{PREFIX}/{job_id}/step", json={}, headers=numbered)
            return response.status_code, response.json().get("code")

        assert await step(1, {}) == (401, "unauthenticated")  # at once: it never waited for POST 0
        assert await step(0, {}) == (401, "unauthenticated")
        assert await step(1, auth) == (409, "sequence_gap")  # the session still waited for the caller's POST 0
        assert (await step(2, auth))[0] == 200  # past that gap the session moved on: the step was queued


async def test_tokens_never_appear_in_logs(data_dir, capfd, caplog):
    token = _token()
    app = make_app(data_dir, tokens=(token,))
    with ServerThread(app, log_level="info") as base_url:
        auth = {"Authorization": f"Bearer {token}"}
        async with httpx.AsyncClient(base_url=base_url, headers=auth, timeout=60) as http:
            api = Api(http)
            job_id = await api.create(TRAINING)
            await api.wait_status(job_id, "running")
            # a careless client that also puts the token in the URL: the access log must not show it
            await http.get(f"{PREFIX}/capacity", params={"access_token": token})
            await http.get(f"{PREFIX}/capacity", headers={"Authorization": f"Bearer {token}-wrong"})
            logs = (await api.call("POST", f"/{job_id}/operation", json={"operation_type": "tail-logs"})).text
    captured = capfd.readouterr()
    output = captured.out + captured.err + caplog.text + logs
    assert "GET " in output and "/capacity" in output  # the access log did run
    assert "Logging error" not in output, "redaction must keep records formattable (uvicorn unpacks args)"
    assert token not in output
    assert "***" in output
    for path in data_dir.rglob("*.jsonl"):
        assert token not in path.read_text()


async def test_same_idempotency_key_returns_the_same_request_and_executes_once(data_dir):
    async with asgi_client(make_app(data_dir)) as http:
        api = Api(http)
        job_id = await api.create(TRAINING)
        await api.wait_status(job_id, "running")
        key = {"Idempotency-Key": "step-1"}
        await api.fwd_bwd(job_id)
        first = await api.call("POST", f"/{job_id}/step", json={}, headers=key)
        second = await api.call("POST", f"/{job_id}/step", json={}, headers=key)
        assert first.json() == second.json() and second.headers["idempotent-replayed"] == "true"
        assert (await api.result(job_id, first.json()["request_id"]))["global_step"] == 1
        await api.fwd_bwd(job_id)
        other = await api.call("POST", f"/{job_id}/step", json={}, headers={"Idempotency-Key": "step-2"})
        assert (await api.result(job_id, other.json()["request_id"]))["global_step"] == 2  # the replay never ran

        reused = await api.call("POST", f"/{job_id}/step", json={"learning_rate": 0.1}, headers=key, check=False)
        assert (reused.status_code, reused.json()["code"]) == (409, "conflict")


async def test_idempotency_key_survives_a_restart(data_dir):
    body = {"sub_job_configs": [TRAINING], "job_id": "keyed-job"}
    async with asgi_client(make_app(data_dir)) as http:
        created = await Api(http).call("POST", "/", json=body, headers={"Idempotency-Key": "create-1"})
    async with asgi_client(make_app(data_dir)) as http:
        again = await Api(http).call("POST", "/", json=body, headers={"Idempotency-Key": "create-1"})
        assert again.json() == created.json() == {"job_id": "keyed-job"}
        fresh = await Api(http).call("POST", "/", json=body, headers={"Idempotency-Key": "create-2"}, check=False)
        assert fresh.status_code == 409  # a new key really executes: the job id now exists


async def test_body_over_the_cap_is_refused_before_it_is_read(data_dir):
    async with uvicorn_client(make_app(data_dir, max_post_bytes=10_000)) as http:
        declared = await http.post(f"{PREFIX}/some-job/forward-backward", content=b"\0" * 10_001)
        assert (declared.status_code, declared.json()["code"]) == (413, "payload_too_large")

        async def stream():  # no Content-Length: the cap applies while reading
            for _ in range(3):
                yield b"\0" * 5000

        streamed = await http.post(f"{PREFIX}/", content=stream(), headers={"content-type": "application/json"})
        assert (streamed.status_code, streamed.json()["code"]) == (413, "payload_too_large")


async def test_replay_needs_the_token_and_is_scoped_to_it(data_dir):
    """A saved Idempotency-Key reply was replayed to a caller with no token (or another token): auth was skipped."""
    token, other = "serve-token-" + uuid.uuid4().hex, "serve-token-" + uuid.uuid4().hex
    body = {"sub_job_configs": [TRAINING], "job_id": "keyed-job"}
    async with asgi_client(make_app(data_dir, tokens=(token, other))) as http:
        api = Api(http)
        key = {"Idempotency-Key": "k1"}
        created = await api.call("POST", "/", json=body, headers={**key, "Authorization": f"Bearer {token}"})
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
            refused = await api.call("POST", "/", json=body, headers={**key, **headers}, check=False)
            assert (refused.status_code, refused.json()["code"]) == (401, "unauthenticated"), headers
            assert "idempotent-replayed" not in refused.headers and token not in refused.text
        pat = {"Authorization": f"Bearer {token}", "X-Snowflake-Authorization-Token-Type": "PROGRAMMATIC_ACCESS_TOKEN"}
        again = await api.call("POST", "/", json=body, headers={**key, **pat})
        assert again.json() == created.json() and again.headers["idempotent-replayed"] == "true"
        # another token with the same key is another record: the create really runs, and the id is taken
        fresh = await api.call("POST", "/", json=body, headers={**key, "Authorization": f"Bearer {other}"}, check=False)
        assert fresh.status_code == 409 and "idempotent-replayed" not in fresh.headers
    for path in data_dir.glob("icefloe.sqlite3*"):
        assert token.encode() not in path.read_bytes()  # records are scoped by a hash, never the token


async def test_expired_idempotency_records_are_not_replayed_and_are_deleted(data_dir):
    """Idempotency records and download links were kept (and replayed) forever: the tables only grew."""
    body = {"sub_job_configs": [TRAINING], "job_id": "keyed-job"}
    key = {"Idempotency-Key": "create-1"}
    async with asgi_client(make_app(data_dir, idempotency_ttl_s=3600)) as http:
        await Api(http).call("POST", "/", json=body, headers=key)
    app = make_app(data_dir, idempotency_ttl_s=3600)
    db = app.state.db
    db.execute("UPDATE idempotency SET created_at = ?", (store.iso_ago(7200),))
    store.insert_file_link(db, token="old-link", path="/nowhere", expires_at=time.time() - 1)
    store.insert_file_link(db, token="live-link", path="/nowhere", expires_at=time.time() + 600)
    async with asgi_client(app) as http:
        again = await Api(http).call("POST", "/", json=body, headers=key, check=False)
        assert again.status_code == 409 and "idempotent-replayed" not in again.headers  # executed, not replayed
    restarted = make_app(data_dir, idempotency_ttl_s=3600)  # startup sweeps expired records out
    assert restarted.state.db.fetch_all("SELECT * FROM idempotency") == []
    assert [r["token"] for r in restarted.state.db.fetch_all("SELECT token FROM file_links")] == ["live-link"]
    restarted.state.db.close()


async def test_an_oversized_wait_answer_is_replayed_as_its_bare_acceptance(data_dir):
    """Whole ?wait= answers (results included) were stored for every key, however large."""
    app = make_app(data_dir, idempotency_max_response_bytes=1024)
    async with asgi_client(app) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        body = {"prompts": [[1, 2, 3]] * 4, "sampling_params": {"max_tokens": 8, "n": 4}}
        posts = [
            await api.post_frame(job_id, "generate", body, params={"wait": 30}, headers={"Idempotency-Key": "g-1"})
            for _ in range(2)
        ]
        assert posts[0].json()["status"] == "done" and len(posts[0].content) > 1024
        assert posts[1].headers["idempotent-replayed"] == "true"
        assert posts[1].json() == {"request_id": posts[0].json()["request_id"], "job_id": job_id}
        rows = app.state.db.fetch_all("SELECT op FROM requests WHERE job_id = ? AND op = 'generate'", (job_id,))
        assert len(rows) == 1
        unkeyed = await api.post_frame(job_id, "generate", body, params={"wait": 30})
        # the route names what it accepted in a header of its own, for the idempotency layer alone
        assert not [name for post in (*posts, unkeyed) for name in post.headers if name.startswith("icefloe-")]


def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


async def test_non_finite_numbers_are_refused_naming_the_field(data_dir):
    """1e400 and Infinity parsed as infinity and were accepted: a step with that learning rate made the weights NaN."""
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        json_body = {"content-type": "application/json"}
        for number in ("1e400", "Infinity", "-1e999", "NaN"):
            response = await api.call(
                "POST", f"/{job_id}/step", content=f'{{"learning_rate": {number}}}', headers=json_body, check=False
            )
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument"), number
            assert "learning_rate=" in response.json()["message"], number
        # a body not labelled JSON is parsed by the step route itself, and is held to the same rule
        for headers in ({"content-type": "text/plain"}, {}):
            response = await api.call(
                "POST", f"/{job_id}/step", content='{"learning_rate": 1e400}', headers=headers, check=False
            )
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument"), headers
        stream = b'{"prompts": [[1, 2]], "sampling_params": {"temperature": Infinity, "max_tokens": 2}}'
        response = await api.call(
            "POST",
            f"/{job_id}/generate-stream",
            content=stream,
            headers={"content-type": "application/octet-stream"},
            check=False,
        )
        assert response.status_code == 400 and "sampling_params.temperature=inf" in response.json()["message"]
        batch = small_batch()  # a DSSST1 frame's plain values too: a NaN loss knob made a NaN loss
        batch["processing"]["config"] = {"clip_ratio": float("nan")}
        generate = {"prompts": [[1, 2]], "sampling_params": {"temperature": float("inf")}}
        for endpoint, body, field in (
            ("forward-backward", batch, "processing.config.clip_ratio=nan"),
            ("generate", generate, "sampling_params.temperature=inf"),
        ):
            response = await api.post_frame(job_id, endpoint, body, check=False)
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument"), endpoint
            assert f"frame holds non-finite numbers: {field}" in response.json()["message"]
        training = json.dumps({"sub_job_configs": [TRAINING], "vendor": {"knob": 1.0}})
        for text, field in (
            (training.replace("0.001", "1e400"), "sub_job_configs.0.training_config.optimizer.lr=inf"),
            (training.replace('"knob": 1.0', '"knob": NaN'), "vendor.knob=nan"),  # a passthrough key too
        ):
            response = await api.call("POST", "/", content=text, headers=json_body, check=False)
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument"), field
            assert field in response.json()["message"]
        assert [job["job_id"] for job in (await api.call("GET", "/")).json()["jobs"]] == [job_id]
        await api.fwd_bwd(job_id)
        assert (await api.run(job_id, "POST", "step", json={"learning_rate": 1e-3}))["global_step"] == 1


async def test_deeply_nested_bodies_get_400(data_dir):
    """A create body nested a few hundred levels, or a generate-stream body a few thousand, answered 500."""
    async with asgi_client(make_app(data_dir, engines="local")) as http:
        api = Api(http)
        job_id = await api.running(TRAINING, SAMPLING)
        json_body = {"content-type": "application/json"}
        training = json.dumps(TRAINING)
        for text in (
            f'{{"sub_job_configs": [{training}], "debug": {{"trace": {_nested(300)}}}}}',
            f'{{"sub_job_configs": [{training}], "vendor_knobs": {_nested(300)}}}',
            f'{{"sub_job_configs": [{training}], "debug": {{"trace": {_nested(5000)}}}}}',
        ):
            response = await api.call("POST", "/", content=text, headers=json_body, check=False)
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument")
            assert "nests deeper than 64 levels" in response.json()["message"]
        for depth in (300, 5000):
            stream = f'{{"prompts": [[1, 2]], "routing_key": {_nested(depth)}}}'.encode()
            response = await api.call(
                "POST",
                f"/{job_id}/generate-stream",
                content=stream,
                headers={"content-type": "application/octet-stream"},
                check=False,
            )
            assert (response.status_code, response.json()["code"]) == (400, "invalid_argument"), depth
            assert "generate-stream body" in response.json()["message"]
        nested_ok = {"sub_job_configs": [TRAINING], "debug": {"a": {"b": {"c": [[[1.5]]]}}}}
        assert (await api.call("POST", "/", json=nested_ok)).status_code == 200


async def test_a_large_body_is_held_once_in_one_buffer_made_only_after_half_of_it_came():
    """Chunks joined at the end held a body twice; a buffer of its Content-Length made at once let a client
    that declared 60 MiB and sent little hold 60 MiB."""
    from icefloe.service.middleware import _Arriving, read_body

    chunks = [bytes([index]) * 65_536 for index in range(64)]  # 4 MiB
    declared = sum(len(chunk) for chunk in chunks)
    arriving = _Arriving(60 * 2**20)
    for chunk in chunks:
        arriving.add(chunk)
    assert arriving.buffer is None  # 4 MiB of a declared 60: still chunks
    messages = iter([{"type": "http.request", "body": chunk, "more_body": True} for chunk in chunks[:-1]])

    async def receive() -> dict:
        return next(messages, {"type": "http.request", "body": chunks[-1], "more_body": False})

    body = await read_body(receive, declared=declared)
    assert type(body) is bytearray and body == b"".join(chunks)
    assert await read_body(iter_receive([b"ab", b"cd"]), declared=None) == b"abcd"


async def test_a_body_in_one_message_is_that_message_s_bytes_with_the_same_checks():
    """One message needs no gathering: its bytes are the body itself, checked as a body of several is."""
    from icefloe.protocol import InvalidRequestError, PayloadTooLargeError
    from icefloe.service.middleware import read_body

    body = b"{" + b"x" * 2**21  # past the size from which several messages are gathered in one buffer
    assert await read_body(iter_receive([body]), declared=len(body)) is body
    with pytest.raises(PayloadTooLargeError):
        await read_body(iter_receive([body]), max_bytes=len(body) - 1)

    def refuse_brace(head: bytes) -> None:
        if head.startswith(b"{"):
            raise InvalidRequestError("not a frame")

    with pytest.raises(InvalidRequestError):
        await read_body(iter_receive([body]), head_bytes=4, check_head=refuse_brace, drain=True)
    assert await read_body(iter_receive([b""])) == b""


def iter_receive(parts: list[bytes]):
    messages = iter([{"type": "http.request", "body": part, "more_body": index < len(parts) - 1}
                     for index, part in enumerate(parts)])  # fmt: skip

    async def receive() -> dict:
        return next(messages)

    return receive
