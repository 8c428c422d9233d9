"""When the next episode may start, and which policy version it starts under.

Capacity: at most `max_in_flight` episodes run at once. Policy: the trainer announces
versions (PolicyVersion) and engines report loading them (PolicyLoaded); a version is
served once `engines` replicas loaded it. In sync mode an episode starts only when the
served version is the newest announced one (no rollout straddles a swap). In async mode
episodes always start; those whose start version falls more than `max_staleness` behind
the served one are reported by `stale()` so the controller ends and retries them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable


class EpisodeAdmission:
    def __init__(
        self, *, max_in_flight: int, sync: bool, max_staleness: int, engines: int, version: int = 0
    ) -> None:
        self._max = max_in_flight
        self._sync = sync
        self._max_staleness = max_staleness
        self._engines = engines
        self.announced = version
        self.serving = version
        self._loaded: dict[int, set[str]] = {}
        self._running: dict[Hashable, int] = {}
        self._changed = asyncio.Condition()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def acquire(self, key: Hashable) -> int:
        """Wait for a slot (and, in sync mode, for the engines); returns the version served."""
        async with self._changed:
            await self._changed.wait_for(self._may_start)
            self._running[key] = self.serving
            return self.serving

    async def release(self, key: Hashable) -> None:
        async with self._changed:
            self._running.pop(key, None)
            self._changed.notify_all()

    async def announced_version(self, version: int) -> None:
        async with self._changed:
            self.announced = max(self.announced, version)
            self._changed.notify_all()

    async def loaded(self, version: int, engine: str) -> bool:
        """Record an engine's load; True when that made a newer version served."""
        async with self._changed:
            self._loaded.setdefault(version, set()).add(engine)
            if version > self.serving and len(self._loaded[version]) >= self._engines:
                self.serving = version
                self.announced = max(self.announced, version)
                self._loaded = {v: e for v, e in self._loaded.items() if v >= version}
                self._changed.notify_all()
                return True
            return False

    def stale(self) -> list[Hashable]:
        """Running episodes that started more than max_staleness versions ago (async)."""
        if self._sync:
            return []
        return [k for k, v in self._running.items() if self.serving - v > self._max_staleness]

    def _may_start(self) -> bool:
        if len(self._running) >= self._max:
            return False
        return not self._sync or self.serving >= self.announced
