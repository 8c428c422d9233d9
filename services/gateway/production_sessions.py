"""Production sessions at the gateway: an app's calls under its own session ids.

An app (production.apps) sends its key as the API key and names a session per call (the
`x-harnessrl-session` header or `/s/<session>` in the path, libs/harnessrl/production.py).
The session is one episode: `episode_id == group_id == s.<app>.<session>`, attempt 1, owned
by this replica. Its first call opens it: the gateway publishes EpisodeStarted (runner
"session", `session` set: app, session id, kind, explored). Its calls are captured as any
episode's (the episode book numbers them, the spill log holds them before the answer's last
byte). It ends on the app's end call, on a call carrying `x-harnessrl-session-end`, or after
`production.idle_s` without a call: closed like a controller's episode (calls in flight
finish, every ModelCall acknowledged, EpisodeClosed{call_count}), then EpisodeFinished
(`ended_by` end or idle). A call for an ended session is a 409: a session id names one
session.

Which sessions train is decided from the ids alone (`explored`): explored ones run in train
mode (sampling the trainer can recompute), the rest in val mode, exactly as the app asked.

After a restart, the book learns from hrl.calls which sessions were open (`restore`), so
they still end when idle; one whose calls all predate the restart ends `idle_s` after it.

With `production.canary.enabled`, a session's first call also assigns it an arm of the
rollout (`RolloutState.assign`: the candidate only while some engine serves it) and the
version that arm serves; EpisodeStarted and EpisodeFinished carry them (`SessionInfo.arm`,
`policy_version`, `canary`) and every call of the session asks for that version
(session_arms.py). A restarted replica takes each open session's assignment back from its
EpisodeStarted (else from its first captured call's version), so no session changes
version. The replica counts each session's calls for the canary's guards and publishes the
counts in EpisodeFinished (`SessionInfo.stats`); after a restart, the captured calls are
counted again from hrl.calls (the failures answered before it are lost).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harnessrl.bus import Producer
from harnessrl.episode_token import EpisodeClaims
from harnessrl.logs import get_logger
from harnessrl.production import (
    Apps,
    AppSpec,
    ProductionSection,
    explored,
    parse_session_group,
    session_group,
    session_traceparent,
)
from harnessrl.rollout import RolloutState
from harnessrl.services.gateway.errors import GatewayError
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.services.gateway.open_episodes import EpisodeBook, Key, Restored
from harnessrl.services.gateway.session_arms import SessionCalls
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


@dataclass(eq=False, slots=True)
class _Session:
    claims: EpisodeClaims
    info: pb.SessionInfo
    touched: float
    """monotonic time of its last call's admission."""
    ending: asyncio.Task[int] | None = None
    end_after_call: bool = False
    deliveries: list[asyncio.Future[object]] = field(default_factory=list)
    calls: SessionCalls = field(default_factory=SessionCalls)


@dataclass(frozen=True, slots=True)
class Ended:
    """A session this replica ended: how, and with how many calls."""

    ended_by: str
    call_count: int


CLOSE_REASON = "session_"
"""EpisodeClosed.reason of a session: session_end, session_idle."""


def _finished(claims: EpisodeClaims, info: pb.SessionInfo) -> pb.EpisodeFinished:
    finished = pb.EpisodeFinished(
        episode_id=claims.episode_id,
        attempt=1,
        group_id=claims.group_id,
        task_id=claims.group_id,
        mode=pb.MODE_TRAIN if info.explored else pb.MODE_VAL,
        status=pb.EPISODE_STATUS_SUCCEEDED,
        reason=f"session ended ({info.ended_by})",
        final=True,
        session=info,
    )
    finished.finished_at.GetCurrentTime()
    return finished


def _logged(delivery: asyncio.Future[Any]) -> None:
    if not delivery.cancelled() and (err := delivery.exception()) is not None:
        log.error("a session's EpisodeFinished was refused", error=repr(err))


class SessionEndedError(Exception):
    """A call named a session that has ended."""


