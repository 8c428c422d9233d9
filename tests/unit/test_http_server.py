"""HttpServer over real loopback sockets: raw bytes in, raw bytes checked, plus httpx."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest

from harnessrl.http import (
    Handler,
    HttpServer,
    Request,
    Response,
    StreamingResponse,
)


@asynccontextmanager
async def serving(handler: Handler, **settings: Any) -> AsyncIterator[HttpServer]:
    server = HttpServer(handler, host="127.0.0.1", port=0, **settings)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1)


async def echo(request: Request) -> Response:
    headers = [("content-type", "application/octet-stream"), ("x-path", request.path)]
    return Response(200, headers, request.body or request.method.encode())


async def connect(server: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response off the wire (Content-Length, chunked, or close-delimited body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    status_line, *lines = head.decode("latin-1").split("\r\n")[:-2]
    headers = dict(line.lower().split(": ", 1) for line in lines)
    if "content-length" in headers:
        return (
            int(status_line.split()[1]),
            headers,
            await reader.readexactly(int(headers["content-length"])),
        )
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while size := int(await reader.readline(), 16):
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        await reader.readexactly(2)
        return int(status_line.split()[1]), headers, body
    return int(status_line.split()[1]), headers, await asyncio.wait_for(reader.read(), 5)


async def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    clients = set()

    async def handler(request: Request) -> Response:
        clients.add(request.client)
        return await echo(request)

    async with serving(handler) as server:
        reader, writer = await connect(server)
        for i in range(3):
            body = f"request {i}".encode()
            writer.write(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
            )
            writer.write(body)
            status, headers, got = await read_response(reader)
            assert (status, got, headers["content-length"]) == (200, body, str(len(body)))
            assert "connection" not in headers
        writer.close()
    assert len(clients) == 1


async def test_pipelined_requests_are_answered_in_order() -> None:
    async def handler(request: Request) -> Response:
        await asyncio.sleep(0.05 if request.path == "/slow" else 0)
        return await echo(request)

    async with serving(handler) as server:
        reader, writer = await connect(server)
        writer.write(
            b"GET /slow HTTP/1.1\r\n\r\nGET /fast HTTP/1.1\r\n\r\n"
            b"POST /last HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\nabc"
        )
        answers = [await read_response(reader) for _ in range(3)]
        assert [h["x-path"] for _, h, _ in answers] == ["/slow", "/fast", "/last"]
        assert answers[2][1]["connection"] == "close"
        assert answers[2][2] == b"abc"
        assert await reader.read() == b""  # Connection: close honoured
        writer.close()


async def test_chunked_request_body_is_assembled() -> None:
    async with serving(echo) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(0.01)
        writer.write(b"6\r\n world\r\n0\r\n\r\n")
        assert (await read_response(reader))[2] == b"hello world"
        writer.close()


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    async with serving(echo) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /e HTTP/1.1\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        assert (await read_response(reader))[:1] == (200,)
        writer.close()


async def test_expect_100_continue_with_a_body_over_the_limit_gets_413() -> None:
    async with serving(echo, max_body_bytes=10) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /e HTTP/1.1\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n")
        assert (await read_response(reader))[0] == 413
        writer.close()


async def test_head_gets_the_headers_of_get_without_the_body() -> None:
    async with serving(echo) as server:
        reader, writer = await connect(server)
        writer.write(b"HEAD /h HTTP/1.1\r\n\r\nGET /h HTTP/1.1\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"content-length: 4\r\n" in head  # len(b"HEAD")
        status, _, body = await read_response(reader)  # the next bytes are GET's answer
        assert (status, body) == (200, b"GET")
        writer.close()


async def test_body_over_the_limit_gets_413_without_reading_it() -> None:
    async with serving(echo, max_body_bytes=1024) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /big HTTP/1.1\r\nContent-Length: 1000000000\r\n\r\n" + b"x" * 1000)
        status, headers, body = await read_response(reader)
        assert status == 413
        assert headers["connection"] == "close"
        assert orjson.loads(body) == {"error": "request body too large"}
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed
        writer.close()


async def test_chunked_body_over_the_limit_gets_413_as_it_grows() -> None:
    async with serving(echo, max_body_bytes=1024) as server:
        reader, writer = await connect(server)
        writer.write(b"POST /big HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(b"400\r\n" + b"x" * 1024 + b"\r\n1\r\ny\r\n")  # 1025 bytes, no end
        assert (await read_response(reader))[0] == 413
        writer.close()


async def test_headers_over_the_limit_get_431() -> None:
    async with serving(echo, max_header_bytes=1024) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 2000 + b"\r\n\r\n")
        assert (await read_response(reader))[0] == 431
        writer.close()
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nX-Endless: " + b"a" * 4000)  # head never ends
        assert (await read_response(reader))[0] == 431
        writer.close()


async def test_slow_client_gets_408_and_is_closed() -> None:
    async with serving(echo, header_timeout_s=0.1, body_timeout_s=0.1) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # head never completed
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (408, "close")
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        reader, writer = await connect(server)
        writer.write(b"POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")  # body cut short
        assert (await read_response(reader))[0] == 408
        writer.close()


async def test_idle_keep_alive_connection_is_closed_silently() -> None:
    async with serving(echo, keepalive_timeout_s=0.1) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        assert (await read_response(reader))[0] == 200
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


async def test_garbage_gets_400() -> None:
    async with serving(echo) as server:
        reader, writer = await connect(server)
        writer.write(b"\x16\x03\x01 this is not http\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (400, "close")
        writer.close()


async def test_raising_handler_gets_500_logged_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("secret detail")
        return await echo(request)

    async with serving(handler) as server:
        reader, writer = await connect(server)
        with caplog.at_level(logging.ERROR, logger="harnessrl.http"):
            writer.write(b"GET /boom HTTP/1.1\r\n\r\n")
            status, _, body = await read_response(reader)
        assert (status, orjson.loads(body)) == (500, {"error": "internal error"})
        assert b"secret" not in body
        failed = [r for r in caplog.records if r.getMessage() == "handler failed"]
        assert failed and failed[0].exc_info is not None
        writer.write(b"GET /fine HTTP/1.1\r\n\r\n")  # same connection still serves
        assert (await read_response(reader))[:1] == (200,)
        writer.close()


async def test_on_error_renders_the_servers_own_errors() -> None:
    def render(status: int, message: str, path: str = "") -> Response:
        return Response(
            status, [("x-shape", "custom"), ("x-path", path or "-")], f"{status}:{message}".encode()
        )

    async def handler(request: Request) -> Response:
        raise ValueError("no")

    async with serving(handler, on_error=render) as server:
        reader, writer = await connect(server)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert (status, headers["x-shape"], body) == (500, "custom", b"500:internal error")
        assert headers["x-path"] == "/"  # the renderer knows the route
        writer.write(b"nonsense\r\n\r\n")
        assert (await read_response(reader))[2].startswith(b"400:malformed request")
        writer.close()


async def test_streaming_response_is_written_as_it_is_produced() -> None:
    first_seen = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        yield b"first"
        await first_seen.wait()  # only once the client has the first chunk
        yield b"second"

    async def handler(request: Request) -> StreamingResponse:
        return StreamingResponse(200, [("content-type", "text/plain")], chunks())

    async with serving(handler) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /s HTTP/1.1\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"transfer-encoding: chunked" in head
        assert await asyncio.wait_for(reader.readuntil(b"first\r\n"), 5) == b"5\r\nfirst\r\n"
        first_seen.set()
        assert await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5) == (
            b"6\r\nsecond\r\n0\r\n\r\n"
        )
        writer.close()


async def test_client_disconnect_during_a_stream_closes_the_handlers_iterator() -> None:
    finished = asyncio.Event()
    forever = asyncio.Event()

    async def chunks() -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\n"
            await forever.wait()  # e.g. waiting on the upstream engine
            yield b"never"
        finally:
            finished.set()

    async def handler(request: Request) -> StreamingResponse:
        return StreamingResponse(200, None, chunks())

    async with serving(handler) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /s HTTP/1.1\r\n\r\n")
        await asyncio.wait_for(reader.readuntil(b"data: 1\n\n\r\n"), 5)
        writer.close()
        await asyncio.wait_for(finished.wait(), 5)


async def test_a_client_that_does_not_read_holds_back_the_stream() -> None:
    produced = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal produced
        while True:
            produced += 1
            yield b"x" * 65536

    async def handler(request: Request) -> StreamingResponse:
        return StreamingResponse(200, None, chunks())

    async with serving(handler) as server:
        _, writer = await connect(server)
        writer.write(b"GET /s HTTP/1.1\r\n\r\n")
        await asyncio.sleep(0.3)  # not reading: kernel buffers fill, then the server waits
        assert 0 < produced < 500  # unbounded, it would be tens of thousands by now
        writer.close()


async def test_http10_gets_a_close_delimited_stream() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b"one "
        yield b"two"

    async def handler(request: Request) -> StreamingResponse:
        return StreamingResponse(200, None, chunks())

    async with serving(handler) as server:
        reader, writer = await connect(server)
        writer.write(b"GET /s HTTP/1.0\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert (status, headers["connection"], body) == (200, "close", b"one two")
        writer.close()


async def test_stop_lets_an_in_flight_request_finish() -> None:
    started = asyncio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        await asyncio.sleep(0.2)
        return Response(200, None, b"done")

    server = HttpServer(handler, host="127.0.0.1", port=0)
    await server.start()
    reader, writer = await connect(server)
    idle_reader, idle_writer = await connect(server)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    await started.wait()
    stopping = asyncio.create_task(server.stop(grace_s=5))
    assert await asyncio.wait_for(idle_reader.read(), 5) == b""  # idle: closed at once
    status, headers, body = await read_response(reader)
    assert (status, headers["connection"], body) == (200, "close", b"done")
    await asyncio.wait_for(stopping, 5)
    await server.stop()  # idempotent
    with pytest.raises(OSError):
        await connect(server)
    writer.close()
    idle_writer.close()


async def test_stop_cancels_handlers_still_running_after_grace() -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response()

    server = HttpServer(handler, host="127.0.0.1", port=0)
    await server.start()
    _, writer = await connect(server)
    writer.write(b"GET / HTTP/1.1\r\n\r\n")
    await started.wait()
    await asyncio.wait_for(server.stop(grace_s=0.1), 5)
    assert cancelled.is_set()
    writer.close()


async def test_an_independent_client_httpx_talks_to_the_server() -> None:
    async def handler(request: Request) -> Response | StreamingResponse:
        if request.path == "/stream":

            async def chunks() -> AsyncIterator[bytes]:
                for i in range(3):
                    yield f"data: {i}\n\n".encode()

            return StreamingResponse(200, [("content-type", "text/event-stream")], chunks())
        payload = {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "auth": request.headers.get("authorization"),
            "body": request.body.decode(),
        }
        return Response(201, [("content-type", "application/json")], orjson.dumps(payload))

    async def upload() -> AsyncIterator[bytes]:
        yield b"part one, "
        yield b"part two"

    async with (
        serving(handler) as server,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client,
    ):
        got = await client.post(
            "/v1/a%20b?x=1&y=%20", json={"k": 1}, headers={"Authorization": "Bearer t"}
        )
        assert got.status_code == 201
        assert got.json() == {
            "method": "POST",
            "path": "/v1/a b",
            "query": "x=1&y=%20",
            "auth": "Bearer t",
            "body": '{"k":1}',
        }
        assert (await client.post("/u", content=upload())).json()["body"] == ("part one, part two")
        async with client.stream("GET", "/stream") as streamed:
            lines = [line async for line in streamed.aiter_lines() if line]
        assert lines == ["data: 0", "data: 1", "data: 2"]
        assert (await client.head("/h")).status_code == 201


async def test_a_handler_returning_an_unusable_response_gets_500() -> None:
    async def handler(request: Request) -> Any:
        if request.path == "/inject":
            return Response(200, [("x-evil", "a\r\nset-cookie: stolen")], b"")
        return None

    async with serving(handler) as server:
        for path in (b"/inject", b"/none"):
            reader, writer = await connect(server)
            writer.write(b"GET " + path + b" HTTP/1.1\r\n\r\n")
            status, headers, _ = await read_response(reader)
            assert (status, "set-cookie" in headers) == (500, False)
            writer.close()
