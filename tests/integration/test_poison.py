"""Poison records on every topic, on the real broker, while the services that consume the
topic run: each poison ends in hrl.dlq (its own bytes, and why, in the headers) once per
consumer group, and every consumer goes on to process the good records published after it
on the same partition.

The poisons: random bytes, an empty value, another topic's event (envelopes share field
numbers, so it parses as this topic's event: only its id tells), an envelope with no event
or an event type this code does not know, a truncated envelope, an event without id, and
per topic an event with fields its consumer refuses.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import committed_offsets, eventually, read_topic, topic_size
from tests.integration.gateway_stack import running_stack
from tests.integration.test_controller import _finals, _task, controller
from tests.integration.test_policy_follow import engine
from tests.integration.test_reward import reward_service
from tests.integration.test_sample_builder import group_events, sample_builder, samples_on_topic
from tests.integration.test_trainer import trainer
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration
__all__ = ["engine"]  # fixture used here

_ENVELOPES = {
    events.TASKS: (pb.TaskEnvelope, pb.TaskSubmitted(task_id="t", group_id="g", input_json="1")),
    events.EPISODES: (pb.EpisodeEnvelope, pb.EpisodeStarted(episode_id="e", group_id="g")),
    events.CALLS: (pb.CallEnvelope, pb.ModelCall(episode_id="e", group_id="g", attempt=1)),
    events.REWARDS: (pb.RewardEnvelope, pb.RewardAssigned(episode_id="e", group_id="g")),
    events.SAMPLES: (pb.SampleEnvelope, pb.GroupSamples(group_id="g")),
    events.POLICY: (pb.PolicyEnvelope, pb.PolicyLoaded(version=1, engine="e", ok=True)),
}


def poisons(topic: str) -> dict[str, bytes]:
    """What can reach any topic's consumers that no harnessrl producer writes."""
    envelope, event = _ENVELOPES[topic]
    good = events.encode(event, producer="poison")
    without_meta = events.wrap(event, producer="poison")
    without_meta.ClearField("meta")
    other = (pb.RewardAssigned if topic != events.REWARDS else pb.ModelCall)(
        episode_id="e", attempt=1, group_id="g"
    )
    meta = pb.EventMeta(event_id="x/1").SerializeToString()
    unknown_event = envelope(meta=pb.EventMeta(event_id="x/1")).SerializeToString() + (
        events.varint(99 << 3 | 2) + events.varint(len(meta)) + meta  # field 99: no such event
    )
    return {
        "random bytes": b"\xff\xff" + random.Random(topic).randbytes(62),
        "empty value": b"",
        "another topic's event": events.encode(other, producer="poison"),
        "no event": envelope(meta=pb.EventMeta(event_id="x/1")).SerializeToString(),
        "unknown event type": unknown_event,
        "truncated": good[: len(good) // 2],
        "no event id": without_meta.SerializeToString(),
    }


def invalid(event: Message) -> bytes:
    """A well-formed record of `event`, whose fields its consumer is to refuse."""
    return events.encode(event, producer="poison")


@asynccontextmanager
async def _producer(broker: EmbeddedBroker, tmp_path: Path, name: str) -> AsyncIterator[Producer]:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / f"{name}-spill"),
        name=f"{name}/0",
    )
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def _publish_raw(broker: EmbeddedBroker, tmp_path: Path, records: Iterable[Any]) -> None:
    """(topic, key, value) records, in order, exactly as given."""
    async with _producer(broker, tmp_path, "poison") as producer:
        for topic, key, value in records:
            await producer.publish_raw(topic, key.encode(), value)


async def _publish(broker: EmbeddedBroker, tmp_path: Path, items: Iterable[Message]) -> None:
    async with _producer(broker, tmp_path, "good") as producer:
        for item in items:
            await producer.publish(item)


Expected = list[tuple[str, str, bytes, set[str]]]
"""(poison name, topic, its bytes, the consumer groups that must dead-letter it)."""


