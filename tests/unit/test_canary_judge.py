"""The reward service's canary judge (services/reward/canary_judge.py) on its real SQLite
store, with a fixed clock; hrl.policy is played by the test: what the judge publishes is
collected in memory and handed back to it as the topic would (the broker and the service
wiring are tested in tests/integration/test_canary_judge_service.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry

from harnessrl.production import FeedbackSection, SignalRule, session_group
from harnessrl.rollout import CanarySection, GuardSection
from harnessrl.services.reward.canary_judge import (
    CanaryJudge,
    CanaryMetrics,
    canary_reward,
    reward_bounds,
)
from harnessrl.services.reward.canary_store import CanaryStore
from harnessrl.v1 import events_pb2 as pb

NOW = 1_800_000_000.0
FEEDBACK = FeedbackSection(
    signals={
        "thumbs": SignalRule(min=0.0, max=1.0, required=True),
        "resolved": SignalRule(min=-0.5, max=0.5),
    }
)
SECTION = CanarySection(
    enabled=True,
    share=0.5,
    min_sessions=20,
    mixture_sessions=20.0,
    guards={"error": GuardSection(margin=0.02, alpha=0.01), "slow": GuardSection()},
)


class Topic:
    """hrl.policy as the judge sees it: what it published, handed back in order."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.published: list[pb.RolloutDecision] = []
        self.delivered = 0
        """Events the judge (one at a time per topic) has been handed."""

    async def publish(self, decision: pb.RolloutDecision) -> None:
        self.published.append(decision)
        self.events.append(decision)

    async def history(self) -> AsyncIterator[Any]:
        for event in list(self.events):
            yield event

    async def deliver(self, judge: CanaryJudge, *extra: Any) -> None:
        """Hand `extra` to the topic, then everything not yet delivered to the judge (also
        what the judge publishes meanwhile), in topic order."""
        self.events.extend(extra)
        while self.delivered < len(self.events):
            self.delivered += 1
            await judge.on_policy(self.events[self.delivered - 1])


def make_judge(tmp_path: Path, topic: Topic, **settings: Any) -> CanaryJudge:
    """A judge with SECTION's settings changed by `settings`."""
    return CanaryJudge(
        SECTION.model_copy(update=settings),
        FEEDBACK,
        CanaryStore(tmp_path / "store"),
        topic.publish,
        CanaryMetrics(CollectorRegistry()),
        clock=lambda: NOW,
    )


async def started(tmp_path: Path, topic: Topic, **settings: Any) -> CanaryJudge:
    judge = make_judge(tmp_path, topic, **settings)
    topic.delivered = len(topic.events)  # folded by start, along with what it publishes
    await judge.start(topic.history())
    await topic.deliver(judge)
    return judge


def version(v: int, base: int | None = None) -> pb.PolicyVersion:
    event = pb.PolicyVersion(version=v)
    if base is not None:
        event.base = base
    return event


def finished(
    i: int, arm: str, canary: int = 1, *, errors: int = 0, slow: bool = False
) -> pb.EpisodeFinished:
    group = session_group("desk", f"s{i}")
    return pb.EpisodeFinished(
        episode_id=group,
        attempt=1,
        group_id=group,
        final=True,
        session=pb.SessionInfo(
            app="desk",
            session_id=f"s{i}",
            arm=arm,
            canary=canary,
            policy_version=canary if arm == "candidate" else 0,
            stats=pb.SessionStats(
                calls=3,
                errors=errors,
                answered=True,
                latency_ms_max=120_000.0 if slow else 50.0,
            ),
        ),
    )


def rewarded(i: int, value: float | None) -> pb.RewardAssigned:
    group = session_group("desk", f"s{i}")
    reward = pb.RewardAssigned(
        episode_id=group,
        attempt=1,
        group_id=group,
        source="feedback",
        session=pb.SessionInfo(app="desk", session_id=f"s{i}"),
    )
    if value is None:
        reward.missing = True
    else:
        reward.value = value
    return reward


