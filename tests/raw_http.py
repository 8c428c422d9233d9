"""Raw HTTP/1.1 on a blocking socket, for tests that send what no client library would."""

from __future__ import annotations

import contextlib
import socket


def exchange(port: int, data: bytes, *, timeout: float = 2.0) -> bytes:
    """Send `data` on a fresh loopback connection; what the server sent until its first
    response was complete, it closed the connection, or it went quiet for `timeout` (a
    request it still waits the rest of). Blocking: call it in a thread from async tests."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(OSError):  # refused mid-send: its answer is still readable
            sock.sendall(data)
        received = b""
        while not _complete(received):
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            received += chunk
        return received


def first_response(received: bytes) -> tuple[int, bytes] | None:
    """(status, body) of the first response in `received`; None when there is none."""
    if not received:
        return None
    head, _, body = received.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split(b" ")
    assert status_line[0] in (b"HTTP/1.1", b"HTTP/1.0"), received[:200]
    return int(status_line[1]), body[: _length(head)]


def _complete(data: bytes) -> bool:
    head, sep, body = data.partition(b"\r\n\r\n")
    return bool(sep) and len(body) >= _length(head)


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0
