"""The server's request and response types, and the hook that renders error responses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import orjson


@dataclass(slots=True, eq=False)
class Request:
    """One HTTP request, body fully read.

    `headers` maps lower-case names to values (the last one wins when a name repeats);
    `raw_headers` keeps every header as sent, in order, with its original case. Names and
    values are decoded as latin-1. `path` is percent-decoded (UTF-8) and has no query;
    `query` is the raw query string without the "?". `disconnected` is shared by the
    requests of one connection and is set once the peer has gone away.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    raw_headers: list[tuple[str, str]]
    body: bytes
    client: tuple[str, int] | None
    http_version: str
    disconnected: asyncio.Event


@dataclass(slots=True)
class Response:
    """A complete response; the server sets `content-length` (and drops framing headers)."""

    status: int = 200
    headers: list[tuple[str, str]] | None = None
    body: bytes = b""


@dataclass(slots=True)
class StreamingResponse:
    """A response whose body is written chunk by chunk as `chunks` yields it.

    Sent with `transfer-encoding: chunked` (close-delimited to an HTTP/1.0 client). Each
    non-empty bytes object is written as soon as it is yielded. When the client goes away,
    the task iterating `chunks` is cancelled and `chunks.aclose()` is awaited, so an async
    generator sees CancelledError or GeneratorExit and can abort the work feeding it.
    """

    status: int
    headers: list[tuple[str, str]] | None
    chunks: AsyncIterator[bytes]


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


class ErrorRenderer(Protocol):
    """`on_error(status, message, path) -> Response` renders the responses the server gives
    itself: 400 (malformed), 408 (too slow), 413 (body too large), 431 (head too large), 503
    (no room left in the server's body budget; the server adds `retry-after`) and 500 (the
    handler raised or returned something unusable). `path` is the request's, once
    its request line was read ("" before), so an API can answer in its routes' own error
    shapes. The returned response is sent as it is, plus `connection: close` where the
    server closes the connection."""

    def __call__(self, status: int, message: str, path: str = "") -> Response: ...


def json_error(status: int, message: str, path: str = "") -> Response:
    """The default ErrorRenderer: `{"error": message}` as JSON."""
    body = orjson.dumps({"error": message})
    return Response(status, [("content-type", "application/json")], body)
