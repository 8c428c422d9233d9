"""HttpClient against real loopback servers: HttpServer, hand-written raw servers that
misbehave on purpose, and the standard library's http.server as an independent one."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import uvloop

from harnessrl.http import (
    ConnectError,
    ConnectionClosedError,
    HttpClient,
    HttpServer,
    ProtocolError,
    Request,
    Response,
    SseDecoder,
    StreamingResponse,
    UpstreamTimeout,
)
from harnessrl.retry import is_retryable

RawServe = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(serve: RawServe) -> AsyncIterator[tuple[str, list[int]]]:
    """(base URL, accepted-connection counter) of a server running `serve` per connection."""
    accepted = [0]
    writers: list[asyncio.StreamWriter] = []

    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        writers.append(writer)
        try:
            await serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: what some tests do on purpose
        finally:
            writer.close()

    server = await asyncio.start_server(run, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()
        for writer in writers:
            writer.close()
        await server.wait_closed()


@asynccontextmanager
async def serving(
    handler: Callable[[Request], Awaitable[Response | StreamingResponse]],
) -> AsyncIterator[tuple[str, set[tuple[str, int] | None]]]:
    """(base URL, the client addresses seen: one per connection) of an HttpServer."""
    peers: set[tuple[str, int] | None] = set()

    async def handle(request: Request) -> Response | StreamingResponse:
        peers.add(request.client)
        return await handler(request)

    server = HttpServer(handle, host="127.0.0.1", port=0)
    await server.start()
    try:
        yield f"http://127.0.0.1:{server.port}", peers
    finally:
        await server.stop(grace_s=1)


async def echo(request: Request) -> Response:
    return Response(200, [("x-method", request.method)], request.body or request.path.encode())


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_pool_reuses_connections() -> None:
    async with serving(echo) as (url, peers):
        client = HttpClient(url, max_connections=2)
        for i in range(5):
            assert (await client.request("POST", "/", body=b"%d" % i)).body == b"%d" % i
        assert len(peers) == 1
        answers = await asyncio.gather(*(client.request("GET", f"/{i}") for i in range(10)))
        assert [a.body for a in answers] == [f"/{i}".encode() for i in range(10)]
        assert len(peers) == 2 == client.connects  # never more than max_connections
        await client.close()
        await client.close()  # idempotent
        with pytest.raises(RuntimeError):
            await client.request("GET", "/")


async def test_stale_pooled_connection_is_retried_on_a_fresh_one() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK)
        await reader.readuntil(b"\r\n\r\n")  # the next request arrives as the server closes
        writer.transport.abort()

    async with raw_server(serve) as (url, accepted):
        client = HttpClient(url)
        assert (await client.request("GET", "/")).body == b"ok"
        assert (await client.request("GET", "/")).body == b"ok"  # retried transparently
        assert accepted[0] == 2
        await client.close()


async def test_a_fresh_connection_closed_before_answering_is_not_retried() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")

    async with raw_server(serve) as (url, accepted):
        client = HttpClient(url)
        with pytest.raises(ConnectionClosedError) as caught:
            await client.request("GET", "/")
        assert is_retryable(caught.value)
        assert accepted[0] == 1
        await client.close()


async def test_a_connection_closed_mid_response_is_not_retried() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(OK)
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf")
            await writer.drain()
            return

    async with raw_server(serve) as (url, accepted):
        client = HttpClient(url)
        await client.request("GET", "/")
        with pytest.raises(ConnectionClosedError):
            await client.request("GET", "/")
        assert accepted[0] == 1
        await client.close()


def test_sse_decoder_follows_the_event_stream_rules() -> None:
    decoder = SseDecoder()
    stream = (
        b": a comment\r\n"
        b"event: message\r\ndata: line one\r\ndata:line two\r\nid: 7\r\n\r\n"
        b'data: {"x": 1}\n\n'
        b"retry: 10\n\n"  # no data: not an event
        b"data\rdata: cr only\r\r"
        b"data: cut off at the end"
    )
    events = []
    for i in range(len(stream)):  # one byte at a time: every split, CRLF included
        events += decoder.feed(stream[i : i + 1])
    assert events == [b"line one\nline two", b'{"x": 1}', b"\ncr only"]
    assert SseDecoder().feed(stream) == events


async def test_stream_yields_chunks_and_sse_events_as_they_arrive() -> None:
    release = asyncio.Event()

    async def handler(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: one\r\n\r\n: keep-alive\r\n\r\ndata: tw"
            await release.wait()
            yield b"o\r\ndata: lines\r\n\r\n"

        return StreamingResponse(200, [("content-type", "text/event-stream")], chunks())

    async with serving(handler) as (url, _):
        client = HttpClient(url)
        async with client.stream("POST", "/v1/chat", body=b"{}") as response:
            assert (response.status, response.headers["content-type"]) == (
                200,
                "text/event-stream",
            )
            events = response.iter_sse()
            assert await anext(events) == b"one"  # before the server produced the rest
            release.set()
            assert [e async for e in events] == [b"two\nlines"]
        assert (await client.request("GET", "/")).status == 200
        assert client.connects == 1  # read to the end: the connection went back to the pool
        await client.close()


async def test_chunked_and_close_delimited_bodies_are_read() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        writer.write(b"2\r\nde\r\n0\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the ")
        await writer.drain()
        writer.write(b"end")

    async with raw_server(serve) as (url, accepted):
        client = HttpClient(url)
        assert (await client.request("GET", "/")).body == b"abcde"
        assert (await client.request("GET", "/")).body == b"until the end"
        assert accepted[0] == 1
        async with client.stream("GET", "/") as response:  # a new connection
            assert await response.read() == b"abcde"
        await client.close()


async def test_connect_refused_raises_connect_error() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}", connect_timeout_s=1)
    with pytest.raises(ConnectError) as caught:
        await client.request("GET", "/")
    assert isinstance(caught.value, ConnectionError)
    assert is_retryable(caught.value)
    await client.close()


async def test_read_timeout_raises_upstream_timeout() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nslow")
        await asyncio.sleep(5)

    async with raw_server(serve) as (url, _):
        client = HttpClient(url, read_timeout_s=0.1)
        with pytest.raises(UpstreamTimeout) as caught:
            await client.request("GET", "/")
        assert isinstance(caught.value, TimeoutError)
        assert is_retryable(caught.value)
        await client.close()


async def test_garbage_from_the_upstream_raises_protocol_error() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")

    async with raw_server(serve) as (url, _):
        client = HttpClient(url)
        with pytest.raises(ProtocolError) as caught:
            await client.request("GET", "/")
        assert not is_retryable(caught.value)
        await client.close()


async def test_leaving_a_stream_early_does_not_poison_the_pool() -> None:
    async def handler(request: Request) -> Response | StreamingResponse:
        if request.path != "/stream":
            return await echo(request)

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(100):
                yield b"data: %d\n\n" % i
                await asyncio.sleep(0.001)

        return StreamingResponse(200, None, chunks())

    async with serving(handler) as (url, peers):
        client = HttpClient(url)
        async with client.stream("GET", "/stream") as response:
            async for event in response.iter_sse():
                assert event == b"0"
                break
        answer = await client.request("POST", "/after", body=b"clean")
        assert (answer.status, answer.body) == (200, b"clean")
        assert len(peers) == 2  # the half-read connection was closed, not reused
        await client.close()


async def test_head_and_no_content_responses_end_with_their_head() -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/prefix/empty":
            return Response(204)
        return await echo(request)

    async with serving(handler) as (url, peers):
        client = HttpClient(url + "/prefix")
        head = await client.request("HEAD", "/x")
        assert (head.status, head.headers["content-length"], head.body) == (200, "9", b"")
        assert (await client.request("DELETE", "/empty")).status == 204
        assert (await client.request("GET", "/x")).body == b"/prefix/x"
        assert len(peers) == 1
        await client.close()


class _StdlibHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in (b"data: a\n\n", b"data: b\n", b"\n"):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def stdlib_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StdlibHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_an_independent_server_http_server_talks_to_the_client() -> None:
    with stdlib_server() as url:
        client = HttpClient(url)
        answer = await client.request("POST", "/v1", headers={"Content-Type": "x"}, body=b"{}")
        assert (answer.status, answer.headers["content-type"], answer.body) == (
            200,
            "application/json",
            b"{}",
        )
        async with client.stream("GET", "/sse") as response:
            assert [e async for e in response.iter_sse()] == [b"a", b"b"]
        await client.close()


def test_client_and_server_run_on_uvloop() -> None:
    async def main() -> bytes:
        async with serving(echo) as (url, _):
            client = HttpClient(url)
            try:
                return (await client.request("POST", "/", body=b"on uvloop")).body
            finally:
                await client.close()

    assert uvloop.run(main()) == b"on uvloop"
