"""What HttpServer holds for request bodies: the server-wide budget, and that a connection
gone mid-body (closed, reset or timed out) leaves nothing of itself behind.

Real servers on loopback, raw bytes from asyncio streams. The garbage collector is off
while connections come and go: a connection must be freed by reference counting alone,
since a reference cycle would keep its partial body until some later collection.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import orjson
import pytest

from harnessrl.http import Handler, HttpServer, Request, Response
from harnessrl.http.body_buffer import HEAP_BYTES_MAX
from harnessrl.http.request_reader import RequestReader
from harnessrl.http.server_connection import ServerConnection
from tests.helpers import eventually

pytestmark = pytest.mark.integration

LIMIT = 1024 * 1024  # each server's max_body_bytes
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]
PerConnection = ServerConnection | RequestReader  # the reader holds the parser and the body


async def echo(request: Request) -> Response:
    return Response(200, [("content-type", "application/octet-stream")], request.body)


def render(status: int, message: str, path: str = "") -> Response:
    """An API's own error shape, as the gateway's renderer gives."""
    body = orjson.dumps({"error": {"message": message, "path": path}})
    return Response(status, [("content-type", "application/json")], body)


@asynccontextmanager
async def serving(handler: Handler = echo, **settings: Any) -> AsyncIterator[HttpServer]:
    server = HttpServer(handler, host="127.0.0.1", port=0, max_body_bytes=LIMIT, **settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1)


@contextmanager
def gc_disabled() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def stall(server: HttpServer, sent: int, declared: int = LIMIT) -> Stream:
    """A connection that sent a head declaring `declared` body bytes, then `sent` of them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/upload HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % declared)
    writer.write(b"x" * sent)
    await writer.drain()
    return reader, writer


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
    headers = dict(line.lower().split(": ", 1) for line in lines)
    body = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, body


def connection_objects(earlier: weakref.WeakSet[Any]) -> list[PerConnection]:
    """The server connections and their readers alive now that were not in `earlier`."""
    alive = (o for o in gc.get_objects() if isinstance(o, ServerConnection | RequestReader))
    return [o for o in alive if o not in earlier]


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0) rather than a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_a_body_that_would_overflow_the_budget_gets_503_and_the_others_proceed() -> None:
    async with serving(max_buffered_bytes=LIMIT * 5 // 2, on_error=render) as server:
        held = []
        for n in (1, 2):  # one at a time, so that which one overflows is known
            held.append(await stall(server, LIMIT - 1))
            await eventually(lambda n=n: server.buffered_bytes == n * (LIMIT - 1))
        reader, writer = await stall(server, LIMIT - 1)  # half of it fits
        status, headers, body = await answer(reader)
        assert (status, headers["retry-after"], headers["connection"]) == (503, "1", "close")
        error = {"message": "server busy: too many request bytes buffered", "path": "/v1/upload"}
        assert orjson.loads(body) == {"error": error}  # the route's shape, from on_error
        assert server.budget_refusals == 1
        assert server.buffered_bytes == 2 * (LIMIT - 1)  # its bytes back before it was answered
        writer.close()
        for reader, writer in held:  # the first two were never disturbed
            writer.write(b"y")
            status, _, body = await answer(reader)
            assert (status, len(body), body[-1:]) == (200, LIMIT, b"y")
            writer.close()
        await eventually(lambda: server.buffered_bytes == 0)


def test_a_budget_smaller_than_one_body_is_refused() -> None:
    with pytest.raises(ValueError, match="max_buffered_bytes"):
        HttpServer(echo, host="127.0.0.1", port=0, max_body_bytes=LIMIT, max_buffered_bytes=1)


async def test_connections_closed_or_reset_mid_body_are_freed_with_their_bytes() -> None:
    with gc_disabled():
        async with serving() as server:
            earlier = weakref.WeakSet(connection_objects(weakref.WeakSet()))
            # Past the heap allowance: the later bodies are kept in mappings of their own.
            n = HEAP_BYTES_MAX // LIMIT + 8
            streams = [await stall(server, LIMIT - 1) for _ in range(n)]
            await eventually(lambda: server.buffered_bytes == n * (LIMIT - 1))
            refs = [weakref.ref(o) for o in connection_objects(earlier)]
            assert len(refs) == 2 * n
            for i, (_, writer) in enumerate(streams):
                if i % 2:
                    reset(writer)
                else:
                    writer.close()
            del streams
            await eventually(lambda: all(ref() is None for ref in refs))
            assert server.buffered_bytes == 0


async def test_connections_timed_out_mid_body_are_freed_with_their_bytes() -> None:
    with gc_disabled():
        async with serving(body_timeout_s=0.5) as server:
            earlier = weakref.WeakSet(connection_objects(weakref.WeakSet()))
            streams = [await stall(server, LIMIT // 2) for _ in range(4)]
            refs = [weakref.ref(o) for o in connection_objects(earlier)]
            assert len(refs) == 2 * 4
            for reader, _ in streams:
                assert (await answer(reader))[0] == 408
            await eventually(lambda: all(ref() is None for ref in refs))  # server closed them
            assert server.buffered_bytes == 0
            for _, writer in streams:
                writer.close()


async def test_bodies_held_for_handlers_are_given_back_when_the_client_leaves() -> None:
    started, release, returning = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def slow(request: Request) -> Response:
        started.set()
        await release.wait()
        returning.set()  # its waiter runs after this task's step, the server's part included
        return await echo(request)

    async with serving(slow) as server:
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        request = b"POST /slow HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n" + b"x" * 1000
        writer.write(request * 3)  # pipelined: one in the handler, two queued behind it
        await started.wait()
        await eventually(lambda: server.buffered_bytes == 3000)
        writer.close()
        await eventually(lambda: server.buffered_bytes == 0)  # the handler is still running
        release.set()
        await returning.wait()
        assert server.buffered_bytes == 0  # nothing given back twice


@pytest.mark.parametrize("chunked", [False, True])
async def test_large_bodies_arriving_in_pieces_are_assembled_intact(chunked: bool) -> None:
    body = bytes(range(256)) * (3 * LIMIT // 4 // 256)  # past the mapping's first capacity
    async with serving() as server:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % len(body)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: t\r\n" + framing + b"\r\n\r\n")
        for start in range(0, len(body), 50_000):  # several reads: one is at most 256 KiB
            piece = body[start : start + 50_000]
            writer.write(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
        status, _, got = await answer(reader)
        assert (status, got == body) == (200, True)
        assert server.buffered_bytes == 0
        writer.close()
