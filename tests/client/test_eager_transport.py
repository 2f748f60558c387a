"""EagerTransport against a real TCP server on loopback: framing, reuse, failures, and when bytes leave.

The server is a few lines of asyncio that answer by path, so each test can make it misbehave
the way a real service or network does (close an idle connection, stop mid-answer, never answer).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from icefloe.client.remote.eager import EagerTransport


class Server:
    """HTTP/1.1 on a loopback port; ``/echo`` echoes the body, other paths misbehave by name."""

    def __init__(self) -> None:
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split(" ")[1]
                length = next(
                    (int(v) for k, _, v in (h.partition(": ") for h in lines[1:]) if k.lower() == "content-length"), 0
                )
                body = await reader.readexactly(length)
                if not await self._answer(path, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write the answer for ``path``; False closes the connection."""
        if path == "/echo":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        elif path == "/close-after":
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            return False
        elif path == "/chunked":
            writer.write(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
        elif path == "/cut":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
            await writer.drain()
            return False
        elif path == "/silent":
            await asyncio.sleep(30)
        await writer.drain()
        return True


def _client(base_url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=base_url, transport=EagerTransport())


def run(coro_fn: Callable[[Server, str], Awaitable[None]]) -> Callable[[], None]:
    """A test that runs ``coro_fn(server, base_url)`` on a fresh loop with a fresh server."""

    def wrapper() -> None:
        async def main() -> None:
            running = Server()
            base_url = await running.start()
            try:
                await coro_fn(running, base_url)
            finally:
                await running.stop()

        asyncio.run(main())

    wrapper.__name__ = coro_fn.__name__
    return wrapper


@run
async def test_answers_and_reuses_one_connection(server: Server, base_url: str) -> None:
    async with _client(base_url) as client:
        for i in range(3):
            response = await client.post("/echo", content=f"body {i}".encode())
            assert (response.status_code, response.content) == (200, f"body {i}".encode())
        assert server.connections == 1
        assert (await client.get("/echo")).content == b""


@run
async def test_a_large_body_arrives_whole(server: Server, base_url: str) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB: written in parts, buffered by the transport
    async with _client(base_url) as client:
        response = await client.post("/echo", content=payload)
    assert response.content == payload


@run
async def test_a_chunked_answer_is_joined(server: Server, base_url: str) -> None:
    async with _client(base_url) as client:
        response = await client.post("/chunked", content=b"x")
    assert (response.status_code, response.content) == (201, b"abcde")


@run
async def test_connection_close_is_honoured(server: Server, base_url: str) -> None:
    async with _client(base_url) as client:
        assert (await client.post("/close-after", content=b"x")).content == b"ok"
        assert (await client.post("/echo", content=b"again")).content == b"again"
    assert server.connections == 2


@run
async def test_a_connection_the_server_closed_while_idle_is_not_reused(server: Server, base_url: str) -> None:
    async with _client(base_url) as client:
        await client.post("/echo", content=b"one")
        for writer in server._writers:
            writer.close()  # the server's keep-alive timeout, say
        await asyncio.sleep(0.05)
        assert (await client.post("/echo", content=b"two")).content == b"two"
    assert server.connections == 2


@run
async def test_an_answer_cut_short_raises_remote_protocol_error(server: Server, base_url: str) -> None:
    async with _client(base_url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/cut", content=b"x")
        assert (await client.post("/echo", content=b"next")).content == b"next"


@run
async def test_no_answer_within_the_read_timeout_raises_read_timeout(server: Server, base_url: str) -> None:
    async with _client(base_url) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/silent", content=b"x", timeout=httpx.Timeout(5.0, read=0.2))
        assert (await client.post("/echo", content=b"fresh")).content == b"fresh"
    assert server.connections == 2  # the timed-out connection was dropped, not reused


def test_a_refused_connection_raises_connect_error() -> None:
    async def main() -> None:
        probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        async with _client(f"http://127.0.0.1:{port}") as client:
            with pytest.raises(httpx.ConnectError):
                await client.post("/echo", content=b"x")

    asyncio.run(main())


@run
async def test_the_request_is_on_the_wire_in_the_task_step_that_sends_it(server: Server, base_url: str) -> None:
    """The point of the transport: another task's work between awaits cannot delay the request."""
    async with _client(base_url) as client:
        await client.post("/echo", content=b"warm")  # a connection is idle now
        written: list[str] = []

        async def trace(name: str, info: object) -> None:
            written.append(name)

        sending = asyncio.ensure_future(client.post("/echo", content=b"now", extensions={"trace": trace}))
        await asyncio.sleep(0)  # one loop turn: the sending task runs its first step, and no more
        assert written == ["http11.send_request_body.complete"]
        assert (await sending).content == b"now"


@run
async def test_aclose_closes_every_socket(server: Server, base_url: str) -> None:
    transport = EagerTransport()
    async with httpx.AsyncClient(base_url=base_url, transport=transport) as client:
        await asyncio.gather(*(client.post("/echo", content=b"x") for _ in range(4)))
    assert transport._open == set()
    assert server.connections == 4


def test_https_is_refused_with_a_clear_error() -> None:
    async def main() -> None:
        async with httpx.AsyncClient(transport=EagerTransport()) as client:
            with pytest.raises(httpx.UnsupportedProtocol, match="plain http"):
                await client.get("https://127.0.0.1:1/")

    asyncio.run(main())


def test_an_idle_connection_closed_while_the_loop_was_busy_is_not_reused() -> None:
    """The server's keep-alive timeout fires while the caller computes without awaiting: the EOF sits
    unread in the socket, and only a look at the socket tells the connection is gone."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                seen = b""
                while b"\r\n\r\nx" not in seen:
                    seen += conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                time.sleep(0.05)  # then the keep-alive runs out
        listener.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main() -> None:
        async with _client(f"http://127.0.0.1:{port}") as client:
            assert (await client.post("/", content=b"x")).content == b"ok"
            time.sleep(0.3)  # synchronous work: the loop does not see the server's close
            assert (await client.post("/", content=b"x")).content == b"ok"

    asyncio.run(main())
    thread.join(timeout=5)
