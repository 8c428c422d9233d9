"""A resettable deadline for one connection, backed by at most one loop timer.

Connections move their deadline on every request (or every read); a fresh timer each time
would cost a heap operation per move. Here moving a deadline later only stores a float: the
pending timer, when it fires early, re-arms itself for the new time. Only moving a deadline
earlier than the pending timer replaces the timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# Loop timers may fire up to a clock tick early; treat that as on time rather than spin.
_SLACK_S = 0.001


class Deadline:
    """Calls `on_expire()` once the deadline set last passes, unless cleared first."""

    __slots__ = ("_loop", "_on_expire", "_timer", "_timer_at", "_when")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expire: Callable[[], None]) -> None:
        self._loop = loop
        self._on_expire = on_expire
        self._when: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def set(self, seconds: float) -> None:
        """Expire `seconds` from now (replacing any earlier setting)."""
        when = self._loop.time() + seconds
        self._when = when
        if self._timer is not None:
            if when >= self._timer_at:
                return
            self._timer.cancel()
        self._timer = self._loop.call_at(when, self._fire)
        self._timer_at = when

    def clear(self) -> None:
        """Do not expire until set again (the pending timer, if any, lapses harmlessly)."""
        self._when = None

    def cancel(self) -> None:
        """Clear and drop the pending timer: for when the connection is gone."""
        self._when = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Cancel for good, dropping `on_expire` too: a bound method of the deadline's owner
        would keep the owner alive as long as the deadline. set() must not follow."""
        self.cancel()
        self._on_expire = _expired

    def _fire(self) -> None:
        self._timer = None
        when = self._when
        if when is None:
            return
        if self._loop.time() + _SLACK_S < when:
            self._timer = self._loop.call_at(when, self._fire)
            self._timer_at = when
            return
        self._when = None
        self._on_expire()


def _expired() -> None:
    """What a closed deadline would call (it never fires: its timer is cancelled)."""
