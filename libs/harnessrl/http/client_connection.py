"""One client-side HTTP/1.1 connection: send a request, parse its response.

One exchange at a time (no pipelining). The response body is either collected whole
(`response()`) or handed out as it arrives (`head()` then `read_chunk()`); in the second
case reading pauses while more than `_BUFFER_HIGH` bytes wait for the caller.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import httptools

from harnessrl.http.deadline import Deadline
from harnessrl.http.errors import ConnectionClosedError, ProtocolError, UpstreamTimeout

_BUFFER_HIGH = 256 * 1024
_BUFFER_LOW = 64 * 1024

Head = tuple[int, dict[str, str]]


class ClientConnection(asyncio.Protocol):
    """A pooled connection; `on_lost(self)` is called once when it closes."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        read_timeout_s: float,
        on_lost: Callable[[ClientConnection], None],
    ) -> None:
        self._loop = loop
        self._read_timeout_s = read_timeout_s
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._deadline = Deadline(loop, self._on_timeout)
        self.closed = False
        self.exchanges = 0  # requests sent on this connection
        self.received = False  # any byte of the current response arrived
        self._busy = False
        self._streaming = False
        self._bodyless = False  # HEAD: the response ends with its head
        self._status = 0
        self._raw: list[tuple[bytes, bytes]] = []
        self._headers: dict[str, str] = {}
        self._headers_done = False
        self._close_delimited = False
        self._complete = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._body: deque[bytes] = deque()
        self._buffered = 0
        self._read_paused = False
        self._waiter: asyncio.Future[None] | None = None

    @property
    def reusable(self) -> bool:
        """True when idle, open, and the last response allows another request."""
        return not self.closed and not self._busy and self._keep_alive

    def close(self) -> None:
        """Close the connection (idempotent); an exchange in progress fails."""
        self._keep_alive = False
        if self._transport is not None and not self.closed:
            self._transport.close()

    # Exchange

    def send(self, data: bytes, *, streaming: bool, bodyless: bool) -> None:
        """Start an exchange by writing a complete request.

        Raises ConnectionClosedError when the connection is already closed.
        """
        if self.closed or self._transport is None or self._transport.is_closing():
            raise ConnectionClosedError("the connection closed before the request was sent")
        self.exchanges += 1
        self.received = self._headers_done = self._complete = self._keep_alive = False
        self._busy = True
        self._streaming = streaming
        self._bodyless = bodyless
        self._error = None
        self._body = deque()
        self._buffered = 0
        self._transport.write(data)
        self._deadline.set(self._read_timeout_s)

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body) once the whole response has arrived."""
        while not self._complete:
            await self._wait()
        return self._status, self._headers, b"".join(self._body)

    async def head(self) -> Head:
        """(status, headers) once the response head has arrived."""
        while not self._headers_done:
            await self._wait()
        return self._status, self._headers

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last read (all of them, so a reader that
        fell behind catches up in one step); b"" once the body is complete."""
        body = self._body
        while not body:
            if self._complete:
                return b""
            await self._wait()
        if len(body) == 1:
            data = body.popleft()
        else:
            data = b"".join(body)
            body.clear()
        self._buffered -= len(data)
        if self._read_paused and self._buffered <= _BUFFER_LOW:
            self._read_paused = False
            if self._transport is not None and not self.closed:
                self._transport.resume_reading()
        return data

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._busy and not self._complete and self._error is None:
            self._error = error
        self._wake()

    def _finish(self) -> None:
        self._complete = True
        self._busy = False
        self._deadline.clear()
        self._wake()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        if not self._busy:
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        self.received = True
        self._deadline.set(self._read_timeout_s)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as err:
            self._fail(ProtocolError(f"malformed response: {err}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._deadline.cancel()
        if self._busy and self._close_delimited and self._headers_done and exc is None:
            self._finish()  # the body ends where the connection does
        elif exc is not None:
            self._fail(ConnectionClosedError(f"connection lost: {exc}"))
        else:
            self._fail(ConnectionClosedError("the upstream closed the connection"))
        self._busy = False
        self._on_lost(self)

    def _on_timeout(self) -> None:
        if self._read_paused:  # the caller is slow, not the upstream
            self._deadline.set(self._read_timeout_s)
            return
        self._fail(UpstreamTimeout(f"no response bytes for {self._read_timeout_s} s"))
        if self._transport is not None:
            self._transport.abort()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._raw = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:
            return  # an interim response (100 Continue, 103): the real one follows
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._raw}
        self._status = status
        self._headers = headers
        self._headers_done = True
        self._keep_alive = self._parser.should_keep_alive()
        framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "")
        no_body = self._bodyless or status in {204, 304}
        self._close_delimited = not framed and not no_body
        if self._bodyless:
            # httptools cannot be told the response to a HEAD has no body; end it here and
            # give the next exchange a fresh parser.
            self._parser = httptools.HttpResponseParser(self)
            self._finish()
        else:
            self._wake()

    def on_body(self, data: bytes) -> None:
        self._body.append(data)
        if self._streaming:
            self._buffered += len(data)
            if self._buffered > _BUFFER_HIGH and not self._read_paused:
                self._read_paused = True
                if self._transport is not None:
                    self._transport.pause_reading()
            self._wake()

    def on_message_complete(self) -> None:
        if not self._headers_done or self._complete:
            return  # the end of an interim response, or of a HEAD's answered head
        self._finish()