def expect(topic: str, bad: dict[str, bytes], groups: set[str]) -> Expected:
    return [(name, topic, value, groups) for name, value in bad.items()]


async def _assert_dead_lettered(broker: EmbeddedBroker, expected: Expected) -> None:
    """hrl.dlq holds each poison once per group, with its own bytes and key, and the reason,
    stage, topic and offset in the headers; nothing else."""
    count = sum(len(groups) for *_, groups in expected)

    async def arrived() -> bool:
        return await topic_size(broker.bootstrap, events.DLQ) >= count

    await eventually(arrived, timeout=60, interval=0.3)
    dead = await read_topic(broker.bootstrap, events.DLQ, count)
    found: set[tuple[str, bytes, str]] = set()
    for record in dead:
        headers = dict(record.headers)
        assert headers["dlq.stage"] in (b"decode", b"handler"), headers
        assert headers["dlq.reason"] and headers["dlq.offset"].isdigit(), headers
        topic, group = headers["dlq.topic"].decode(), headers["dlq.group"].decode()
        found.add((topic, record.value or b"", group))
    for name, topic, value, groups in expected:
        for group in groups:
            assert (topic, value, group) in found, f"{topic}: {name!r} not dead-lettered by {group}"
    assert len(dead) == count == len(found)
    assert await topic_size(broker.bootstrap, events.DLQ) == count  # and nothing else


