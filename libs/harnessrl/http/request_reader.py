"""Bytes in, complete requests out: httptools' C parser plus the server's size limits.

The reader answers nothing itself. Each complete request goes to `on_request(request,
keep_alive)`; a request the server must refuse raises `Rejected` out of `feed`, after which
the reader must not be fed again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import unquote_to_bytes

import httptools

from harnessrl.http.messages import Request
from harnessrl.logs import get_logger

log = get_logger(__name__)


class Rejected(Exception):
    """A request the server answers with `status` and then closes the connection."""

    def __init__(self, status: int, message: str, path: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.path = path


class RequestReader:
    """Assembles the requests of one connection, in order, bodies fully read.

    Refuses a head over `max_header_bytes` (431), a body whose declared or running size
    exceeds `max_body_bytes` (413, as soon as that is known), and anything that is not
    HTTP/1.x (400). `on_continue()` is called when a request asks for `100-continue`.
    """

    def __init__(
        self,
        *,
        max_body_bytes: int,
        max_header_bytes: int,
        client: tuple[str, int] | None,
        disconnected: asyncio.Event,
        on_request: Callable[[Request, bool], None],
        on_continue: Callable[[], None],
    ) -> None:
        self._max_body = max_body_bytes
        self._max_head = max_header_bytes
        self._client = client
        self._disconnected = disconnected
        self._on_request = on_request
        self._on_continue = on_continue
        self._parser = httptools.HttpRequestParser(self)
        self.in_message = False  # a request has begun and is not complete
        self.headers_done = False  # ... and its head is complete
        self.path = ""  # of the request being read, once known: for error responses
        self._head_fed = 0  # bytes fed while a head was incomplete: bounds a head in progress
        self._head_size = 0
        self._url = b""
        self._raw: list[tuple[bytes, bytes]] = []
        self._request: Request | None = None
        self._body: list[bytes] = []
        self._body_size = 0

    def feed(self, data: bytes) -> bool:
        """Parse `data`; False once the connection must not be read further (an upgrade).

        Raises Rejected for a request the server must refuse.
        """
        if not self.headers_done:
            self._head_fed += len(data)
        try:
            self._parser.feed_data(data)
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
        if length is not None and int(length) > self._max_body:
            raise Rejected(413, "request body too large", path)
        parser = self._parser
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
        self._body = []
        self._body_size = 0
        if version == "1.1" and headers.get("expect", "").lower() == "100-continue":
            self._on_continue()

    def on_body(self, data: bytes) -> None:
        self._body_size += len(data)
        if self._body_size > self._max_body:
            raise Rejected(413, "request body too large", self.path)
        self._body.append(data)

    def on_message_complete(self) -> None:
        request = self._request
        assert request is not None  # on_headers_complete came first
        self._request = None
        request.body = b"".join(self._body)
        self._body = []
        self.in_message = self.headers_done = False
        self._head_fed = 0
        self._on_request(request, self._parser.should_keep_alive())


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
