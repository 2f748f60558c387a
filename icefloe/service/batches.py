"""Several requests in one POST: the ``batch_requests`` extension.

A client that submits a burst of numbered ops (a minibatch loop's ``fwd_bwd`` + ``step`` pairs)
sends them as one ``POST {prefix}/requests:batch`` instead of one POST each: on a small model the
HTTP exchange costs about as much CPU as the op itself. Each part runs through the rest of the
service's layers (idempotency keys, submission order, body checks, routes) exactly as if it had
come alone, concurrently with the others, and the answer carries every part's status, headers and
body once the last one is answered. The outer POST already passed the token and size checks; its
parts inherit the caller. A part that fails answers with its own status; the others are unaffected.
The envelope is :mod:`icefloe.wire.batch`; its head (the part list) is bounded by its declared
length before the body is kept, and by its JSON containers before it is parsed, on a worker thread.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from icefloe.protocol import InvalidRequestError, PayloadTooLargeError
from icefloe.service.errors import send_error
from icefloe.service.limits import (
    CHECK_ON_LOOP_BYTES,
    MAX_BATCH_HEAD_BYTES,
    MAX_BATCH_PARTS,
    MAX_JSON_BYTES,
    check_containers,
)
from icefloe.service.middleware import Recorder, is_json, read_body, replaying
from icefloe.wire.batch import BATCH_MEDIA_TYPE, BATCH_PATH, head_size, pack, unpack

__all__ = ["Batches"]


class Batches:
    """Pure ASGI: answers ``POST {prefix}/requests:batch`` by running each part through the inner app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"].endswith(BATCH_PATH):
            try:
                body = await read_body(receive, head_bytes=4, check_head=_check_head, drain=True)
            except PayloadTooLargeError as refused:
                await send_error(scope, _open, send, refused)
                return
            if body is not None:  # else the client went away
                await self._answer(scope, body, send)
        else:
            await self.app(scope, receive, send)

    async def _answer(self, scope: Scope, body: bytes, send: Send) -> None:
        try:
            small = len(body) < 4 or head_size(body) <= CHECK_ON_LOOP_BYTES  # a thread hop costs more
            parts = _unpack(body) if small else await asyncio.to_thread(_unpack, body)
            scopes = [_part_scope(scope, part) for part, _ in parts]
            _check_json_parts(scopes, [part_body for _, part_body in parts])
        except PayloadTooLargeError as refused:
            await send_error(scope, _open, send, refused)
            return
        except (ValueError, TypeError, KeyError) as exc:
            await send_error(
                scope, _open, send, InvalidRequestError(f"requests:batch: {exc}; send the {BATCH_MEDIA_TYPE} envelope")
            )
            return
        answers = await asyncio.gather(*(self._run(s, b) for s, (_, b) in zip(scopes, parts, strict=True)))
        envelope = pack([part for part, _ in answers], [answer for _, answer in answers])
        await Response(envelope, media_type=BATCH_MEDIA_TYPE)(scope, _open, send)

    async def _run(self, scope: Scope, body: bytes) -> tuple[dict[str, Any], bytes]:
        """One part through the inner app, as if it had come alone; returns its answer."""
        answer = Recorder()
        await self.app(scope, replaying(body, _open), answer)
        kept = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in answer.headers if k.lower() != b"content-length"]
        return {"status": answer.status or 500, "headers": kept}, answer.body


def _check_json_parts(scopes: list[Scope], bodies: list[bytes]) -> None:
    """The parts run at once, so what their JSON builds is held at once: their JSON bodies and the headers
    of their frames together are bounded as one JSON body is (28 parts of 2 MiB of numbers each cost
    +590 MiB, ten times the batch; each header alone may hold 131,072 loose values)."""
    json_bytes = sum(
        len(body) if is_json(part) else _json_in_octets(body) for part, body in zip(scopes, bodies, strict=True)
    )
    if json_bytes > MAX_JSON_BYTES:
        raise PayloadTooLargeError(
            f"requests:batch: its JSON parts and frame headers hold {json_bytes} bytes together; the parts of a "
            f"batch are read at once, so together they are at most {MAX_JSON_BYTES} bytes, as one JSON body is: "
            "send the rest in another batch, and data as tensors of DSSST1 frames"
        )


def _json_in_octets(body: bytes) -> int:
    """The JSON an octet body holds: a frame's header as its first 8 bytes declare it, else (JSON sent as
    octets, whose first bytes declare more than it holds) the whole body."""
    return min(len(body), struct.unpack_from("<Q", body)[0]) if len(body) >= 8 else len(body)


def _check_head(prefix: bytes) -> None:
    if len(prefix) == 4 and head_size(prefix) > MAX_BATCH_HEAD_BYTES:
        raise PayloadTooLargeError(
            f"requests:batch: the envelope declares a {head_size(prefix)}-byte part list; at most "
            f"{MAX_BATCH_HEAD_BYTES} bytes are accepted: send fewer parts, or fewer headers per part"
        )


def _unpack(body: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """The envelope's parts, its head bounded before it is parsed (off the loop: it may be a megabyte)."""
    check_containers(body[4 : 4 + head_size(body[:4])] if len(body) >= 4 else b"", "requests:batch's part list")
    parts = unpack(body)
    if not 0 < len(parts) <= MAX_BATCH_PARTS:
        raise ValueError(f"a batch holds 1 to {MAX_BATCH_PARTS} parts; got {len(parts)}")
    return parts


async def _open() -> Message:
    """A part's ``receive`` once its body is read: no disconnect to report while the outer POST is open."""
    return await asyncio.get_running_loop().create_future()


def _part_scope(outer: Scope, part: dict[str, Any]) -> Scope:
    """The outer scope (caller, client, server) with the part's method, path, query and own headers."""
    method, path, query = str(part["method"]).upper(), str(part["path"]), str(part.get("query") or "")
    if not path.startswith("/") or path.endswith(BATCH_PATH):
        raise ValueError(f"part path {path!r} must be an absolute API path other than the batch route")
    own = [(str(k).lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in part.get("headers") or ()]
    names = {k for k, _ in own} | {b"content-length", b"content-type"}
    inherited = [(k, v) for k, v in outer.get("headers", ()) if k not in names]
    return {
        **outer,
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": [*inherited, *own],
    }
