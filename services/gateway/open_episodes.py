"""Open episodes on this gateway: call numbering, calls in flight, closing.

An episode attempt is open from its first call until the controller closes it. Each call
it completes gets the next sequence number (so seqs are 0..n-1 without gaps, in the order
the calls completed) and its ModelCall's delivery is kept. Closing refuses further calls,
waits for those in flight, then for every ModelCall to be acknowledged, and only then may
EpisodeClosed{call_count} be published: a consumer that sees it can count on all the calls
being on the topic before it.

A gateway that restarts (or takes over an episode) learns from hrl.calls where each episode
stood: `restore()` records, per episode attempt, the next seq and whether it was closed, and
the first call of such an episode after the restart goes on from there.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from harnessrl.episode_token import EpisodeClaims
from harnessrl.v1 import events_pb2 as pb

Key = tuple[str, int]  # (episode id, attempt)


class EpisodeClosedError(Exception):
    """A call arrived for an episode attempt that has been closed."""


@dataclass(eq=False)
class OpenEpisode:
    claims: EpisodeClaims
    calls: int = 0
    in_flight: int = 0
    closed: bool = False
    closed_count: int | None = None  # call_count, once EpisodeClosed was acknowledged
    pending: list[asyncio.Future[object]] = field(default_factory=list)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    touched: float = 0.0
    """monotonic time a call of it last began or ended."""

    def next_seq(self) -> int:
        seq, self.calls = self.calls, self.calls + 1
        return seq

    def keep(self, delivery: asyncio.Future[object]) -> None:
        self.pending = [d for d in self.pending if not d.done()]
        self.pending.append(delivery)


@dataclass(frozen=True, slots=True)
class Restored:
    """An episode attempt's state as hrl.calls tells it."""

    calls: int
    """Its next seq: one more than the highest seq captured."""
    closed_count: int | None
    """call_count of its EpisodeClosed, if it was closed."""
    reason: str = ""
    """The reason of its EpisodeClosed, if it was closed."""
    version: int | None = None
    """The policy version of its first captured call (seq 0), if hrl.calls still has it."""
    latencies_ms: tuple[float, ...] = ()
    """Latency of each of its captured calls (one per call, whatever its choices)."""
    session: pb.SessionInfo | None = None
    """The SessionInfo of its EpisodeStarted, for a production session whose EpisodeStarted
    this replica published (hrl.episodes)."""


class EpisodeBook:
    """Open (and recently closed) episodes of this replica. Use from one event loop."""

    def __init__(self) -> None:
        self._episodes: dict[Key, OpenEpisode] = {}
        self._restored: dict[Key, Restored] = {}
        self._ready = asyncio.Event()
        self._ready.set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def __len__(self) -> int:
        return len(self._episodes)

    @property
    def in_flight(self) -> int:
        """Calls in progress, over all episodes."""
        return self._in_flight

    async def wait_idle(self) -> None:
        """Return once no call is in progress."""
        await self._idle.wait()

    def recovering(self) -> None:
        """Until `restore()`, closes wait (calls are held by the gateway's recovery gate)."""
        self._ready.clear()

    def restore(self, state: dict[Key, Restored]) -> None:
        """What hrl.calls says of episodes this book has not seen yet (after a restart)."""
        self._restored.update(state)
        self._ready.set()

    def _episode(self, claims: EpisodeClaims) -> OpenEpisode:
        key = (claims.episode_id, claims.attempt)
        episode = self._episodes.get(key)
        if episode is None:
            episode = self._episodes[key] = OpenEpisode(claims)
            restored = self._restored.pop(key, None)
            if restored is not None:
                episode.calls = restored.calls
                episode.closed = restored.closed_count is not None
                episode.closed_count = restored.closed_count
        return episode

    def get(self, key: Key) -> OpenEpisode | None:
        """The episode attempt, if this book holds it."""
        return self._episodes.get(key)

    def forget(self, key: Key) -> None:
        """Drop an attempt that is closed and whose calls are over (a production session,
        whose claims never expire)."""
        episode = self._episodes.get(key)
        if episode is not None and episode.closed and episode.in_flight == 0:
            del self._episodes[key]

    def begin(self, claims: EpisodeClaims) -> OpenEpisode:
        """Account for a new call; raises EpisodeClosedError if the episode is closed."""
        episode = self._episode(claims)
        if episode.closed:
            raise EpisodeClosedError(
                f"episode {claims.episode_id} attempt {claims.attempt} is closed"
            )
        episode.in_flight += 1
        episode.touched = time.monotonic()
        episode.idle.clear()
        self._in_flight += 1
        self._idle.clear()
        return episode

    def end(self, episode: OpenEpisode) -> None:
        """The call (successful or not) is over."""
        episode.in_flight -= 1
        episode.touched = time.monotonic()
        if episode.in_flight == 0:
            episode.idle.set()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def close(self, claims: EpisodeClaims) -> OpenEpisode:
        """Refuse further calls, wait for those in flight and for every ModelCall's
        acknowledgement. Idempotent. Raises what a refused delivery raised."""
        await self._ready.wait()
        episode = self._episode(claims)
        episode.closed = True
        while episode.in_flight:
            await episode.idle.wait()
        await asyncio.gather(*episode.pending)
        episode.pending.clear()
        return episode

    def sweep(self, now: float | None = None) -> int:
        """Forget episodes whose token has expired (no call can arrive for them any more);
        returns how many were forgotten."""
        now = time.time() if now is None else now
        expired = [
            k for k, e in self._episodes.items() if e.claims.expires_at <= now and e.in_flight == 0
        ]
        for key in expired:
            del self._episodes[key]
        return len(expired)
