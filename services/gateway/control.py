"""Pause, drain, resume: how the gateway holds calls while weights are swapped (sync mode).

While paused, a new call waits up to `hold_s` for the resume (a short swap is invisible to
the harness), then is answered 429 with Retry-After, which the OpenAI and Anthropic SDKs
retry by themselves. Calls already in flight are not affected; `drain()` waits for them.
"""

from __future__ import annotations

import asyncio


class Paused(Exception):
    """The gateway stayed paused longer than a call may wait; answer 429 (or `status`)."""

    def __init__(self, retry_after_s: int, *, why: str = "for a policy update", status: int = 429):
        super().__init__(f"the gateway is paused {why}; retry in {retry_after_s}s")
        self.retry_after_s = retry_after_s
        self.status = status


class Gate:
    """Open or paused; calls pass `enter()` before they reach an engine."""

    def __init__(
        self,
        *,
        hold_s: float,
        retry_after_s: int,
        why: str = "for a policy update",
        status: int = 429,
    ) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._hold_s = hold_s
        self._retry_after_s = retry_after_s
        self._why, self._status = why, status
        self.reason = ""

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self, reason: str) -> None:
        """Stop admitting calls (idempotent)."""
        self.reason = reason
        self._open.clear()

    def resume(self) -> None:
        """Admit calls again, including those holding (idempotent)."""
        self.reason = ""
        self._open.set()

    async def enter(self) -> None:
        """Return when calls are admitted; raise Paused after `hold_s` of pause."""
        if self._open.is_set():
            return
        try:
            await asyncio.wait_for(self._open.wait(), self._hold_s)
        except TimeoutError:
            raise Paused(self._retry_after_s, why=self._why, status=self._status) from None