def sessions(means: dict[str, float], count: int, seed: int) -> list[tuple[int, str, float]]:
    """(index, arm, 0/1 reward) of `count` sessions alternating between the arms."""
    rng = np.random.default_rng(seed)
    arms = ("stable", "candidate")
    return [(i, arms[i % 2], float(rng.random() < means[arms[i % 2]])) for i in range(count)]


async def feed(
    judge: CanaryJudge, topic: Topic, items: Sequence[tuple[int, str, float]], **stats: Any
) -> None:
    """Each session ends, then its reward is decided; decisions go round through the topic."""
    for i, arm, value in items:
        await judge.on_finished(finished(i, arm, **stats))
        await topic.deliver(judge)
        await judge.on_reward(rewarded(i, value))
        await topic.deliver(judge)


def actions(topic: Topic) -> list[tuple[str, int, str]]:
    names = {pb.ROLLOUT_ACTION_START: "start", pb.ROLLOUT_ACTION_PROMOTE: "promote"}
    names[pb.ROLLOUT_ACTION_ROLLBACK] = "rollback"
    return [(names[d.action], d.version, d.reason) for d in topic.published]


def test_reward_bounds_span_every_signal() -> None:
    assert reward_bounds(FEEDBACK) == (-0.5, 1.0)


async def test_a_newer_version_starts_as_candidate_once(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)
    assert len(topic.published) == 1
    start = topic.published[0]
    assert start.decision_id == "canary/1/start"
    assert (start.action, start.version, start.stable) == (pb.ROLLOUT_ACTION_START, 1, 0)
    assert (start.actor, start.reason, start.share) == ("canary", "new version", 0.5)
    assert start.decided_at.ToNanoseconds() == int(NOW * 1e9)
    assert judge.state.candidate == 1
    await judge.check()
    await topic.deliver(judge, version(2))  # a newer version waits for this canary's end
    assert len(topic.published) == 1


async def test_nothing_starts_while_pinned_or_when_stable_is_newest(tmp_path: Path) -> None:
    topic = Topic()
    topic.events.append(version(0))
    judge = await started(tmp_path, topic)
    assert topic.published == []
    pin = pb.RolloutDecision(
        decision_id="op/pin", action=pb.ROLLOUT_ACTION_PIN, version=0, stable=0, actor="operator:a"
    )
    await topic.deliver(judge, pin, version(1))
    assert judge.state.pinned and topic.published == []
    unpin = pb.RolloutDecision(
        decision_id="op/unpin", action=pb.ROLLOUT_ACTION_UNPIN, stable=0, actor="operator:a"
    )
    await topic.deliver(judge, unpin)
    assert actions(topic) == [("start", 1, "new version")]


async def test_a_harmful_candidate_is_rolled_back_with_its_evidence(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)
    await feed(judge, topic, sessions({"stable": 0.9, "candidate": 0.1}, 400, seed=1))
    assert actions(topic) == [("start", 1, "new version"), ("rollback", 1, "reward")]
    rollback = topic.published[-1]
    assert (rollback.decision_id, rollback.stable, rollback.actor) == (
        "canary/1/rollback",
        0,
        "canary",
    )
    proof = orjson.loads(rollback.evidence_json)
    assert proof["action"] == "rollback"
    assert proof["reward"]["upper"] < 0
    assert proof["sessions"]["candidate"] >= SECTION.min_sessions
    assert judge.state.candidate is None and 1 in judge.state.rolled_back
    assert judge.metrics.decisions("rollback", "reward")._value.get() == 1


async def test_a_helpful_candidate_is_promoted_and_the_next_version_starts(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)
    await topic.deliver(judge, version(2))
    await feed(judge, topic, sessions({"stable": 0.2, "candidate": 0.9}, 400, seed=2))
    assert actions(topic)[:3] == [
        ("start", 1, "new version"),
        ("promote", 1, "reward"),
        ("start", 2, "new version"),
    ]
    assert judge.state.stable == 1 and judge.state.candidate == 2
    assert judge.canary is not None and judge.canary.arms["candidate"].sessions == 0


