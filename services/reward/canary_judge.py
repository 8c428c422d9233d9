"""The canary judge: starts each new version as a candidate, then promotes or rolls it back.

With `production.canary.enabled` the reward service folds hrl.policy (PolicyVersion,
RolloutDecision) with harnessrl.rollout's `RolloutState`, as every service does, and
publishes the automatic decisions (actor "canary") on hrl.policy:

- START: no candidate pending, not pinned, and the trainer's newest live version
  (`Rollout.current`) is newer than stable (`candidate_after_versions` past it along its
  line): it becomes the candidate with `canary.share`.
- PROMOTE or ROLLBACK: by trust/canary's rule, from the sessions that ended while this
  candidate was pending (`SessionInfo.canary`), each counted in its arm with the guards it
  failed (`rollout.session_failures`) when it ends, and its reward (the session's decided
  feedback reward, RewardAssigned on hrl.rewards, or with `canary.signals` the mean of those
  signals alone, such as a held-out outcome) when that is decided; a session decided
  without one counts for its guards only. The evidence is the decision's canonical
  JSON.
- ROLLBACK "load_failed": an engine reported it could not load the candidate
  (PolicyLoaded ok=false), its error in the evidence.

Every observation is in the judge's store (canary_store.py) before its record commits, and
hrl.policy is read from its beginning at start, so a restart rebuilds the same sums and
decides the same. Decision ids are deterministic (`canary/<version>/<action>`): the fold
applies an id once, so publishing one again after a crash changes nothing. A decision goes
out only when `rollout.refusal` accepts it against the state folded so far; the state moves
when the decision comes back on the topic, like everyone else's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeAlias, TypeVar

import orjson
from google.protobuf.message import Message
from prometheus_client import CollectorRegistry, Counter, Gauge

from harnessrl.logs import get_logger
from harnessrl.metrics import Labelled
from harnessrl.production import FeedbackSection
from harnessrl.rollout import (
    ACTION_NAMES,
    AUTO_ACTOR,
    CanarySection,
    Rollout,
    RolloutState,
    describe,
    refusal,
    session_failures,
)
from harnessrl.services.reward.canary_store import CanaryStore, Observation
from harnessrl.trust.canary import ARMS, Canary, CanaryConfig, CanaryDecision, evidence
from harnessrl.trust.feedback import Signal, session_reward
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

Publish = Callable[[pb.RolloutDecision], Awaitable[Any]]
"""Publishes a decision on hrl.policy; resolves once the broker acknowledged it."""
PolicyEvent: TypeAlias = pb.PolicyVersion | pb.RolloutDecision | pb.PolicyLoaded
T = TypeVar("T")


class CanaryMetrics:
    """The judge's metrics, on the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.sessions = Labelled(
            Gauge(
                "harnessrl_canary_sessions",
                "Sessions of the pending candidate's canary counted, by arm.",
                ["arm"],
                registry=r,
            )
        )
        self.rewarded = Labelled(
            Gauge(
                "harnessrl_canary_rewarded",
                "Rewarded sessions of the pending candidate's canary, by arm.",
                ["arm"],
                registry=r,
            )
        )
        self.decisions = Labelled(
            Counter(
                "harnessrl_canary_decisions",
                "Rollout decisions the judge published, by action and reason.",
                ["action", "reason"],
                registry=r,
            )
        )
        self.candidate = Gauge(
            "harnessrl_canary_candidate", "The pending candidate version (-1: none).", registry=r
        )
        self.candidate.set(-1)
        self.lower = Gauge(
            "harnessrl_canary_reward_lower",
            "Lower bound of candidate minus stable mean reward, valid at every moment.",
            registry=r,
        )
        self.upper = Gauge(
            "harnessrl_canary_reward_upper",
            "Upper bound of candidate minus stable mean reward, valid at every moment.",
            registry=r,
        )


def reward_bounds(
    feedback: FeedbackSection, names: Sequence[str] | None = None
) -> tuple[float, float]:
    """The range every reward the canary compares lies in: the least `min` and the largest
    `max` of the feedback signals it is made of (`names`, else all; a reward is a weighted
    mean of signal values). Raises ValueError naming the setting that names none, or an
    unknown signal."""
    unknown = sorted(set(names or ()) - set(feedback.signals))
    if unknown:
        raise ValueError(f"production.canary.signals: {unknown} are not feedback signals")
    rules = [r for n, r in feedback.signals.items() if names is None or n in names]
    if not rules:
        raise ValueError("production.feedback.signals: the canary judges rewards; name a signal")
    return min(r.min for r in rules), max(r.max for r in rules)


def canary_reward(
    reward: pb.RewardAssigned, feedback: FeedbackSection, names: Sequence[str] | None
) -> float | None:
    """What the canary compares of a decided session: its reward, or with `names` the
    weighted mean of those signals alone (a held-out outcome, `train: false`, that the
    policy is never paid for, so it cannot game its own release); None when it has none."""
    if names is None:
        return None if reward.missing else reward.value
    counted = [
        Signal(
            s.name, s.value, s.response_id, s.idempotency_key, s.received_at.ToNanoseconds() / 1e9
        )
        for s in reward.signals
    ]
    return session_reward(counted, feedback, names).value