class ProductionSessions:
    """The production sessions this replica owns. Use from one event loop."""

    def __init__(
        self,
        production: ProductionSection,
        *,
        book: EpisodeBook,
        producer: Producer,
        close: Callable[[EpisodeClaims, str], Awaitable[int]],
        metrics: GatewayMetrics,
        replica: str = "",
        clock: Callable[[], float] = time.monotonic,
        rollout: RolloutState | None = None,
        served: Callable[[int], bool] = lambda _: False,
    ) -> None:
        """`rollout` (the fold of hrl.policy) and `served` (whether some engine serves a
        version now) assign arms when `production.canary.enabled`."""
        self.apps = Apps(production.apps)
        self._rollout = rollout if production.canary.enabled else None
        self._served = served
        self._settings = production
        self._book = book
        self._producer = producer
        self._close = close
        self._metrics = metrics
        self._replica = replica
        self._clock = clock
        self._open: dict[str, _Session] = {}
        self._ended: OrderedDict[str, Ended] = OrderedDict()
        self._tasks: set[asyncio.Task[int]] = set()

    def __len__(self) -> int:
        return len(self._open)

    def claims(self, app: AppSpec, session_id: str, kind: str) -> EpisodeClaims:
        """The episode claims of the app's session, opening it (EpisodeStarted) at its first
        call. Raises SessionEndedError for an ended session, GatewayError 503 when this
        replica holds `max_open_sessions` open ones."""
        group = session_group(app.name, session_id)
        session = self._open.get(group)
        if session is None:
            ended = self._ended.get(group)
            if ended is not None:
                raise SessionEndedError(
                    f"session {session_id!r} has ended ({ended.ended_by}, {ended.call_count} "
                    "calls): a session id names one session, start a new one"
                )
            if len(self._open) >= self._settings.max_open_sessions:
                raise GatewayError(
                    503,
                    f"this gateway holds {len(self._open)} open sessions "
                    "(production.max_open_sessions); end finished ones",
                    headers=[("retry-after", "5")],
                )
            session = self._open[group] = self._new(app, session_id, kind)
            self._assign(session)
            self._started(session)
        elif session.ending is not None:
            raise SessionEndedError(f"session {session_id!r} is ending")
        elif kind and not session.info.kind:  # tracked again after a restart
            session.info.kind = kind
        session.touched = self._clock()
        return session.claims

    def _new(self, app: AppSpec, session_id: str, kind: str) -> _Session:
        group = session_group(app.name, session_id)
        chosen = explored(app.name, session_id, app.exploration)
        claims = EpisodeClaims(
            episode_id=group,
            attempt=1,
            group_id=group,
            mode="train" if chosen else "val",
            expires_at=math.inf,
            traceparent=session_traceparent(app.name, session_id),
            gateway=self._replica,
        )
        info = pb.SessionInfo(app=app.name, session_id=session_id, kind=kind, explored=chosen)
        return _Session(claims, info, self._clock())

    def calls(self, claims: EpisodeClaims) -> SessionCalls | None:
        """The open session's routing and guard stats (None when it is not open here)."""
        session = self._open.get(claims.group_id)
        return session.calls if session is not None else None

    def _assign(self, session: _Session) -> None:
        """With a rollout: the new session's arm and version (none before the trainer
        announced any version: then it is served as without a rollout)."""
        if self._rollout is None:
            return
        chosen = self._rollout.assign(session.claims.group_id, self._served)
        if chosen is None:
            log.warning("session not assigned: no policy version announced yet")
            return
        info = session.info
        info.arm, info.policy_version = chosen
        info.canary = self._rollout.state.candidate or 0
        session.calls.version, session.calls.arm = info.policy_version, info.arm
        self._metrics.sessions_assigned(info.arm).inc()

    def _started(self, session: _Session) -> None:
        claims, info = session.claims, session.info
        started = pb.EpisodeStarted(
            episode_id=claims.episode_id,
            attempt=1,
            group_id=claims.group_id,
            task_id=claims.group_id,
            index=0,
            group_size=1,
            mode=pb.MODE_TRAIN if info.explored else pb.MODE_VAL,
            runner="session",
            runner_ref=self._replica,
            trace_id=claims.traceparent.split("-")[1],
            session=info,
        )
        started.started_at.GetCurrentTime()
        session.deliveries.append(self._producer.publish(started))  # type: ignore[arg-type]
        self._metrics.sessions_started(info.app, str(info.explored).lower()).inc()
        log.info(
            "session opened",
            app=info.app,
            session_id=info.session_id,
            kind=info.kind,
            explored=info.explored,
            arm=info.arm or None,
            policy_version=info.policy_version if info.arm else None,
            trace_id=started.trace_id,
        )

    def end_after_call(self, claims: EpisodeClaims) -> None:
        """End the session once its calls in flight are over (`x-harnessrl-session-end`)."""
        session = self._open.get(claims.group_id)
        if session is None:
            return
        session.end_after_call = True
        episode = self._book.get((claims.episode_id, claims.attempt))
        if episode is None or episode.in_flight == 0:
            self._spawn(session, "end")

    async def end(self, app: AppSpec, session_id: str, ended_by: str = "end") -> Ended:
        """End the app's session (idempotent). Raises KeyError for a session this replica
        does not know."""
        group = session_group(app.name, session_id)
        ended = self._ended.get(group)
        if ended is not None:
            return ended
        session = self._open.get(group)
        if session is None:
            raise KeyError(session_id)
        count = await asyncio.shield(self._spawn(session, ended_by))
        return Ended(session.info.ended_by, count)

    def _spawn(self, session: _Session, ended_by: str) -> asyncio.Task[int]:
        if session.ending is None:
            session.ending = asyncio.create_task(self._finish(session, ended_by))
            self._tasks.add(session.ending)
            session.ending.add_done_callback(self._ended_task)
        return session.ending

    def _ended_task(self, task: asyncio.Task[int]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (err := task.exception()) is not None:
            log.error("ending a session failed; it is tried again", error=repr(err))

    async def _finish(self, session: _Session, ended_by: str) -> int:
        claims, info = session.claims, session.info
        try:
            await asyncio.gather(*session.deliveries)
            count = await self._close(claims, f"{CLOSE_REASON}{ended_by}")
            info.ended_by = ended_by
            info.stats.CopyFrom(session.calls.stats)
            await self._producer.publish(_finished(claims, info))
        except BaseException:
            session.ending = None  # the sweep tries again
            raise
        group = claims.group_id
        self._open.pop(group, None)
        self._book.forget((claims.episode_id, claims.attempt))
        self._ended[group] = Ended(ended_by, count)
        while len(self._ended) > self._settings.max_open_sessions:
            self._ended.popitem(last=False)
        self._metrics.sessions_ended(info.app, ended_by).inc()
        log.info(
            "session ended",
            app=info.app,
            session_id=info.session_id,
            ended_by=ended_by,
            call_count=count,
            trace_id=claims.traceparent.split("-")[1],
        )
        return count

    async def delete(self, group_id: str) -> None:
        """An app deleted the session (SessionDeleted): ended at once if it is open here
        (its calls in flight finish; EpisodeClosed and EpisodeFinished say `deleted`), and
        any later call naming it is refused."""
        session = self._open.get(group_id)
        if session is not None:
            await asyncio.shield(self._spawn(session, "deleted"))
        ended = self._ended.get(group_id)
        self._ended[group_id] = Ended("deleted", ended.call_count if ended else 0)
        self._ended.move_to_end(group_id)
        while len(self._ended) > self._settings.max_open_sessions:
            self._ended.popitem(last=False)

    def sweep(self) -> int:
        """End the sessions idle for `production.idle_s` (or asked to end) whose calls are
        over; returns how many it started ending."""
        now = self._clock()
        started = 0
        for session in list(self._open.values()):
            if session.ending is not None:
                continue
            claims = session.claims
            episode = self._book.get((claims.episode_id, claims.attempt))
            busy = episode is not None and episode.in_flight > 0
            last = max(session.touched, episode.touched if episode is not None else 0.0)
            if busy:
                continue
            if session.end_after_call:
                self._spawn(session, "end")
            elif now - last >= self._settings.idle_s:
                self._spawn(session, "idle")
            else:
                continue
            started += 1
        return started

    def restore(self, state: Mapping[Key, Restored]) -> int:
        """Sessions hrl.calls (and hrl.episodes' EpisodeStarted) say were open on this
        replica: tracked again, with their arm, version and captured calls' counts, so they
        keep their version and end when idle. Returns how many."""
        restored = 0
        for (episode_id, _), where in state.items():
            parsed = parse_session_group(episode_id)
            if parsed is None or episode_id in self._open:
                continue
            app = self.apps.by_name(parsed[0])
            if app is None:
                continue
            if where.closed_count is not None:
                # Closed; its EpisodeFinished may not have been sent before the restart:
                # sent again (consumers take an event once, by its identity).
                ended_by = where.reason.removeprefix(CLOSE_REASON) or "end"
                self._ended[episode_id] = Ended(ended_by, where.closed_count)
                gone = self._new(app, parsed[1], "")
                self._resume(gone, where)
                gone.info.ended_by = ended_by
                delivery = self._producer.publish(_finished(gone.claims, gone.info))
                delivery.add_done_callback(_logged)
                continue
            session = self._open[episode_id] = self._new(app, parsed[1], "")
            self._resume(session, where)
            restored += 1
        return restored

    def _resume(self, session: _Session, where: Restored) -> None:
        """A restored session's assignment and guard counts, as the topics tell them."""
        info = session.info
        if where.session is not None:
            info.CopyFrom(where.session)
        if info.arm:
            session.calls.version, session.calls.arm = info.policy_version, info.arm
        elif where.session is None and self._rollout is not None and where.version is not None:
            session.calls.version = where.version  # its first captured call's
        stats = session.calls.stats
        stats.calls = len(where.latencies_ms)
        stats.latency_ms_sum = sum(where.latencies_ms)
        stats.latency_ms_max = max(where.latencies_ms, default=0.0)
        stats.answered = bool(where.latencies_ms)

    async def aclose(self) -> None:
        """Wait for the ends in progress (the service stops)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