async def test_guards_alone_roll_back_a_candidate_without_rewards(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)
    for i in range(200):
        arm = ("stable", "candidate")[i % 2]
        await judge.on_finished(finished(i, arm, errors=int(arm == "candidate")))
        await judge.on_reward(rewarded(i, None))  # decided without a reward
        await topic.deliver(judge)
        if len(topic.published) > 1:
            break
    assert actions(topic) == [("start", 1, "new version"), ("rollback", 1, "error")]
    proof = orjson.loads(topic.published[-1].evidence_json)
    assert proof["rewarded"] == {"stable": 0, "candidate": 0}
    assert proof["guards"]["error"]["lower"] > 0.02


async def test_a_candidate_an_engine_cannot_load_is_rolled_back(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)
    loaded = pb.PolicyLoaded(version=1, engine="engine-0", ok=True)
    failed = pb.PolicyLoaded(version=1, engine="engine-1", ok=False, error="checksum mismatch")
    await topic.deliver(judge, loaded, failed)
    assert actions(topic) == [("start", 1, "new version"), ("rollback", 1, "load_failed")]
    proof = orjson.loads(topic.published[-1].evidence_json)
    assert proof == {"engine": "engine-1", "error": "checksum mismatch", "version": 1}
    await topic.deliver(judge, version(2, base=0))  # the trainer rewound: 2 is a new candidate
    assert actions(topic)[-1] == ("start", 2, "new version")


async def test_a_redelivered_end_or_reward_is_counted_once(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)
    for _ in range(3):
        await judge.on_finished(finished(7, "candidate", errors=1))
        await judge.on_reward(rewarded(7, 1.0))
    assert judge.canary is not None
    sums = judge.canary.arms["candidate"]
    assert (sums.sessions, sums.rewarded, sums.reward_sum, sums.failures["error"]) == (1, 1, 1.0, 1)


async def test_sessions_of_another_or_no_candidate_are_not_counted(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1), version(2)]
    judge = await started(tmp_path, topic)
    assert judge.state.candidate == 2
    await judge.on_finished(finished(1, "candidate", canary=1))
    await judge.on_finished(finished(2, "stable", canary=0))
    await judge.on_reward(rewarded(1, 1.0))
    await judge.on_reward(rewarded(2, 1.0))
    assert judge.canary is not None
    assert all(s.sessions == 0 for s in judge.canary.arms.values())


async def script(directory: Path, *, restart: bool) -> tuple[Topic, CanaryJudge]:
    """Sessions end and are rewarded; ten end with their rewards still pending, then (with
    `restart`) the judge stops and a new one starts on the same store and topic; then the
    rewards come, and every end and reward is delivered again."""
    items = sessions({"stable": 0.8, "candidate": 0.3}, 400, seed=3)
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(directory, topic)
    await feed(judge, topic, items[:30])
    for i, arm, _ in items[30:40]:
        await judge.on_finished(finished(i, arm))
    if restart:
        assert judge.canary is not None
        before = judge.canary.to_json()
        await judge.close()
        judge = await started(directory, topic)
        assert judge.canary is not None and judge.canary.to_json() == before
    for i, _, value in items[30:40]:
        await judge.on_reward(rewarded(i, value))
        await topic.deliver(judge)
    await feed(judge, topic, items[30:])
    return topic, judge


async def test_a_restart_resumes_from_the_store_and_the_topic_with_the_same_decisions(
    tmp_path: Path,
) -> None:
    straight, _ = await script(tmp_path / "straight", restart=False)
    topic, judge = await script(tmp_path / "restarted", restart=True)
    assert actions(topic)[-1] == ("rollback", 1, "reward")
    assert [(d.decision_id, d.evidence_json) for d in topic.published] == [
        (d.decision_id, d.evidence_json) for d in straight.published
    ]
    assert await judge._call(CanaryStore.candidates) == []  # a decided candidate's rows go
    await judge.close()
    await judge.close()


@pytest.mark.parametrize("arm", ["", "canary"])
async def test_a_session_with_a_canary_but_no_arm_is_ignored(tmp_path: Path, arm: str) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)
    await judge.on_finished(finished(1, arm))
    assert judge.canary is not None
    assert all(s.sessions == 0 for s in judge.canary.arms.values())


def test_a_judge_without_feedback_signals_says_which_setting() -> None:
    with pytest.raises(ValueError, match=r"production\.feedback\.signals"):
        reward_bounds(FeedbackSection(signals={}))


