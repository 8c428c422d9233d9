"""Server-Sent Events: the `data` payloads of an event stream, one per event.

Follows the WHATWG event-stream rules that matter for a proxy: lines end with CRLF, LF or
CR (a CRLF split across two chunks counts once); a blank line dispatches the event; the
`data` lines of one event are joined with "\\n"; one space after the colon is dropped;
comments (lines starting with ":") and the other fields (event, id, retry) are skipped; an
event with no `data` line is not dispatched, nor is one cut off by the end of the stream.
"""

from __future__ import annotations


class SseDecoder:
    """Feed it the body's bytes as they arrive; it returns each complete event's data."""

    __slots__ = ("_data", "_pending", "_skip_lf")

    def __init__(self) -> None:
        self._pending = b""  # an incomplete line
        self._skip_lf = False  # the last chunk ended with CR: a leading LF is its other half
        self._data: list[bytes] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data payloads of the events that `chunk` completes, in order."""
        if not (self._pending or self._data or self._skip_lf) and chunk.endswith(b"\n\n"):
            events = _whole_events(chunk)
            if events is not None:
                return events
        if self._skip_lf:
            self._skip_lf = False
            if chunk.startswith(b"\n"):
                chunk = chunk[1:]
        text = self._pending + chunk
        if b"\r" in text:
            self._skip_lf = text.endswith(b"\r")
            text = text.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = text.split(b"\n")
        self._pending = lines.pop()
        return self._dispatch(lines) if lines else []

    def _dispatch(self, lines: list[bytes]) -> list[bytes]:
        events = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    events.append(b"\n".join(data))
                    data = self._data = []
            elif line.startswith(b"data"):
                name, _, value = line.partition(b":")
                if name == b"data":
                    data.append(value[1:] if value.startswith(b" ") else value)
        return events


def _whole_events(chunk: bytes) -> list[bytes] | None:
    """The payloads of a chunk made of whole one-line `data: ...` events, as engines send
    them (the common case, read without the line machinery); None for anything else."""
    if not chunk.startswith(b"data: ") or b"\r" in chunk:
        return None
    events = chunk[6:-2].split(b"\n\ndata: ")
    # Two newlines per event, none inside one (no multi-line data, no other field).
    return events if chunk.count(b"\n") == 2 * len(events) else None
