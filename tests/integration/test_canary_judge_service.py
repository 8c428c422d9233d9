"""The canary judge in the real reward service, on the embedded broker: the trainer's
versions on hrl.policy, production sessions' ends on hrl.episodes as the gateway publishes
them (arm, canary, stats), their feedback over the real feedback API with httpx; the
service starts the newest version as candidate, then rolls it back on what the sessions'
rewards say, with its evidence, on hrl.policy, also across a restart in the middle, or on
what a held-out signal says however the trained-on thumbs go. The trainer and the gateway
are played by the test (a real trainer needs a GPU and a model)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.production import (
    AppSpec,
    FeedbackSection,
    ProductionSection,
    SignalRule,
    key_digest,
    session_group,
)
from harnessrl.rollout import CanarySection
from harnessrl.runtime import Runtime
from harnessrl.services.reward.config import RewardConfig, RewardSection
from harnessrl.services.reward.service import RewardService
from harnessrl.trust.canary import Canary
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, events_on, eventually

pytestmark = pytest.mark.integration

KEY = "desk-key-0123456789abcdef"
PER_ARM = 10
"""Sessions per arm: enough for the rule below to roll back a candidate every user
thumbs down while stable gets thumbs up (8 per arm are)."""

CONFIG = CanarySection(enabled=True, share=0.5, alpha=0.2, min_sessions=4, mixture_sessions=1.0)
THUMBS = {"thumbs": SignalRule(min=-1.0, max=1.0, required=True)}
HELD_OUT = THUMBS | {"resolved": SignalRule(min=0.0, max=1.0, required=True, train=False)}


@asynccontextmanager
async def reward_service(
    broker: EmbeddedBroker,
    tmp_path: Path,
    registry: CollectorRegistry,
    canary: CanarySection = CONFIG,
    signals: dict[str, SignalRule] = THUMBS,
) -> AsyncIterator[httpx.AsyncClient]:
    config = RewardConfig(
        instance="rw-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "rw-spill"),
        reward=RewardSection(port=0, feedback_port=0, feedback_sweep_s=0.2),
        production=ProductionSection(
            apps=[AppSpec(name="desk", key_sha256=key_digest(KEY))],
            feedback=FeedbackSection(signals=signals),
            store=tmp_path / "sessions",
            canary=canary,
        ),
    )
    service = RewardService(config, Runtime("reward", "rw-0", registry, TracerProvider()))
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 30)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{service.feedback_port}", timeout=60
        ) as client:
            yield client
    finally:
        await service.stop()
        await task


async def publish(broker: EmbeddedBroker, tmp_path: Path, *items: Any) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "test-spill"),
        name="test",
    )
    await producer.start()
    for item in items:
        await producer.publish(item)
    await producer.stop()


def ended(i: int, arm: str) -> pb.EpisodeFinished:
    """Session s<i> of app desk ended, as its gateway reports it."""
    group = session_group("desk", f"s{i}")
    event = pb.EpisodeFinished(
        episode_id=group,
        attempt=1,
        group_id=group,
        mode=pb.MODE_VAL,
        status=pb.EPISODE_STATUS_SUCCEEDED,
        final=True,
        session=pb.SessionInfo(
            app="desk",
            session_id=f"s{i}",
            kind="chat",
            ended_by="end",
            arm=arm,
            policy_version=1 if arm == "candidate" else 0,
            canary=1,
            stats=pb.SessionStats(calls=2, answered=True, latency_ms_sum=80.0, latency_ms_max=50.0),
        ),
    )
    event.finished_at.FromNanoseconds(time.time_ns())
    return event


def first_decision(low: float = -1.0, high: float = 1.0) -> dict[str, int]:
    """Rewarded sessions per arm when the service's rule first rolls back, the rewards
    arriving as `feedback` sends them (stable's `high`, the candidate's `low`)."""
    canary = Canary(CONFIG.rule(low, high))
    for i in range(2 * PER_ARM):
        arm = ("stable", "candidate")[i % 2]
        canary.observe(arm, high if arm == "stable" else low, dict.fromkeys(CONFIG.guards, False))
        decision = canary.decide()
        if decision.action == "rollback":
            return decision.rewarded
    raise AssertionError(f"{PER_ARM} sessions per arm do not decide")


async def decisions(broker: EmbeddedBroker) -> list[pb.RolloutDecision]:
    return [e for _, e in await events_on(broker.bootstrap, events.POLICY) if _is_decision(e)]


def _is_decision(event: Any) -> bool:
    return isinstance(event, pb.RolloutDecision)


def thumbs(i: int) -> dict[str, float]:
    """Thumbs up for the stable arm's sessions (even), down for the candidate's (odd)."""
    return {"thumbs": 1 if i % 2 == 0 else -1}


async def feedback(
    client: httpx.AsyncClient, sessions: range, signals: Callable[[int], dict[str, float]] = thumbs
) -> None:
    """Each session's `signals`, once its end is in the reward service's store."""
    headers = {"authorization": f"Bearer {KEY}"}
    for i in sessions:

        async def known(i: int = i) -> bool:
            answer = await client.get(f"/v1/sessions/s{i}", headers=headers)
            return answer.status_code == 200 and answer.json()["state"] == "awaiting_feedback"

        await eventually(known, timeout=30, interval=0.05)
        for name, value in signals(i).items():
            body = {"session": f"s{i}", "name": name, "value": value}
            answer = await client.post("/v1/feedback", json=body, headers=headers)
            assert answer.status_code == 202, answer.text


async def test_a_candidate_users_dislike_is_rolled_back_across_a_restart(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    await publish(broker, tmp_path, pb.PolicyVersion(version=0), pb.PolicyVersion(version=1))
    arms = ["stable", "candidate"]
    first, rest = range(0, PER_ARM), range(PER_ARM, 2 * PER_ARM)
    async with reward_service(broker, tmp_path, CollectorRegistry()) as client:

        async def started() -> bool:
            return len(await decisions(broker)) == 1

        await eventually(started, timeout=30, interval=0.1)
        (start,) = await decisions(broker)
        assert (start.decision_id, start.action, start.version, start.stable) == (
            "canary/1/start",
            pb.ROLLOUT_ACTION_START,
            1,
            0,
        )
        assert (start.actor, start.share) == ("canary", 0.5)
        await publish(broker, tmp_path, *(ended(i, arms[i % 2]) for i in first))
        await feedback(client, first)
        await asyncio.sleep(0.5)
        assert len(await decisions(broker)) == 1  # too few sessions to decide

    registry = CollectorRegistry()
    async with reward_service(broker, tmp_path, registry) as client:
        assert registry.get_sample_value("harnessrl_canary_candidate") == 1
        await publish(broker, tmp_path, *(ended(i, arms[i % 2]) for i in rest))
        await feedback(client, rest)

        async def rolled_back() -> bool:
            return len(await decisions(broker)) == 2

        await eventually(rolled_back, timeout=30, interval=0.1)
        await asyncio.sleep(1.0)
        assert len(await decisions(broker)) == 2, "a decision twice"
        rollback = (await decisions(broker))[-1]
        assert (rollback.decision_id, rollback.action, rollback.version, rollback.stable) == (
            "canary/1/rollback",
            pb.ROLLOUT_ACTION_ROLLBACK,
            1,
            0,
        )
        assert (rollback.actor, rollback.reason) == ("canary", "reward")
        proof = orjson.loads(rollback.evidence_json)
        assert proof["action"] == "rollback"
        assert proof["means"] == {"stable": 1.0, "candidate": -1.0}
        assert proof["reward"]["upper"] < 0
        # Every reward counted once, across the restart: the rule decided at the first look
        # it could, as a Canary fed the same rewards in the same order does.
        assert proof["rewarded"] == first_decision()
        assert all(n <= PER_ARM for n in proof["sessions"].values())

        async def shown() -> bool:
            return registry.get_sample_value("harnessrl_canary_candidate") == -1

        await eventually(shown, timeout=10)
        labels = {"action": "rollback", "reason": "reward"}
        assert registry.get_sample_value("harnessrl_canary_decisions_total", labels) == 1


async def test_a_canary_on_a_held_out_signal_ignores_the_thumbs_the_policy_is_paid_for(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """The candidate earns every thumbs up and solves nothing: judged on `resolved` (held
    out, never trained on), it is rolled back."""

    def gamed(i: int) -> dict[str, float]:
        return {"thumbs": -1 if i % 2 == 0 else 1, "resolved": 1 if i % 2 == 0 else 0}

    await publish(broker, tmp_path, pb.PolicyVersion(version=0), pb.PolicyVersion(version=1))
    canary = CONFIG.model_copy(update={"signals": ["resolved"]})
    arms = ["stable", "candidate"]
    async with reward_service(broker, tmp_path, CollectorRegistry(), canary, HELD_OUT) as client:

        async def decided() -> bool:
            return len(await decisions(broker)) >= 1

        await eventually(decided, timeout=30, interval=0.1)
        sessions = range(2 * PER_ARM)
        await publish(broker, tmp_path, *(ended(i, arms[i % 2]) for i in sessions))
        await feedback(client, sessions, gamed)

        async def rolled_back() -> bool:
            return len(await decisions(broker)) == 2

        await eventually(rolled_back, timeout=30, interval=0.1)
        rollback = (await decisions(broker))[-1]
        assert (rollback.action, rollback.reason) == (pb.ROLLOUT_ACTION_ROLLBACK, "reward")
        proof = orjson.loads(rollback.evidence_json)
        assert proof["means"] == {"stable": 1.0, "candidate": 0.0}
        assert proof["rewarded"] == first_decision(0.0, 1.0)
