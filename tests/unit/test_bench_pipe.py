"""The byte pipe `bench gateway` measures beside the gateway copies every byte both ways:
a real HTTP server behind it answers plain and streamed requests, kept alive, exactly as it
does directly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from harnessrl.bench.pipe import _Downstream
from harnessrl.http import HttpClient, HttpServer, Response, StreamingResponse


async def test_the_pipe_relays_requests_answers_and_streams() -> None:
    big = bytes(range(256)) * 4096  # 1 MiB: flow control on both sides

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(50):
            yield b"data: %d\n\n" % i

    async def handle(request: Any) -> Response | StreamingResponse:
        if request.path == "/stream":
            return StreamingResponse(200, [("content-type", "text/event-stream")], chunks())
        return Response(200, [("content-type", "application/octet-stream")], request.body)

    server = HttpServer(handle, host="127.0.0.1", port=0)
    await server.start()
    loop = asyncio.get_running_loop()
    pipe = await loop.create_server(lambda: _Downstream(("127.0.0.1", server.port)), "127.0.0.1", 0)
    port = pipe.sockets[0].getsockname()[1]
    client = HttpClient(f"http://127.0.0.1:{port}", max_connections=2)
    try:
        for _ in range(3):  # kept-alive connections carry several exchanges
            echoed = await client.request("POST", "/echo", body=big)
            assert echoed.status == 200 and echoed.body == big
        async with client.stream("POST", "/stream", body=b"{}") as stream:
            data = await stream.read()
        assert data == b"".join(b"data: %d\n\n" % i for i in range(50))
    finally:
        await client.close()
        pipe.close()
        await server.stop()
