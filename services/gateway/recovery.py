"""After a start, learn from hrl.calls where every recent episode stood.

A gateway killed in the middle of an episode must not hand out its call numbers again: the
next call of that episode after the restart continues at the next seq, and a closed episode
stays closed. The gateway writes every ModelCall to its spill log before it answers
(producer WAL), so the records a killed gateway accepted are sent by the restarted one
first; only then is hrl.calls read, from `recovery_window_s` ago (records older than any
live token matter no more), and what it says is handed to the episode book. Calls are held
meanwhile (503 with Retry-After once they have waited `pause_hold_s`, which the SDKs retry).

With production sessions, hrl.calls also says which version served each session's first
call and how long each call took, and hrl.episodes (read from the same time) holds the
EpisodeStarted this replica published for each session: its arm and version, which a
session keeps after the restart even when none of its calls was captured.
"""

from __future__ import annotations

import time

from harnessrl import events
from harnessrl.bus import Producer
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import KafkaSettings
from harnessrl.logs import get_logger
from harnessrl.production import parse_session_group
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
    sessions: bool = False,
) -> dict[Key, Restored]:
    """The state of every episode attempt of this replica (its records carry `replica` as
    their `gateway`) with a record on hrl.calls in the window, once this gateway's own
    spilled records are on the topic; with `sessions`, also every production session this
    replica started in the window (hrl.episodes). Retries while Kafka is away."""
    started = time.monotonic()
    while not await producer.flush(timeout=30.0):
        log.warning("recovery: spilled ModelCalls not yet sent; waiting for the broker")
    since_ms = int((time.time() - window_s) * 1000)

    async def scan() -> dict[Key, Restored]:
        calls: dict[Key, int] = {}
        closed: dict[Key, int] = {}
        reasons: dict[Key, str] = {}
        first: dict[Key, tuple[int, int]] = {}  # (seq, policy version) of the lowest seq
        latencies: dict[Key, dict[str, float]] = {}  # a session's calls' latency, by call
        async for _, event, _ in read_to_end(
            kafka, events.CALLS, client_id=client_id, since_ms=since_ms
        ):
            # Another replica's episode is skipped: that replica recovers it.
            if isinstance(event, pb.ModelCall) and event.gateway == replica:
                key = (event.episode_id, event.attempt)
                calls[key] = max(calls.get(key, 0), event.seq + 1)
                if parse_session_group(event.episode_id) is not None:
                    if key not in first or event.seq < first[key][0]:
                        first[key] = (event.seq, event.policy_version)
                    # one entry per call: its choices share its span
                    call = event.span_id or f"seq{event.seq}"
                    latencies.setdefault(key, {})[call] = event.latency_ms
            elif isinstance(event, pb.EpisodeClosed) and event.gateway == replica:
                closed[(event.episode_id, event.attempt)] = event.call_count
                reasons[(event.episode_id, event.attempt)] = event.reason
        started = await _sessions_started(kafka, client_id, since_ms, replica) if sessions else {}
        return {
            key: Restored(
                max(calls.get(key, 0), closed.get(key, 0)),
                closed.get(key),
                reasons.get(key, ""),
                version=first[key][1] if key in first else None,
                latencies_ms=tuple(latencies.get(key, {}).values()),
                session=started.get(key),
            )
            for key in calls.keys() | closed.keys() | started.keys()
        }

    state = await retry(scan, backoff=Backoff(0.5, 5.0), max_attempts=10**6)
    log.info(
        "recovered episodes from hrl.calls",
        episodes=len(state),
        closed=sum(1 for r in state.values() if r.closed_count is not None),
        seconds=round(time.monotonic() - started, 3),
    )
    return state


async def _sessions_started(
    kafka: KafkaSettings, client_id: str, since_ms: int, replica: str
) -> dict[Key, pb.SessionInfo]:
    """The SessionInfo of each production session this replica started since `since_ms`."""
    started: dict[Key, pb.SessionInfo] = {}
    async for _, event, _ in read_to_end(
        kafka, events.EPISODES, client_id=client_id, since_ms=since_ms
    ):
        if (
            isinstance(event, pb.EpisodeStarted)
            and event.runner == "session"
            and event.runner_ref == replica
            and event.HasField("session")
        ):
            started[(event.episode_id, event.attempt)] = event.session
    return started