async def test_a_version_that_failed_to_load_before_its_start_is_rolled_back_once_started(
    tmp_path: Path,
) -> None:
    topic = Topic()
    failed = pb.PolicyLoaded(version=1, engine="engine-0", ok=False, error="bad adapter")
    topic.events += [version(0), failed, version(1)]
    await started(tmp_path, topic)
    assert actions(topic) == [("start", 1, "new version"), ("rollback", 1, "load_failed")]


def with_signals(value: float | None, **signals: float) -> pb.RewardAssigned:
    reward = rewarded(1, value)
    for name, v in signals.items():
        reward.signals.add(name=name, value=v, idempotency_key=f"k-{name}")
    return reward


def test_the_canary_compares_the_reward_or_only_the_signals_it_names(tmp_path: Path) -> None:
    both = with_signals(0.75, thumbs=1.0, resolved=0.5)
    assert canary_reward(both, FEEDBACK, None) == 0.75
    assert canary_reward(both, FEEDBACK, ["resolved"]) == 0.5
    assert canary_reward(with_signals(None, resolved=-0.5), FEEDBACK, ["resolved"]) == -0.5
    assert canary_reward(with_signals(None, thumbs=1.0), FEEDBACK, ["resolved"]) is None
    assert canary_reward(with_signals(None), FEEDBACK, None) is None
    assert reward_bounds(FEEDBACK, ["resolved"]) == (-0.5, 0.5)
    with pytest.raises(ValueError, match=r"production\.canary\.signals: \['stars'\]"):
        reward_bounds(FEEDBACK, ["stars"])
    with pytest.raises(ValueError, match=r"production\.canary\.signals: \['stars'\]"):
        make_judge(tmp_path, Topic(), signals=["stars"])


async def test_a_judge_on_a_held_out_signal_counts_that_signal(tmp_path: Path) -> None:
    topic = Topic()
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic, signals=["resolved"])
    assert (judge.rule.low, judge.rule.high) == (-0.5, 0.5)
    await judge.on_finished(finished(1, "candidate"))
    await judge.on_reward(with_signals(1.0, thumbs=1.0, resolved=-0.5))
    assert judge.canary is not None
    assert judge.canary.arms["candidate"].reward_sum == -0.5


async def test_a_candidate_is_started_only_far_enough_past_stable_along_its_line(
    tmp_path: Path,
) -> None:
    topic = Topic()
    topic.events += [version(0), version(1), version(2)]
    judge = await started(tmp_path, topic, candidate_after_versions=3)
    assert topic.published == []
    await topic.deliver(judge, version(3))
    assert actions(topic) == [("start", 3, "new version")]
    failed = pb.PolicyLoaded(version=3, engine="e", ok=False, error="checksum")
    await topic.deliver(judge, failed, version(4), version(5, base=0), version(6), version(7))
    assert actions(topic)[1:] == [("rollback", 3, "load_failed"), ("start", 7, "new version")]


async def test_a_decision_refused_in_the_history_stays_refused_when_delivered_again(
    tmp_path: Path,
) -> None:
    topic = Topic()
    stale_pin = pb.RolloutDecision(
        decision_id="op/pin", action=pb.ROLLOUT_ACTION_PIN, version=0, stable=0, actor="operator:a"
    )
    topic.events += [version(0), version(1)]
    judge = await started(tmp_path, topic)  # starts 1
    rollback = pb.RolloutDecision(
        decision_id="op/rb", action=pb.ROLLOUT_ACTION_ROLLBACK, version=1, stable=0, actor="op"
    )
    await topic.deliver(judge, stale_pin, rollback)  # the pin is refused: 1 was pending
    await judge.close()
    judge = await started(tmp_path, topic)
    assert judge.state.candidate is None and not judge.state.pinned
    await judge.on_policy(stale_pin)  # the consumer delivers the record again
    assert not judge.state.pinned
    again = pb.RolloutDecision()
    again.CopyFrom(stale_pin)
    again.decided_at.FromNanoseconds(5)  # published again: judged where it lands
    await judge.on_policy(again)
    assert judge.state.pinned and judge.state.stable == 0
