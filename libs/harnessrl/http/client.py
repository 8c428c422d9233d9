"""A lean keep-alive HTTP/1.1 client for one upstream, on asyncio protocols and httptools.

    client = HttpClient("http://engine:8000")
    response = await client.request("POST", "/v1/completions", headers=..., body=payload)
    async with client.stream("POST", "/v1/chat/completions", body=payload) as response:
        async for data in response.iter_sse():
            ...
    await client.close()

Request bodies are bytes sent with Content-Length; response bodies may be framed by
Content-Length, chunked, or the connection's end. A request that fails on a pooled
connection before any response byte arrived (the upstream had closed it while idle) is
sent again, once, on a new connection. Errors: see `harnessrl.http.errors`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from urllib.parse import urlsplit

from harnessrl.http import wire
from harnessrl.http.client_connection import ClientConnection
from harnessrl.http.errors import ConnectionClosedError
from harnessrl.http.pool import ConnectionPool
from harnessrl.http.sse import SseDecoder
from harnessrl.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ClientResponse:
    """A complete response; `headers` maps lower-case names to values (last one wins)."""

    status: int
    headers: dict[str, str]
    body: bytes


class StreamResponse:
    """A response whose body is read as it arrives, once, by one of the three readers."""

    __slots__ = ("_connection", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], connection: ClientConnection):
        self.status = status
        self.headers = headers  # lower-case names to values (last one wins)
        self._connection = connection

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last read, waiting for some; b"" at the
        body's end (one await per read, for relays that count every step)."""
        return await self._connection.read_chunk()

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunk boundaries are the network's, not the
        sender's). Raises ConnectionClosedError, UpstreamTimeout or ProtocolError."""
        read = self._connection.read_chunk
        while data := await read():
            yield data

    async def iter_sse(self) -> AsyncIterator[bytes]:
        """The `data` payload of each Server-Sent Event (see `harnessrl.http.sse`)."""
        decoder = SseDecoder()
        read = self._connection.read_chunk
        while data := await read():
            for event in decoder.feed(data):
                yield event

    async def read(self) -> bytes:
        """The rest of the body."""
        return b"".join([data async for data in self.iter_chunks()])


class _StreamContext:
    """`async with client.stream(...) as response`: the connection goes back to the pool
    on exit only when the body was read to its end; otherwise it is closed."""

    __slots__ = ("_bodyless", "_client", "_connection", "_request")

    def __init__(self, client: HttpClient, request: bytes, bodyless: bool) -> None:
        self._client = client
        self._request = request
        self._bodyless = bodyless
        self._connection: ClientConnection | None = None

    async def __aenter__(self) -> StreamResponse:
        connection = await self._client._send(
            self._request, streaming=True, bodyless=self._bodyless
        )
        self._connection = connection
        status, headers = await connection.head()
        return StreamResponse(status, headers, connection)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._client._pool.release(connection)
        return False  # exceptions propagate


class HttpClient:
    """Keep-alive connections to `base_url` (http://host[:port][/prefix]).

    `path` arguments are appended to the prefix. At most `max_connections` are open; a
    request beyond that waits for one. `connect_timeout_s` bounds making a connection
    (ConnectError); `read_timeout_s` bounds every wait for response bytes, head or body
    (UpstreamTimeout).
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 256,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 600.0,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"base_url must be http://host[:port][/prefix], got {base_url!r}")
        host, port = url.hostname, url.port or 80
        self._prefix = url.path.rstrip("/")
        named = f"[{host}]" if ":" in host else host
        self._host_header = named if port == 80 else f"{named}:{port}"
        self._pool = ConnectionPool(
            host,
            port,
            max_connections=max_connections,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
        )

    @property
    def connects(self) -> int:
        """How many connections this client has opened (for tests and metrics)."""
        return self._pool.connects

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: wire.RequestHeaders | None = None,
        body: bytes = b"",
    ) -> ClientResponse:
        """Send a request and read the whole response.

        Raises ConnectError, ConnectionClosedError, UpstreamTimeout or ProtocolError;
        RuntimeError once the client is closed.
        """
        request = self._encode(method, path, headers, body)
        connection = await self._send(request, streaming=False, bodyless=method == "HEAD")
        try:
            status, response_headers, payload = await connection.response()
        finally:
            self._pool.release(connection)
        return ClientResponse(status, response_headers, payload)

    def stream(
        self,
        method: str,
        path: str,
        *,
        headers: wire.RequestHeaders | None = None,
        body: bytes = b"",
    ) -> _StreamContext:
        """An async context manager yielding a StreamResponse once the head has arrived.

        Entering raises what `request` raises; reading the body raises the same errors
        except ConnectError. Leaving before the body was read to its end closes the
        connection instead of returning it to the pool.
        """
        request = self._encode(method, path, headers, body)
        return _StreamContext(self, request, method == "HEAD")

    async def close(self) -> None:
        """Close all connections; requests in flight fail (idempotent)."""
        await self._pool.close()

    def _encode(
        self, method: str, path: str, headers: wire.RequestHeaders | None, body: bytes
    ) -> bytes:
        head = wire.request_head(method, self._prefix + path, self._host_header, headers, len(body))
        return head + body if body else head

    async def _send(self, request: bytes, *, streaming: bool, bodyless: bool) -> ClientConnection:
        """A connection on which `request` was sent and the response head has arrived.

        Sent again, once, on a new connection when a pooled one turns out to have been
        closed by the upstream before any byte of the response arrived.
        """
        connection = await self._pool.acquire()
        reused = connection.exchanges > 0
        try:
            return await self._start(connection, request, streaming, bodyless)
        except ConnectionClosedError:
            if not reused or connection.received:
                raise
        log.debug("pooled connection was closed by the upstream; sending again")
        connection = await self._pool.acquire(fresh=True)
        return await self._start(connection, request, streaming, bodyless)

    async def _start(
        self, connection: ClientConnection, request: bytes, streaming: bool, bodyless: bool
    ) -> ClientConnection:
        try:
            connection.send(request, streaming=streaming, bodyless=bodyless)
            await connection.head()
        except BaseException:
            self._pool.release(connection)  # unusable now: the pool closes it
            raise
        return connection