def steps_past(state: Rollout, version: int) -> int:
    """How many versions `version` is past stable along the versions it was trained from
    (its version difference when its line does not reach stable)."""
    assert state.stable is not None
    steps, current = 0, version
    while current != state.stable and current in state.bases and steps <= len(state.bases):
        current, steps = state.bases[current], steps + 1
    return steps if current == state.stable else version - state.stable


class CanaryJudge:
    """See the module docstring. Call `start` with hrl.policy's history before handing it
    events; `clock` is wall-clock seconds (tests pass their own)."""

    def __init__(
        self,
        section: CanarySection,
        feedback: FeedbackSection,
        store: CanaryStore,
        publish: Publish,
        metrics: CanaryMetrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._section = section
        self._feedback = feedback
        self.rule: CanaryConfig = section.rule(*reward_bounds(feedback, section.signals))
        self._store = store
        self._publish = publish
        self.metrics = metrics
        self._clock = clock
        self._fold = RolloutState()
        self._canary: Canary | None = None
        """The sums of the pending candidate's canary (None when none is pending)."""
        self._load_failures: dict[int, bytes] = {}
        """Version -> evidence of the first engine that failed to load it."""
        self._in_flight: set[str] = set()
        """Ids published and not yet folded back (not published again meanwhile)."""
        self._started = False
        self._closed = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="canary-store")

    @property
    def state(self) -> Rollout:
        """The rollout state folded so far."""
        return self._fold.state

    @property
    def canary(self) -> Canary | None:
        """The pending candidate's sums (None when none is pending)."""
        return self._canary

    async def start(self, history: AsyncIterable[Message]) -> None:
        """Fold hrl.policy's history (PolicyVersion, RolloutDecision, PolicyLoaded; other
        events are skipped), forget the rows of candidates decided meanwhile, rebuild the
        pending candidate's sums from the store, and decide what is due."""
        async for event in history:
            if isinstance(event, PolicyEvent):
                self._apply(event)
        for candidate in await self._call(CanaryStore.candidates):
            if self._concluded(candidate):
                await self._call(CanaryStore.drop, candidate)
        await self._load()
        self._started = True
        log.info("canary judge resumed", **describe(self.state), canary=self._summary())
        await self.check()

    async def close(self) -> None:
        """Close the store and its thread (idempotent)."""
        if not self._closed:
            self._closed = True
            await self._call(CanaryStore.close)
            self._executor.shutdown(wait=False)

    # -- events ------------------------------------------------------------------------------

    async def on_policy(self, event: PolicyEvent) -> None:
        """Fold one hrl.policy event (idempotent) and decide what is due."""
        before = self.state.candidate
        self._apply(event)
        after = self.state.candidate
        if after != before:
            self._canary = None  # nothing counts into the old sums while the new ones load
            if before is not None and self._concluded(before):
                await self._call(CanaryStore.drop, before)
            await self._load()
        await self.check()

    async def on_finished(self, event: pb.EpisodeFinished) -> None:
        """Record a production session that ended while a canary was pending (stored when
        this returns; a redelivered end changes nothing), then decide what is due."""
        info = event.session
        if not info.canary or self._concluded(info.canary):
            return
        if info.arm not in ARMS:
            log.warning(
                "canary session without an arm ignored", group_id=event.group_id, arm=info.arm
            )
            return
        failures = session_failures(info.stats, self._section.slow_ms)
        observation = Observation(event.group_id, int(info.canary), info.arm, failures)
        if not await self._call(CanaryStore.ended, observation):
            return
        if self._canary is not None and observation.candidate == self.state.candidate:
            self._canary.observe_session(observation.arm, self._guards(failures))
            await self.check()

    async def on_reward(self, event: pb.RewardAssigned) -> None:
        """Record a session's decided reward (a missing one: decided without), when the
        session is recorded here and not decided before, then decide what is due."""
        if not event.HasField("session"):
            return
        value = canary_reward(event, self._feedback, self._section.signals)
        reward = None if value is None else self._bounded(value, event.group_id)
        observation = await self._call(CanaryStore.decided, event.group_id, reward)
        if observation is None:
            return
        if self._canary is not None and observation.candidate == self.state.candidate:
            if reward is not None:
                self._canary.observe_reward(observation.arm, reward)
            await self.check()

    # -- decisions ---------------------------------------------------------------------------

    async def check(self) -> None:
        """Publish the decision due now, if any: START a new candidate, ROLLBACK one an
        engine failed to load, or PROMOTE/ROLLBACK by the rule."""
        if not self._started:
            return
        state = self.state
        candidate = state.candidate
        if candidate is None:
            self._show(None)
            current = state.current()
            if (
                not state.pinned
                and current is not None
                and state.stable is not None
                and current > state.stable
                and steps_past(state, current) >= self._section.candidate_after_versions
            ):
                await self._decide(pb.ROLLOUT_ACTION_START, current, "new version", b"")
            return
        failed = self._load_failures.get(candidate)
        if failed is not None:
            await self._decide(pb.ROLLOUT_ACTION_ROLLBACK, candidate, "load_failed", failed)
            return
        assert self._canary is not None  # loaded with the candidate
        decision = self._canary.decide()
        self._show(decision)
        if decision.action == "promote":
            await self._decide(
                pb.ROLLOUT_ACTION_PROMOTE, candidate, decision.reason, evidence(decision)
            )
        elif decision.action == "rollback":
            await self._decide(
                pb.ROLLOUT_ACTION_ROLLBACK, candidate, decision.reason, evidence(decision)
            )

    async def _decide(
        self, action: pb.RolloutAction.ValueType, version: int, reason: str, proof: bytes
    ) -> None:
        state = self.state
        assert state.stable is not None
        name = ACTION_NAMES[action]
        decision = pb.RolloutDecision(
            decision_id=f"canary/{version}/{name}",
            action=action,
            version=version,
            stable=state.stable,
            actor=AUTO_ACTOR,
            reason=reason,
            evidence_json=proof.decode(),
        )
        if action == pb.ROLLOUT_ACTION_START:
            decision.share = self._section.share
        decision.decided_at.FromNanoseconds(round(self._clock() * 1e9))
        if decision.decision_id in self._in_flight:
            return
        refused = refusal(state, decision)
        if refused is not None:  # the fold would refuse it as well: nothing to publish
            log.warning("canary decision not published", decision=name, refused=refused)
            return
        self._in_flight.add(decision.decision_id)
        try:
            await self._publish(decision)
        except BaseException:
            self._in_flight.discard(decision.decision_id)  # the next look publishes it again
            raise
        self.metrics.decisions(name, reason).inc()
        log.info(
            "canary decision published",
            decision=name,
            version=version,
            stable=state.stable,
            reason=reason,
            evidence=decision.evidence_json,
        )

    # -- the fold and the sums ---------------------------------------------------------------

    def _apply(self, event: PolicyEvent) -> None:
        if isinstance(event, pb.PolicyVersion):
            self._fold.announced(event)
        elif isinstance(event, pb.RolloutDecision):
            self._in_flight.discard(event.decision_id)
            refused = self._fold.decided(event)  # replay-safe: records delivered again too
            if refused is not None and self._started:
                log.info("rollout decision refused", decision_id=event.decision_id, why=refused)
        elif not event.ok and int(event.version) not in self._load_failures:
            proof = {"engine": event.engine, "error": event.error, "version": event.version}
            self._load_failures[int(event.version)] = orjson.dumps(
                proof, option=orjson.OPT_SORT_KEYS
            )
        stable = self.state.stable
        for version in list(self._load_failures):  # only a version to come may be started
            if self._concluded(version) or (stable is not None and version <= stable):
                del self._load_failures[version]

    def _concluded(self, version: int) -> bool:
        """Whether `version` was decided already (rolled back, or stable at some point)."""
        state = self.state
        return state.retired(version) or version in state.stables

    async def _load(self) -> None:
        """The pending candidate's sums, rebuilt from the store in the orders observed."""
        candidate = self.state.candidate
        if candidate is None:
            self._canary = None
            return
        recorded = await self._call(CanaryStore.observations, candidate)
        canary = Canary(self.rule)
        for o in recorded.sessions:
            canary.observe_session(o.arm, self._guards(o.failures))
        for arm, reward in recorded.rewards:
            canary.observe_reward(arm, self._bounded(reward, ""))
        self._canary = canary

    def _guards(self, failures: dict[str, bool]) -> dict[str, bool]:
        return {name: failures[name] for name in self.rule.guards}

    def _bounded(self, reward: float, group_id: str) -> float:
        """A reward within the rule's range (outside it only after the signals' ranges were
        changed in the configuration: clipped, and said so)."""
        low, high = self.rule.low, self.rule.high
        if low <= reward <= high:
            return reward
        log.warning("session reward outside the canary's range; clipped", group_id=group_id)
        return min(max(reward, low), high)

    def _show(self, decision: CanaryDecision | None) -> None:
        m = self.metrics
        m.candidate.set(-1 if self.state.candidate is None else self.state.candidate)
        for arm in ARMS:
            m.sessions(arm).set(0 if decision is None else decision.sessions[arm])
            m.rewarded(arm).set(0 if decision is None else decision.rewarded[arm])
        m.lower.set(math.nan if decision is None else decision.reward.lower)
        m.upper.set(math.nan if decision is None else decision.reward.upper)

    def _summary(self) -> dict[str, Any]:
        if self._canary is None:
            return {}
        return {arm: (s.sessions, s.rewarded) for arm, s in self._canary.arms.items()}

    async def _call(self, method: Callable[..., T], *args: Any) -> T:
        store = self._store
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: method(store, *args)
        )
