"""After a start, learn from hrl.calls where every recent episode stood.

A gateway killed in the middle of an episode must not hand out its call numbers again: the
next call of that episode after the restart continues at the next seq, and a closed episode
stays closed. The gateway writes every ModelCall to its spill log before it answers
(producer WAL), so the records a killed gateway accepted are sent by the restarted one
first; only then is hrl.calls read, from `recovery_window_s` ago (records older than any
live token matter no more), and what it says is handed to the episode book. Calls are held
meanwhile (503 with Retry-After once they have waited `pause_hold_s`, which the SDKs retry).
"""

from __future__ import annotations

import time

from harnessrl import events
from harnessrl.bus import Producer
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import KafkaSettings
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, retry
from harnessrl.services.gateway.open_episodes import Key, Restored
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


async def recover(
    kafka: KafkaSettings,
    producer: Producer,
    *,
    window_s: float,
    client_id: str,
    replica: str = "",
) -> dict[Key, Restored]:
    """The state of every episode attempt of this replica (its records carry `replica` as
    their `gateway`) with a record on hrl.calls in the window, once this gateway's own
    spilled records are on the topic. Retries while Kafka is away."""
    started = time.monotonic()
    while not await producer.flush(timeout=30.0):
        log.warning("recovery: spilled ModelCalls not yet sent; waiting for the broker")
    since_ms = int((time.time() - window_s) * 1000)

    async def scan() -> dict[Key, Restored]:
        calls: dict[Key, int] = {}
        closed: dict[Key, int] = {}
        reasons: dict[Key, str] = {}
        async for _, event, _ in read_to_end(
            kafka, events.CALLS, client_id=client_id, since_ms=since_ms
        ):
            # Another replica's episode is skipped: that replica recovers it.
            if isinstance(event, pb.ModelCall) and event.gateway == replica:
                key = (event.episode_id, event.attempt)
                calls[key] = max(calls.get(key, 0), event.seq + 1)
            elif isinstance(event, pb.EpisodeClosed) and event.gateway == replica:
                closed[(event.episode_id, event.attempt)] = event.call_count
                reasons[(event.episode_id, event.attempt)] = event.reason
        return {
            key: Restored(
                max(calls.get(key, 0), closed.get(key, 0)), closed.get(key), reasons.get(key, "")
            )
            for key in calls.keys() | closed.keys()
        }

    state = await retry(scan, backoff=Backoff(0.5, 5.0), max_attempts=10**6)
    log.info(
        "recovered episodes from hrl.calls",
        episodes=len(state),
        closed=sum(1 for r in state.values() if r.closed_count is not None),
        seconds=round(time.monotonic() - started, 3),
    )
    return state
