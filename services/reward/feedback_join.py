"""Production sessions meet their feedback: one RewardAssigned per session, decided once.

The gateway announces each session on hrl.episodes (EpisodeStarted, then EpisodeFinished
with `session` set); the feedback API adds signals. Here they meet, in the store:

- A session event is recorded before its record commits (`on_started`, `on_finished`), and
  recording it again changes nothing.
- After its end, a session is decided by `trust.feedback.decide`, from its stored signals:
  when a signal arrives or the session ends (`settle`), or when its window ends (`sweep`).
  Its RewardAssigned (`reward_of`: deterministic, from the stored signals) is stored with
  the state decided in the same transaction, then published; once the broker acknowledged
  it the state becomes published. A decided session not yet published (a crash, a broker
  that refused) is published again, with the same bytes, by the next sweep; the sample
  builder keeps one reward per (episode, attempt).
- The sweep also deletes what is older than production.retention_s.
- An app deletes a session (`delete`): the store keeps a tombstone only, SessionDeleted goes
  out on hrl.policy, and the trainer's SessionDeletionApplied (`on_applied`) is recorded on
  the tombstone. A deleted session's reward is never published from then on: the store
  holds none, and one read before the deletion is not claimed (`_claim`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from harnessrl.bus import Producer
from harnessrl.logs import get_logger
from harnessrl.metrics import Labelled
from harnessrl.production import ProductionSection, session_group, session_traceparent
from harnessrl.retry import PermanentError
from harnessrl.services.reward.feedback_store import (
    VIEW_STATES,
    FeedbackStore,
    SessionRecord,
    StoredSignal,
    StoreThread,
    Tombstone,
)
from harnessrl.trust import feedback
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

SOURCE = "feedback"
"""RewardAssigned.source of a production session's reward."""
_BATCH = 500  # sessions per sweep query and per transaction: bounds memory, not throughput


class FeedbackMetrics:
    """The feedback API's and the join's metrics, on the service's registry."""

    def __init__(self, registry: CollectorRegistry, store: StoreThread) -> None:
        r = registry
        self.signals = Labelled(
            Counter(
                "harnessrl_feedback_signals",
                "Feedback signals offered, by outcome (accepted | duplicate | refused_<reason>).",
                ["outcome"],
                registry=r,
            )
        )
        sessions = Gauge(
            "harnessrl_feedback_sessions",
            "Production sessions in the reward's store, by state.",
            ["state"],
            registry=r,
        )
        for state in VIEW_STATES:
            sessions.labels(state).set_function(_count_of(store, state))
        self.delay = Histogram(
            "harnessrl_feedback_delay_seconds",
            "Time from a session's end to a signal about it (signals before the end excluded).",
            buckets=(1, 10, 60, 300, 1800, 3600, 6 * 3600, 86_400, 7 * 86_400, 30 * 86_400),
            registry=r,
        )
        self.decided = Labelled(
            Counter(
                "harnessrl_feedback_decided",
                "Session rewards decided, by outcome (decided | missing).",
                ["outcome"],
                registry=r,
            )
        )
        self.deletions = Labelled(
            Counter(
                "harnessrl_feedback_deletions",
                "Sessions deleted by their app, by outcome (applied: the trainer answered "
                "within reward.delete_wait_s | pending: it had not).",
                ["outcome"],
                registry=r,
            )
        )


def _count_of(store: StoreThread, state: str) -> Callable[[], float]:
    return lambda: store.counts.get(state, 0)


def _seconds(stamp: Timestamp) -> float | None:
    """A Timestamp as seconds; None when unset."""
    return stamp.ToNanoseconds() / 1e9 or None


def session_record(event: pb.EpisodeStarted | pb.EpisodeFinished, now: float) -> SessionRecord:
    """The session an event announces; PermanentError naming the field when its ids do not
    agree (`group_id` and `episode_id` are `s.<app>.<session_id>`)."""
    info = event.session
    group_id = session_group(info.app, info.session_id)
    if event.group_id != group_id or event.episode_id != group_id:
        raise PermanentError(
            f"{type(event).__name__}.group_id: {event.group_id!r} is not the session's "
            f"group {group_id!r} (and episode_id must be the same)"
        )
    trace_id = session_traceparent(info.app, info.session_id).split("-")[1]
    if isinstance(event, pb.EpisodeStarted):
        return SessionRecord(
            group_id,
            info.app,
            info.session_id,
            info.kind,
            info.explored,
            event.trace_id or trace_id,
            _seconds(event.started_at) or now,
        )
    ended_at = _seconds(event.finished_at) or now
    return SessionRecord(
        group_id,
        info.app,
        info.session_id,
        info.kind,
        info.explored,
        trace_id,
        _seconds(event.started_at) or ended_at,
        ended_at=ended_at,
        ended_by=info.ended_by or "end",
    )


