"""Bytes on the wire: response and request heads, and chunked framing.

Heads are built as one str and encoded once (latin-1); header names or values that contain
CR or LF are refused with ValueError, so a value taken from a request cannot split a head.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from http import HTTPStatus

# Framing and hop-by-hop headers: the connection that writes a message owns them.
_OWNED = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
_STATUS_LINES: dict[int, str] = {}

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"

RequestHeaders = Mapping[str, str] | Sequence[tuple[str, str]]


def _status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 100 <= status <= 999:
            raise ValueError(f"status {status} is not a 3-digit HTTP status")
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n"
    return line


def _header_lines(headers: Iterable[tuple[str, str]]) -> tuple[str, bool]:
    """(the header lines, whether one asked for `connection: close`).

    Headers the connection owns (framing, hop-by-hop) are dropped.
    """
    lines = []
    close = False
    for name, value in headers:
        lower = name.lower()
        if lower in _OWNED:
            close = close or (lower == "connection" and "close" in value.lower())
            continue
        lines.append(f"{name}: {value}\r\n")
    text = "".join(lines)
    n = len(lines)
    if text.count("\n") != n or text.count("\r") != n:
        raise ValueError("a header name or value contains CR or LF")
    return text, close


def response_head(
    status: int,
    headers: Iterable[tuple[str, str]] | None,
    *,
    content_length: int | None,
    keep_alive: bool,
    http10: bool,
) -> tuple[bytes, bool]:
    """(the encoded head, keep_alive after honouring a handler's `connection: close`).

    `content_length=None` means a chunked body for HTTP/1.1 and a close-delimited one for
    HTTP/1.0 (the caller then passes keep_alive=False). No content-length is written for
    a status that has no body.
    """
    text, close = _header_lines(headers) if headers else ("", False)
    keep_alive = keep_alive and not close
    if content_length is not None:
        if has_body(status):
            text += f"content-length: {content_length}\r\n"
    elif not http10:
        text += "transfer-encoding: chunked\r\n"
    if not keep_alive:
        text += "connection: close\r\n"
    elif http10:
        text += "connection: keep-alive\r\n"
    return (_status_line(status) + text + "\r\n").encode("latin-1"), keep_alive


def has_body(status: int) -> bool:
    """False for the statuses whose responses never have a body (1xx, 204, 304)."""
    return status >= 200 and status not in {204, 304}


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body; `data` must not be empty (that would end the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def request_head(
    method: str, target: str, host: str, headers: RequestHeaders | None, body_length: int
) -> bytes:
    """The encoded head of a request with a `body_length`-byte body (Content-Length framed).

    A caller's `host` header replaces the default; its framing and hop-by-hop headers are
    dropped.
    """
    text = ""
    if headers:
        items = headers.items() if isinstance(headers, Mapping) else headers
        text, _ = _header_lines(items)
    if not _has_host(text):
        text = f"host: {host}\r\n" + text
    if body_length or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        text += f"content-length: {body_length}\r\n"
    return f"{method} {target} HTTP/1.1\r\n{text}\r\n".encode("latin-1")


def _has_host(text: str) -> bool:
    lower = text.lower()
    return lower.startswith("host:") or "\nhost:" in lower
