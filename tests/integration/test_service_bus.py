"""The service skeleton (harnessrl.service_bus) on the real embedded broker: a handler table
gets each event typed and skips other types, a record commits once its outputs are
acknowledged, a held record outlives a stop, and a stop while state is being rebuilt
cancels the rebuild."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.bus import Context, Hold
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings, ServiceConfig
from harnessrl.runtime import Runtime
from harnessrl.service_bus import ServiceBus, Subscription
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import committed_offsets, eventually, read_topic

pytestmark = pytest.mark.integration

GROUP = "test.service-bus"


def _bus(
    kafka: KafkaSettings, producer: ProducerSettings, consumer: ConsumerSettings
) -> ServiceBus:
    config = ServiceConfig(instance="s-0", kafka=kafka, producer=producer, consumer=consumer)
    runtime = Runtime("svc", "s-0", CollectorRegistry(), TracerProvider())
    return ServiceBus(config, runtime)


def _finished(episode: str) -> pb.EpisodeFinished:
    return pb.EpisodeFinished(episode_id=episode, attempt=1, group_id="g", final=True)


async def test_a_handler_table_gets_its_types_and_commits_after_the_outputs_are_acked(
    broker: Any,
    kafka: KafkaSettings,
    producer_settings: ProducerSettings,
    consumer_settings: ConsumerSettings,
) -> None:
    seen: list[Any] = []

    async def on_finished(event: pb.EpisodeFinished, ctx: Context) -> None:
        seen.append(event)
        ctx.publish(pb.RewardAssigned(episode_id=event.episode_id, attempt=1, group_id="g"))

    bus = _bus(kafka, producer_settings, consumer_settings)
    async with AsyncExitStack() as stack:
        producer = await bus.start(stack, topics=[events.EPISODES, events.REWARDS])
        started = await producer.publish(pb.EpisodeStarted(episode_id="e", attempt=1, group_id="g"))
        await producer.publish(_finished("e"))
        bus.consume(stack, Subscription(GROUP, {pb.EpisodeFinished: on_finished}))
        await eventually(lambda: len(seen) == 1)

        async def both_committed() -> bool:
            got = await committed_offsets(broker.bootstrap, GROUP, events.EPISODES)
            return got[started.partition] == started.offset + 2

        await eventually(both_committed)  # the skipped EpisodeStarted commits too
    assert seen == [_finished("e")]
    assert type(seen[0]) is pb.EpisodeFinished
    (reward,) = await read_topic(broker.bootstrap, events.REWARDS, 1)
    assert events.decode(events.REWARDS, reward.value).reward_assigned.episode_id == "e"


async def test_a_record_held_at_stop_is_delivered_again_to_the_next_run(
    broker: Any,
    kafka: KafkaSettings,
    producer_settings: ProducerSettings,
    consumer_settings: ConsumerSettings,
) -> None:
    holds: list[Hold] = []
    runs: list[str] = []

    async def hold_it(event: pb.EpisodeFinished, ctx: Context) -> None:
        runs.append(event.episode_id)
        holds.append(ctx.hold())  # never released: as a crash before the output was acked

    for run in range(2):
        bus = _bus(kafka, producer_settings, consumer_settings)
        async with AsyncExitStack() as stack:
            producer = await bus.start(stack)
            if run == 0:
                ack = await producer.publish(_finished("held"))
            bus.consume(stack, Subscription(GROUP, {pb.EpisodeFinished: hold_it}))
            await eventually(lambda n=run: len(runs) == n + 1)
        committed = await committed_offsets(broker.bootstrap, GROUP, events.EPISODES)
        assert committed[ack.partition] == ack.offset  # stopped, still not committed
    assert runs == ["held", "held"]


async def test_a_stop_while_the_state_is_rebuilt_cancels_the_rebuild(
    kafka: KafkaSettings, producer_settings: ProducerSettings, consumer_settings: ConsumerSettings
) -> None:
    handled: list[Any] = []
    rebuilding = asyncio.Event()

    async def rebuild() -> None:
        rebuilding.set()
        await asyncio.Event().wait()  # as a broker that never answers

    async def on_finished(event: pb.EpisodeFinished, ctx: Context) -> None:
        handled.append(event)

    bus = _bus(kafka, producer_settings, consumer_settings)
    async with asyncio.timeout(30):
        async with AsyncExitStack() as stack:
            await bus.start(stack)
            await bus.producer.publish(_finished("e"))
            subscription = Subscription(GROUP, {pb.EpisodeFinished: on_finished})
            consuming = bus.consume(stack, subscription, before=rebuild)
            await rebuilding.wait()
        assert consuming.task.cancelled()
    assert handled == []
    assert not bus.healthy  # the producer is stopped with the stack