def reward_of(
    session: SessionRecord,
    signals: Sequence[StoredSignal],
    rules: feedback.FeedbackRules,
    now: float,
) -> pb.RewardAssigned | None:
    """The session's RewardAssigned if `trust.feedback.decide` decides it at `now`, else
    None. Deterministic: the same session, signals and `now` give the same bytes."""
    counted = [
        feedback.Signal(s.name, s.value, s.response_id, s.idempotency_key, s.received_at)
        for s in signals
    ]
    decision = feedback.decide(counted, rules, ended_at=session.ended_at, now=now)
    if decision == "wait":
        return None
    worth = feedback.session_reward(counted, rules)
    reward = pb.RewardAssigned(
        episode_id=session.group_id,
        attempt=1,
        group_id=session.group_id,
        source=SOURCE,
        session=pb.SessionInfo(
            app=session.app,
            session_id=session.session_id,
            kind=session.kind,
            explored=session.explored,
            ended_by=session.ended_by,
        ),
    )
    if decision == "missing" or worth.value is None:
        reward.missing = True
        reward.message = _missing_reason(counted, rules)
    else:
        reward.value = worth.value
        reward.components.update(worth.components)
    for s in signals:
        out = reward.signals.add(
            name=s.name,
            value=s.value,
            response_id=s.response_id,
            idempotency_key=s.idempotency_key,
            span_id=s.span_id,
            trace_id=s.trace_id,
        )
        out.received_at.FromNanoseconds(round(s.received_at * 1e9))
    reward.decided_at.FromNanoseconds(round(now * 1e9))
    return reward


def _missing_reason(signals: Sequence[feedback.Signal], rules: feedback.FeedbackRules) -> str:
    if not signals:
        return f"no feedback within the window ({rules.window_s:g} s after the session's end)"
    names = {s.name for s in signals}
    absent = sorted(n for n, rule in rules.signals.items() if rule.required and n not in names)
    return (
        f"window ended without the required signals ({', '.join(absent)}); "
        f"at_window_end: {rules.at_window_end}"
    )


