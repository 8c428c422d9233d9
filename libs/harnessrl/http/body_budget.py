"""The bytes of request bodies one server holds across all its connections, against a limit.

Each connection's body limit bounds one request; this bounds their sum, which is what
connections that each send most of an allowed body and then stall would otherwise grow
without end. Bytes are taken as they arrive (never on a declared Content-Length alone, so
a head costs an attacker nothing it could hold) and given back once the handler has
returned or the connection is gone. It also counts how many of the bytes still arriving are
kept in malloc's heap, which decides how the next ones are kept (see body_buffer.py).
"""

from __future__ import annotations


class BodyBudget:
    """A counter of buffered body bytes with a ceiling; one per server, on its loop only."""

    __slots__ = ("in_heap", "limit", "refusals", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        """Bytes taken and not yet given back."""
        self.refusals = 0
        """How many times `take` said no since the server started."""
        self.in_heap = 0
        """Bytes of bodies not yet complete kept as the parser's pieces (BodyBuffer's)."""

    def take(self, n: int) -> bool:
        """Take `n` bytes; False (and one more refusal counted) when that would exceed the
        limit, in which case nothing is taken."""
        if self.used + n > self.limit:
            self.refusals += 1
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        """Give back `n` bytes taken before."""
        self.used -= n
