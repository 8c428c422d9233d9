"""A lean HTTP/1.1 server on asyncio protocols and httptools' C parser.

    server = HttpServer(handle, host="0.0.0.0", port=8000, on_error=openai_error)
    await server.start()
    ...
    await server.stop(grace_s=10)

`handle(request)` returns a Response or a StreamingResponse. The server answers on its own
only what never reaches the handler, and a handler that raised: see `ErrorRenderer`.
Runs on whatever loop is running (uvloop when the process installed it).
"""

from __future__ import annotations

import asyncio
from functools import partial

from harnessrl.http.body_budget import BodyBudget
from harnessrl.http.messages import (
    ErrorRenderer,
    Handler,
    Request,
    Response,
    StreamingResponse,
    json_error,
)
from harnessrl.http.server_connection import ServerConnection, ServerState
from harnessrl.logs import get_logger

__all__ = ["HttpServer", "Request", "Response", "StreamingResponse"]

log = get_logger(__name__)

_BACKLOG = 2048
_ABORT_WAIT_S = 1.0  # after grace: how long cancelled handlers get to unwind
MiB = 1024 * 1024


class HttpServer:
    """Serves `handler` on host:port; see the module docstring.

    Limits: a request head over `max_header_bytes` gets 431, a body over `max_body_bytes`
    413 (as soon as its declared or running size says so); a client that takes longer than
    `header_timeout_s` to send a head, or `body_timeout_s` from head to the body's end, gets
    408; an idle keep-alive connection is closed after `keepalive_timeout_s`. Each of these
    closes the connection.

    `max_buffered_bytes` bounds the request-body bytes held across all connections: those
    still arriving, and those of complete requests queued or in their handler (given back
    when the handler returns or the connection is lost). A body whose next bytes would pass
    it gets 503 with `Retry-After` and its connection is closed; other connections go on.
    503 rather than 413: the request is within the limits and the client did nothing wrong,
    the server is short of room for now, and clients (the OpenAI and Anthropic SDKs among
    them) retry a 503 after backing off, where a 413 tells them never to send it again. The
    default, 256 MiB, is 32 bodies at the 8 MiB limit all in flight at once; it must be at
    least `max_body_bytes` (ValueError otherwise), or a body at the limit could never fit.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str,
        port: int,
        max_body_bytes: int = 8 * 1024 * 1024,
        max_header_bytes: int = 64 * 1024,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        keepalive_timeout_s: float = 75.0,
        max_buffered_bytes: int = 256 * MiB,
        on_error: ErrorRenderer = json_error,
    ) -> None:
        if max_buffered_bytes < max_body_bytes:
            raise ValueError(
                f"max_buffered_bytes: {max_buffered_bytes} is less than max_body_bytes "
                f"({max_body_bytes}); a body at the limit could never be buffered"
            )
        self._host = host
        self._port = port
        self._budget = BodyBudget(max_buffered_bytes)
        self._settings = partial(
            ServerState,
            handler,
            on_error,
            max_body_bytes,
            max_header_bytes,
            header_timeout_s,
            body_timeout_s,
            keepalive_timeout_s,
            self._budget,
        )
        self._state: ServerState | None = None
        self._server: asyncio.Server | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The port listened on: the one the OS chose when 0 was asked, once started."""
        return self._port

    @property
    def buffered_bytes(self) -> int:
        """Request-body bytes held now against `max_buffered_bytes` (0 with no request)."""
        return self._budget.used

    @property
    def budget_refusals(self) -> int:
        """Requests refused with 503 because `max_buffered_bytes` was reached, since
        construction; only grows (a Prometheus counter's value)."""
        return self._budget.refusals

    async def start(self) -> None:
        """Start listening. Raises OSError when the address cannot be bound."""
        if self._server is not None or self._stopping is not None:
            raise RuntimeError("HttpServer.start() may be called once")
        loop = asyncio.get_running_loop()
        state = self._state = self._settings()
        self._server = await loop.create_server(
            lambda: ServerConnection(state, loop),
            self._host,
            self._port,
            backlog=_BACKLOG,
            reuse_address=True,
        )
        self._port = self._server.sockets[0].getsockname()[1]
        log.info("http server listening", host=self._host, port=self._port)

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop serving (idempotent; concurrent calls all wait for the one shutdown).

        Stops accepting, closes idle connections, lets requests in flight be answered (their
        connections close after the response) for up to `grace_s` seconds, then drops the
        remaining connections, cancelling their handlers.
        """
        if self._server is None:
            return
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._shutdown(self._server, grace_s))
        await asyncio.shield(self._stopping)

    async def _shutdown(self, server: asyncio.Server, grace_s: float) -> None:
        state = self._state
        assert state is not None  # set by start()
        state.stopping = True
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        if state.connections:
            try:
                async with asyncio.timeout(grace_s):
                    await state.all_closed.wait()
            except TimeoutError:
                log.warning("requests still in flight after grace", count=len(state.connections))
        tasks = [t for c in list(state.connections) if (t := c.abort()) is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=_ABORT_WAIT_S)
        await server.wait_closed()
        log.info("http server stopped", port=self._port)