class FeedbackJoin:
    """See the module docstring. `clock` is wall-clock seconds (tests pass their own)."""

    def __init__(
        self,
        production: ProductionSection,
        store: StoreThread,
        producer: Producer,
        metrics: FeedbackMetrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._production = production
        self._store = store
        self._producer = producer
        self.metrics = metrics
        self._clock = clock
        self._publishing: set[str] = set()
        self._deleting: set[str] = set()
        self._answers: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- session events ----------------------------------------------------------------------

    async def on_started(self, event: pb.EpisodeStarted) -> None:
        """Record a session's start (idempotent). One past retention is not recorded."""
        now = self._clock()
        record = session_record(event, now)
        if record.started_at >= now - self._production.retention_s:
            await self._store.call(FeedbackStore.register, [record])

    async def on_finished(self, event: pb.EpisodeFinished) -> None:
        """Record a session's end (idempotent: the first end counts), then decide it when
        its signals are already in (stored before this returns)."""
        now = self._clock()
        record = session_record(event, now)
        assert record.ended_at is not None
        if record.ended_at < now - self._production.retention_s:
            return
        await self._store.call(FeedbackStore.end, record)
        # Also when the end was already known: a crash between recording it and deciding
        # re-delivers the event, and this is where that decision is made.
        await self.settle([record.group_id])

    # -- deletions ---------------------------------------------------------------------------

    async def delete(self, app: str, session_id: str, wait_s: float) -> Tombstone | None:
        """Delete the app's session (see FeedbackStore.delete), publish SessionDeleted and
        wait until the broker acknowledged it, then up to `wait_s` for the trainer's answer.
        Returns the tombstone as it is then (`applied_at` None when no answer came in time),
        or None for a session the store does not know (nothing changed, nothing published).
        Idempotent: deleting again answers the same tombstone and publishes SessionDeleted
        again, which its consumers (keyed on the group) take as the same deletion."""
        group_id = session_group(app, session_id)
        answered = self._answers.setdefault(group_id, asyncio.Event())
        # Claimed from now: a reward read before the deletion commits is not published.
        self._deleting.add(group_id)
        try:
            tomb = await self._store.call(FeedbackStore.delete, group_id, self._clock())
            if tomb is None:
                return None
            event = pb.SessionDeleted(
                group_id=group_id, session=pb.SessionInfo(app=app, session_id=session_id)
            )
            event.requested_at.FromNanoseconds(round(tomb.deleted_at * 1e9))
            await self._producer.publish(event)
            if tomb.applied_at is None:
                with contextlib.suppress(TimeoutError):  # answered 202, shown by GET later
                    await asyncio.wait_for(answered.wait(), wait_s)
                tomb = await self._store.call(FeedbackStore.tombstone, group_id) or tomb
            outcome = "pending" if tomb.applied_at is None else "applied"
            self.metrics.deletions(outcome).inc()
            log.info("session deleted", group_id=group_id, outcome=outcome)
            return tomb
        finally:
            self._deleting.discard(group_id)
            if self._answers.get(group_id) is answered:
                del self._answers[group_id]

    async def on_applied(self, event: pb.SessionDeletionApplied) -> None:
        """Record the trainer's answer to a deletion on its tombstone (idempotent: the first
        answer counts; one about a session not deleted here changes nothing) and wake a
        request waiting for it."""
        recorded = await self._store.call(
            FeedbackStore.applied,
            event.group_id,
            list(event.trained_versions),
            event.dropped_tokens,
            event.version,
            self._clock(),
        )
        if recorded:
            log.info(
                "session deletion applied",
                group_id=event.group_id,
                trained_versions=list(event.trained_versions),
                dropped_tokens=event.dropped_tokens,
            )
        answered = self._answers.get(event.group_id)
        if answered is not None:
            answered.set()

    # -- decisions ---------------------------------------------------------------------------

    async def settle(self, group_ids: Sequence[str]) -> None:
        """Decide those of the sessions that can be decided now (stored before this
        returns), and publish their rewards in the background."""
        decided = self._claim(await self._decide(group_ids))
        if decided:
            task = asyncio.create_task(self._publish(decided), name="publish session rewards")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def sweep(self) -> None:
        """Decide the sessions whose window ended, publish every decided reward not yet
        acknowledged, delete what is past retention; each in batches of a bounded size."""
        now = self._clock()
        while due := await self._store.call(FeedbackStore.due, now, _BATCH):
            decided = self._claim(await self._decide(due, now))
            await self._publish(decided)
            if len(due) < _BATCH or not decided:  # a judge that waits must not spin here
                break
        after = ""
        while batch := await self._store.call(FeedbackStore.unpublished, after, _BATCH):
            after = batch[-1][0]
            await self._publish(self._claim(batch))
        before = now - self._production.retention_s
        while (deleted := await self._store.call(FeedbackStore.expire, before, _BATCH)) > 0:
            log.info("feedback sessions past retention deleted", sessions=deleted)

    async def run_sweeps(self, interval_s: float) -> None:
        """Sweep now and every `interval_s` seconds until cancelled. A failed sweep is
        logged and tried again on the next tick."""
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as err:  # a loop boundary: the next tick tries again
                log.error("feedback sweep failed", error=repr(err))
            await asyncio.sleep(interval_s)

    async def drain(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for rewards being published, then cancel the rest (they
        stay decided, and are published again after a restart)."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _decide(
        self, group_ids: Sequence[str], now: float | None = None
    ) -> list[tuple[str, bytes]]:
        rules = self._production.feedback

        def judge(session: SessionRecord, signals: list[StoredSignal], at: float) -> bytes | None:
            reward = reward_of(session, signals, rules, at)
            return None if reward is None else reward.SerializeToString(deterministic=True)

        decided = await self._store.call(
            FeedbackStore.decide, group_ids, self._clock() if now is None else now, judge
        )
        for group_id, data in decided:
            reward = pb.RewardAssigned.FromString(data)
            self.metrics.decided("missing" if reward.missing else "decided").inc()
            log.info(
                "session reward decided",
                group_id=group_id,
                value=reward.value,
                missing=reward.missing,
                signals=len(reward.signals),
                message=reward.message[:200],
            )
        return decided

    def _claim(self, items: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Those of `items` nobody is publishing, now claimed (released by _publish).

        Called right after the store answered, with no await in between; the store's one
        thread answers in order and the loop resumes its callers in that order, so a sweep
        that read a reward as unpublished sees it claimed until it is marked published, and
        one that reads after the mark does not see it: a reward is never sent twice at once.
        A session being deleted is never claimed: the store answered before its deletion
        committed, and its reward must not go out.
        """
        busy = self._publishing | self._deleting
        fresh = [item for item in items if item[0] not in busy]
        self._publishing.update(group_id for group_id, _ in fresh)
        return fresh

    async def _publish(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Publish claimed rewards and mark those the broker acknowledged. One that fails is
        logged and left decided: the next sweep publishes it again."""
        if not items:
            return
        group_ids = [group_id for group_id, _ in items]
        try:
            results = await asyncio.gather(
                *(self._send(data) for _, data in items), return_exceptions=True
            )
            done = []
            for group_id, result in zip(group_ids, results, strict=True):
                if isinstance(result, Exception):
                    log.error("session reward not published", group_id=group_id, error=repr(result))
                else:
                    done.append(group_id)
            if done:
                await self._store.call(FeedbackStore.mark_published, done)
        finally:
            self._publishing.difference_update(group_ids)

    async def _send(self, data: bytes) -> None:
        await self._producer.publish(pb.RewardAssigned.FromString(data))
