"""One server-side HTTP/1.1 connection: parse requests, run the handler, write responses.

httptools' C parser calls back as bytes arrive. A complete request goes to one task per
burst of requests, which answers it and then any requests pipelined behind it, in order.
Errors found while parsing (400, 413, 431) queue behind the requests already accepted and
stop the parser; the connection closes after answering them, draining what the client still
sends for a moment first, so that the error reaches it rather than a reset.

Reading pauses while the transport's write buffer is above its high-water mark or too many
pipelined requests wait, so a client that does not read cannot make the server buffer
without bound. Body bytes count against the server's `BodyBudget` from their arrival until
the handler of their request returned, or the connection is lost; a body the budget has no
room for is refused (503). When the connection is lost, it drops its reader, parser, queued
requests and timer, so that nothing but a handler still running keeps its bytes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import cast

from harnessrl.http import wire
from harnessrl.http.body_budget import BodyBudget
from harnessrl.http.deadline import Deadline
from harnessrl.http.messages import (
    ErrorRenderer,
    Handler,
    Request,
    Response,
    StreamingResponse,
    json_error,
)
from harnessrl.http.request_reader import Rejected, RequestReader
from harnessrl.http.streaming import aclose, pump
from harnessrl.logs import get_logger

log = get_logger(__name__)

_MAX_QUEUED = 16  # pipelined requests waiting before reading pauses
_LINGER_S = 1.0  # after an error response: how long to drain the client before closing
_SMALL_BODY = 16 * 1024  # below this, head and body are joined into one write
# What the read deadline is timing: set when the phase changes, never on each read, so a
# client trickling bytes cannot keep extending it.
_BUSY, _IDLE, _HEAD, _BODY = range(4)


@dataclass(slots=True)
class ServerState:
    """What the connections of one server share."""

    handler: Handler
    on_error: ErrorRenderer
    max_body_bytes: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    keepalive_timeout_s: float
    budget: BodyBudget
    connections: set[ServerConnection] = field(default_factory=set)
    stopping: bool = False
    all_closed: asyncio.Event = field(default_factory=asyncio.Event)


# (what to answer, whether the client keeps alive, its body bytes taken from the budget)
_Item = tuple[Request | Rejected, bool, int]


class ServerConnection(asyncio.Protocol):
    """The protocol instance of one accepted connection."""

    def __init__(self, state: ServerState, loop: asyncio.AbstractEventLoop) -> None:
        self._state = state
        self._loop = loop
        self._transport: asyncio.Transport = None  # type: ignore[assignment]  # set in connection_made
        self._reader: RequestReader = None  # type: ignore[assignment]  # set in connection_made
        self._deadline = Deadline(loop, self._on_deadline)
        self._phase = _IDLE
        self._disconnected = asyncio.Event()
        self._lost = False
        self._queue: deque[_Item] = deque()
        self._task: asyncio.Task[None] | None = None
        self._streaming = False
        self._dead = False  # reading stopped for good (an error, or an upgrade request)
        self._closed = False  # closing was started
        self._discarding = False
        self._continue_pending = False
        self._write_paused = False
        self._read_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._held = 0  # body bytes of the requests queued or in the handler, taken

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream server's transport
        peer = transport.get_extra_info("peername")
        state = self._state
        self._reader = RequestReader(
            max_body_bytes=state.max_body_bytes,
            max_header_bytes=state.max_header_bytes,
            budget=state.budget,
            client=(peer[0], peer[1]) if isinstance(peer, tuple) else None,
            disconnected=self._disconnected,
            on_request=self._enqueue,
            on_continue=self._on_continue,
        )
        state.connections.add(self)
        self._deadline.set(state.header_timeout_s)  # for the first request's head
        if state.stopping:
            self._close()  # accepted as the server stopped

    def data_received(self, data: bytes) -> None:
        if self._discarding or self._dead:
            return
        try:
            reading = self._reader.feed(data)
        except Rejected as reject:
            self._reject(reject)
            return
        if not reading:
            self._stop_reading()
        elif self._task is None:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disconnected.set()
        # The deadline's and the reader's callbacks are this connection's bound methods, and
        # the parser and the reader hold each other: closing them leaves no cycle behind.
        self._deadline.close()
        self._reader.close()
        self._queue.clear()
        self._state.budget.give(self._held)
        self._held = 0
        connections = self._state.connections
        connections.discard(self)
        if self._state.stopping and not connections:
            self._state.all_closed.set()
        self._wake_drain()
        if self._streaming and self._task is not None:
            self._task.cancel()  # the chunks' producer sees the cancellation and stops

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain()
        self._update_reading()

    # Answering

    def _enqueue(self, request: Request | Rejected, keep_alive: bool) -> None:
        held = len(request.body) if isinstance(request, Request) else 0
        self._held += held
        item = (request, keep_alive, held)
        if self._task is None:
            self._phase = _BUSY
            self._deadline.clear()
            self._task = self._loop.create_task(self._serve(item))
        else:
            self._queue.append(item)
            if len(self._queue) >= _MAX_QUEUED:
                self._update_reading()

    async def _serve(self, item: _Item) -> None:
        keep = False
        try:
            while True:
                keep = await self._respond(*item)
                if not keep or not self._queue:
                    break
                if self._write_paused:
                    await self._drain()
                item = self._queue.popleft()
                self._update_reading()
        finally:
            self._task = None
            if keep and not self._lost and not self._dead:
                self._become_idle()
            else:
                self._close()

    async def _respond(self, request: Request | Rejected, keep: bool, held: int) -> bool:
        """Answer one request; True when the connection stays open for the next."""
        if isinstance(request, Rejected):
            log.info(
                "request refused", status=request.status, reason=request.message, path=request.path
            )
            self._send_error(request.status, request.message, request.path, request.headers)
            self._linger_close()
            return False
        try:
            # object, not the declared type: an untyped handler may return anything.
            response = cast(object, await self._state.handler(request))
        except Exception:
            log.exception("handler failed", method=request.method, path=request.path)
            response = self._error_response(500, "internal error", request.path)
        finally:
            self._give_back(held)
        keep = keep and not self._state.stopping
        if self._lost:
            if isinstance(response, StreamingResponse):
                await aclose(response.chunks)
            return False
        if isinstance(response, StreamingResponse):
            return await self._send_stream(request, response, keep)
        if not isinstance(response, Response):
            log.error(
                "handler returned no Response", path=request.path, got=type(response).__name__
            )
            response = self._error_response(500, "internal error", request.path)
        return self._send(request, response, keep)

    def _send(self, request: Request, response: Response, keep: bool) -> bool:
        body = response.body
        try:
            head, keep = wire.response_head(
                response.status,
                response.headers,
                content_length=len(body),
                keep_alive=keep,
                http10=request.http_version == "1.0",
            )
        except (ValueError, TypeError, UnicodeEncodeError):
            log.exception("handler returned an invalid response", path=request.path)
            self._send_error(500, "internal error", request.path)
            return False
        if request.method == "HEAD" or not wire.has_body(response.status):
            self._transport.write(head)
        elif len(body) < _SMALL_BODY:
            self._transport.write(head + body)
        else:
            self._transport.writelines((head, body))
        return keep

    async def _send_stream(self, request: Request, response: StreamingResponse, keep: bool) -> bool:
        chunks = response.chunks
        http10 = request.http_version == "1.0"
        try:
            try:
                head, keep = wire.response_head(
                    response.status,
                    response.headers,
                    content_length=None,
                    keep_alive=keep and not http10,
                    http10=http10,
                )
            except (ValueError, TypeError, UnicodeEncodeError):
                log.exception("handler returned an invalid response", path=request.path)
                self._send_error(500, "internal error", request.path)
                return False
            self._transport.write(head)
            if request.method == "HEAD":
                return keep
            self._streaming = True
            complete = await pump(chunks, self._transport, self._drain, chunked=not http10)
            return complete and keep and not self._lost
        finally:
            self._streaming = False
            await aclose(chunks)

    def _give_back(self, held: int) -> None:
        """Give a handled request's body bytes back (connection_lost gave back all)."""
        if not self._lost:
            self._held -= held
            self._state.budget.give(held)

    def _on_continue(self) -> None:
        if self._task is None:
            self._transport.write(wire.CONTINUE)
        else:
            self._continue_pending = True  # sent once the responses before it are

    def _error_response(self, status: int, message: str, path: str = "") -> Response:
        try:
            return self._state.on_error(status, message, path)
        except Exception:
            log.exception("on_error failed", status=status)
            return json_error(status, message)

    def _send_error(
        self, status: int, message: str, path: str = "", extra: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """Write an error response that closes the connection, with the `extra` headers."""
        if self._lost:
            return
        response = self._error_response(status, message, path)
        try:
            head, _ = wire.response_head(
                response.status,
                [*(response.headers or ()), *extra],
                content_length=len(response.body),
                keep_alive=False,
                http10=False,
            )
        except (ValueError, TypeError, UnicodeEncodeError):
            log.exception("on_error returned an invalid response", status=status)
            response = json_error(status, message)
            head, _ = wire.response_head(
                status,
                [*(response.headers or ()), *extra],
                content_length=len(response.body),
                keep_alive=False,
                http10=False,
            )
        self._transport.write(head + response.body)

    async def _drain(self) -> None:
        """Wait until the write buffer is below its low-water mark or the peer is gone."""
        if self._lost or not self._write_paused:
            return
        waiter = self._drain_waiter = self._loop.create_future()
        await waiter

    def _wake_drain(self) -> None:
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # Connection state

    def _become_idle(self) -> None:
        if self._state.stopping and not self._reader.in_message:
            self._close()
            return
        if self._continue_pending:
            self._continue_pending = False
            self._transport.write(wire.CONTINUE)
        self._update_reading()
        self._arm()

    def _arm(self) -> None:
        """Point the read deadline at the current phase, if that changed."""
        reader = self._reader
        phase = _BODY if reader.headers_done else _HEAD if reader.in_message else _IDLE
        if phase != self._phase:
            self._phase = phase
            state = self._state
            timeouts = (
                0.0,
                state.keepalive_timeout_s,
                state.header_timeout_s,
                state.body_timeout_s,
            )
            self._deadline.set(timeouts[phase])

    def _update_reading(self) -> None:
        pause = self._write_paused or self._dead or len(self._queue) >= _MAX_QUEUED
        if pause == self._read_paused or self._discarding or self._transport.is_closing():
            return
        self._read_paused = pause
        if pause:
            self._transport.pause_reading()
        else:
            self._transport.resume_reading()

    def _stop_reading(self) -> None:
        self._dead = True
        self._update_reading()
        if self._task is None:
            self._close()

    def _reject(self, reject: Rejected) -> None:
        self._dead = True
        self._update_reading()
        self._enqueue(reject, False)

    def _on_deadline(self) -> None:
        if self._discarding:
            self._transport.abort()
        elif self._task is None:
            if self._reader.in_message:
                self._send_error(408, "request timeout", self._reader.path)
                self._linger_close()
            else:
                self._close()  # idle keep-alive, or nothing ever sent

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._deadline.cancel()
            self._transport.close()

    def _linger_close(self) -> None:
        """Close after the response, reading and dropping what the client still sends."""
        if self._closed or self._lost:
            return
        if not self._transport.can_write_eof():
            self._close()
            return
        self._closed = self._discarding = True
        try:
            self._transport.write_eof()
        except OSError:  # the client reset the connection already: nothing left to drain
            self._transport.abort()
            return
        if self._read_paused:
            self._read_paused = False
            self._transport.resume_reading()
        self._deadline.set(_LINGER_S)

    # Server control

    def shutdown(self) -> None:
        """Close now when idle, else once the request being answered is answered."""
        if self._task is None and not self._reader.in_message:
            self._close()

    def abort(self) -> asyncio.Task[None] | None:
        """Drop the connection now; returns the task answering it, if any (being cancelled)."""
        task = self._task
        if task is not None:
            task.cancel()
        self._transport.abort()
        return task
