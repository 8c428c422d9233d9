"""One request body as it arrives: as the parser's pieces while few bytes arrive at once
across the server, else in a memory mapping of its own.

Pieces of 64-256 KiB live in malloc's heap; freed, they leave holes that glibc returns to
the OS only when nothing lives above them. So a server whose connections each stalled with
most of a large body kept that memory long after they were gone. Bodies therefore stay
pieces (cheap: no copy until the one join, memory the heap reuses) only while the pieces of
all bodies still arriving at the server total at most `HEAP_BYTES_MAX`; past that, a body
that is not complete with its next piece moves into an anonymous private mapping, whose
pages become resident only as they are written and are all returned by munmap the moment
the body is taken or dropped. Writing fresh pages costs page faults, which is why this is
not done for every body. A body that arrives in one piece is that piece, never copied.
"""

from __future__ import annotations

import mmap

from harnessrl.http.body_budget import BodyBudget

HEAP_BYTES_MAX = 16 * 1024 * 1024
_MAPPED_MIN = 256 * 1024  # first room of a chunked body's mapping; it doubles from there


class BodyBuffer:
    """The bytes of the body being read, one body after another; the caller keeps `size`
    within `limit`. Its pieces are counted in `budget.in_heap`."""

    __slots__ = ("_budget", "_declared", "_limit", "_map", "_pieces", "size")

    def __init__(self, limit: int, budget: BodyBudget) -> None:
        self._limit = limit
        self._budget = budget
        self._declared: int | None = None
        self._pieces: list[bytes] = []
        self._map: mmap.mmap | None = None
        self.size = 0

    def begin(self, declared: int | None) -> None:
        """Start a body of Content-Length `declared` (None: chunked), dropping any other."""
        self.clear()
        self._declared = declared

    def append(self, data: bytes) -> None:
        """Add the next piece of the body."""
        n = len(data)
        end = self.size + n
        if self._map is None:
            budget = self._budget
            if end == self._declared or budget.in_heap + n <= HEAP_BYTES_MAX:
                self._pieces.append(data)
                budget.in_heap += n
                self.size = end
                return
            self._map = mmap.mmap(-1, self._capacity(end), flags=mmap.MAP_PRIVATE)
            for piece in self._pieces:
                self._map.write(piece)
            budget.in_heap -= self.size
            self._pieces = []
        elif end > len(self._map):
            self._map.resize(self._capacity(end))
        self._map.write(data)
        self.size = end

    def take(self) -> bytes:
        """The whole body (one copy; none of a single piece); the buffer is empty after."""
        body = self._map[: self.size] if self._map is not None else b"".join(self._pieces)
        self.clear()
        return body

    def clear(self) -> None:
        """Drop what is held (a mapping is unmapped now). Idempotent."""
        if self._map is not None:
            self._map.close()
            self._map = None
        else:
            self._budget.in_heap -= self.size
        self._pieces = []
        self.size = 0

    def _capacity(self, end: int) -> int:
        """A declared body's exact length; a chunked one's room doubles, up to the limit."""
        if self._declared is not None:
            return max(self._declared, end)
        current = len(self._map) if self._map is not None else 0
        return max(end, min(self._limit, max(2 * current, _MAPPED_MIN)))