async def test_poison_on_hrl_tasks_is_dead_lettered_and_the_controller_runs_the_next_task(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    bad = poisons(events.TASKS) | {
        "a group size no controller can run": invalid(
            pb.TaskSubmitted(
                task_id="t",
                group_id="g-huge",
                split=pb.MODE_VAL,
                input_json="{}",
                group_size=2**32 - 1,
            )
        ),
    }
    async with (
        running_stack(broker, tmp_path, TINY) as stack,
        controller(stack, tmp_path),
    ):
        await _publish_raw(broker, tmp_path, [(events.TASKS, "g-after", v) for v in bad.values()])
        await _publish(
            broker, tmp_path, [_task("g-after", {"behaviour": "sleep", "seconds": 0}, family="odd")]
        )
        (final,) = await _finals(broker.bootstrap, 1)
        assert final.group_id == "g-after"
        await _assert_dead_lettered(broker, expect(events.TASKS, bad, {"harnessrl.controller"}))


async def test_poison_on_episodes_calls_and_rewards_is_dead_lettered_and_groups_still_build(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    builder, scorer = "harnessrl.sample-builder", "harnessrl.reward"
    episodes = poisons(events.EPISODES) | {
        "a finished episode without group": invalid(
            pb.EpisodeFinished(episode_id="e-0", attempt=1, final=True, task_id="t")
        ),
    }
    calls = poisons(events.CALLS)
    rewards = poisons(events.REWARDS) | {
        "a reward that is not a number": invalid(
            pb.RewardAssigned(episode_id="gp-0", attempt=1, group_id="gp", value=math.nan)
        ),
        "an infinite reward": invalid(
            pb.RewardAssigned(episode_id="gp-1", attempt=1, group_id="gp", value=math.inf)
        ),
    }
    async with (
        reward_service(
            broker, tmp_path, source="entrypoint:tests.integration.workers.rewards:by_index"
        ),
        sample_builder(broker, tmp_path),
    ):
        await _publish_raw(
            broker,
            tmp_path,
            [(events.EPISODES, "g-good", v) for v in episodes.values()]
            + [(events.CALLS, "g-good", v) for v in calls.values()]
            + [(events.REWARDS, "g-good", v) for v in rewards.values()],
        )
        await _publish(broker, tmp_path, group_events("g-good"))
        (built,) = await samples_on_topic(broker, 1)
        assert built.group_id == "g-good" and len(built.samples) == 3
        # The reward service scored the good episodes after the poison too.
        scored = {
            r.episode_id
            for r in (await _decoded(broker, events.REWARDS))
            if r.source.startswith("entrypoint:")
        }
        assert scored == {"g-good-0", "g-good-1", "g-good-2"}
    await _assert_dead_lettered(
        broker,
        expect(events.EPISODES, episodes, {builder, scorer})
        + expect(events.CALLS, calls, {builder})
        + expect(events.REWARDS, rewards, {builder}),
    )


async def _decoded(broker: EmbeddedBroker, topic: str) -> list[Any]:
    """The decodable events of `topic` (poison skipped)."""
    size = await topic_size(broker.bootstrap, topic)
    out = []
    for record in await read_topic(broker.bootstrap, topic, size) if size else []:
        try:
            envelope = events.decode(topic, record.value)
        except events.DecodeError:
            continue
        out.append(events.unwrap(envelope)[2])
    return out


def _samples(group: str, *, tokens: list[int], advantage: float = 1.0) -> pb.GroupSamples:
    return pb.GroupSamples(
        group_id=group,
        task_id=group,
        samples=[
            pb.Sample(
                sample_id=f"{group}-0/1/0",
                episode_id=f"{group}-0",
                attempt=1,
                token_ids=tokens,
                loss_mask=[False] + [True] * (len(tokens) - 1),
                behavior_logprobs=[0.0] + [-1.0] * (len(tokens) - 1),
                advantage=advantage,
                reward=1.0,
                temperature=1.0,
            )
        ],
    )


async def test_poison_on_hrl_samples_is_dead_lettered_and_the_trainer_steps_on_the_next_group(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    bad = poisons(events.SAMPLES) | {
        "token ids beyond the vocabulary": invalid(_samples("gv", tokens=[5, 6, 10**9])),
        "an advantage that is not a number": invalid(
            _samples("ga", tokens=[5, 6, 7], advantage=math.nan)
        ),
        "a loss mask longer than the tokens": invalid(
            pb.GroupSamples(
                group_id="gm",
                samples=[pb.Sample(sample_id="m", token_ids=[1, 2], loss_mask=[False] * 3)],
            )
        ),
    }
    async with trainer(broker, tmp_path, batch_groups=1) as service:
        await _publish_raw(broker, tmp_path, [(events.SAMPLES, "g-good", v) for v in bad.values()])
        await _publish(broker, tmp_path, [_samples("g-good", tokens=[11, 257, 400, 12, 90])])
        await eventually(lambda: service.step >= 1, timeout=60)
        await _assert_dead_lettered(broker, expect(events.SAMPLES, bad, {"harnessrl.trainer"}))
        assert service.health()["producer"]


async def test_poison_on_hrl_policy_is_dead_lettered_and_every_follower_takes_the_next_event(
    broker: EmbeddedBroker, tmp_path: Path, engine: tuple[str, Any]
) -> None:
    bad = poisons(events.POLICY)
    good = pb.PolicyLoaded(version=7, engine="http://engine-x", ok=True)
    async with (
        running_stack(broker, tmp_path, TINY) as stack,
        controller(stack, tmp_path),
        trainer(broker, tmp_path),
    ):
        groups = {
            "harnessrl.gateway.gw-0",
            "harnessrl.controller.ctl-0",
            "harnessrl.inference.engine-0",
            "harnessrl.trainer.trainer-0",
        }
        await _publish_raw(broker, tmp_path, [(events.POLICY, "policy", v) for v in bad.values()])
        await _publish(broker, tmp_path, [good])
        await eventually(lambda: stack.gateway.versions.snapshot().get(good.engine) == 7)
        end = await topic_size(broker.bootstrap, events.POLICY)

        async def all_committed() -> bool:
            for group in groups:
                if (
                    sum((await committed_offsets(broker.bootstrap, group, events.POLICY)).values())
                    < end
                ):
                    return False
            return True

        await eventually(all_committed, timeout=30, interval=0.3)
        await _assert_dead_lettered(broker, expect(events.POLICY, bad, groups))
