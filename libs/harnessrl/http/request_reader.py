"""Bytes in, complete requests out: httptools' C parser plus the server's size limits.

The reader answers nothing itself. Each complete request goes to `on_request(request,
keep_alive)`; a request the server must refuse raises `Rejected` out of `feed`, after which
the reader must not be fed again. Body bytes are taken from the server's `BodyBudget` as
they arrive; those of a complete request become the connection's to give back, those of a
partial body are given back when it is refused or the reader is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import unquote_to_bytes

import httptools

from harnessrl.http.body_budget import BodyBudget
from harnessrl.http.body_buffer import BodyBuffer
from harnessrl.http.messages import Request
from harnessrl.logs import get_logger

log = get_logger(__name__)

BUSY_RETRY_AFTER_S = 1  # what a 503 for a full body budget tells the client to wait


class Rejected(Exception):
    """A request the server answers with `status` and then closes the connection."""

    def __init__(
        self, status: int, message: str, path: str = "", headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.path = path
        self.headers = headers  # added to the rendered error response


class RequestReader:
    """Assembles the requests of one connection, in order, bodies fully read.

    Refuses a head over `max_header_bytes` (431), a body whose declared or running size
    exceeds `max_body_bytes` (413, as soon as that is known), a body whose next bytes the
    `budget` has no room for (503 with Retry-After), and anything that is not HTTP/1.x
    (400). `on_continue()` is called when a request asks for `100-continue`.
    """

    def __init__(
        self,
        *,
        max_body_bytes: int,
        max_header_bytes: int,
        budget: BodyBudget,
        client: tuple[str, int] | None,
        disconnected: asyncio.Event,
        on_request: Callable[[Request, bool], None],
        on_continue: Callable[[], None],
    ) -> None:
        self._max_body = max_body_bytes
        self._max_head = max_header_bytes
        self._budget = budget
        self._client = client
        self._disconnected = disconnected
        self._on_request = on_request
        self._on_continue = on_continue
        # The parser holds this reader (its callbacks object) and the reader holds the
        # connection's callbacks: close() breaks both links, so that a closed connection is
        # freed by reference counting alone, its partial body with it.
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.in_message = False  # a request has begun and is not complete
        self.headers_done = False  # ... and its head is complete
        self.path = ""  # of the request being read, once known: for error responses
        self._head_fed = 0  # bytes fed while a head was incomplete: bounds a head in progress
        self._head_size = 0
        self._url = b""
        self._raw: list[tuple[bytes, bytes]] = []
        self._request: Request | None = None
        self._body = BodyBuffer(max_body_bytes, budget)  # its bytes all taken from the budget

    def feed(self, data: bytes) -> bool:
        """Parse `data`; False once the connection must not be read further (an upgrade).

        Raises Rejected for a request the server must refuse, having given the bytes of its
        partial body back to the budget. Must not be called after close().
        """
        try:
            return self._feed(data)
        except Rejected:
            self._drop_body()
            raise

    def close(self) -> None:
        """Free what the reader holds (partial head and body, the parser, the callbacks)
        and give its body bytes back to the budget. Idempotent; the connection is gone."""
        self._drop_body()
        self._parser = None
        self._request = None
        self._raw = []
        self._url = b""
        self._on_request = _ignore_request
        self._on_continue = _ignore

    def _drop_body(self) -> None:
        self._budget.give(self._body.size)
        self._body.clear()

    def _feed(self, data: bytes) -> bool:
        parser = self._parser
        assert parser is not None, "fed after close()"
        if not self.headers_done:
            self._head_fed += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return False  # the request was read; the server does not switch protocols
        except httptools.HttpParserCallbackError as err:
            if isinstance(err.__context__, Rejected):
                raise err.__context__ from None
            log.error("request parsing failed", error=repr(err.__context__))
            raise Rejected(500, "internal error", self._known_path()) from err
        except httptools.HttpParserError as err:
            raise Rejected(400, f"malformed request: {err}", self._known_path()) from err
        if self.in_message and not self.headers_done and self._head_fed > self._max_head:
            raise Rejected(431, "request headers too large", self._known_path())
        return True

    def _known_path(self) -> str:
        """The path of the request being read, as far as known: an error found in its
        headers is still answered in its route's shape."""
        if self.path or not self._url:
            return self.path
        try:
            return _split_target(self._url)[0]
        except Rejected:
            return ""

    # httptools callbacks

    def on_message_begin(self) -> None:
        self.in_message = True
        self.headers_done = False
        self.path = ""
        self._url = b""
        self._raw = []
        self._head_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw.append((name, value))
        self._head_size += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self._head_fed = 0
        if self._head_size > self._max_head:
            raise Rejected(431, "request headers too large", self._known_path())
        raw = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self._raw]
        headers = {n.lower(): v for n, v in raw}
        path, query = _split_target(self._url)
        self.path = path
        length = headers.get("content-length")
        declared = None if length is None else int(length)
        if declared is not None and declared > self._max_body:
            raise Rejected(413, "request body too large", path)
        parser = self._parser
        assert parser is not None  # called back by it
        version = parser.get_http_version()
        self._request = Request(
            parser.get_method().decode("ascii"),
            path,
            query,
            headers,
            raw,
            b"",
            self._client,
            version,
            self._disconnected,
        )
        self._body.begin(declared)
        if version == "1.1" and headers.get("expect", "").lower() == "100-continue":
            self._on_continue()

    def on_body(self, data: bytes) -> None:
        n = len(data)
        if self._body.size + n > self._max_body:
            raise Rejected(413, "request body too large", self.path)
        if not self._budget.take(n):
            retry = (("retry-after", str(BUSY_RETRY_AFTER_S)),)
            raise Rejected(503, "server busy: too many request bytes buffered", self.path, retry)
        self._body.append(data)

    def on_message_complete(self) -> None:
        request = self._request
        parser = self._parser
        assert request is not None and parser is not None  # on_headers_complete came first
        self._request = None
        request.body = self._body.take()  # its bytes the connection's to give back now
        self.in_message = self.headers_done = False
        self._head_fed = 0
        self._on_request(request, parser.should_keep_alive())


def _ignore_request(request: Request, keep_alive: bool) -> None:
    """What a closed reader calls instead of the connection's callback (never, in fact)."""


def _ignore() -> None:
    """What a closed reader calls instead of the connection's callback (never, in fact)."""


def _split_target(url: bytes) -> tuple[str, str]:
    """(percent-decoded path, raw query) of a request target."""
    if url[:1] == b"/":
        raw_path, _, query = url.partition(b"#")[0].partition(b"?")
    elif url == b"*":
        return "*", ""
    else:
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError as err:
            raise Rejected(400, "malformed request target") from err
        raw_path, query = parsed.path or b"/", parsed.query or b""
    if b"%" in raw_path:
        raw_path = unquote_to_bytes(raw_path)
    return raw_path.decode("utf-8", "replace"), query.decode("latin-1")
