"""A service's bus, wired once: its producer, and consumers declared as tables of handlers.

A service declares what it consumes as a `Subscription`: a consumer group and one handler
per event type, `{pb.EpisodeFinished: self._on_finished}`. The topics follow from the event
types (harnessrl.events), and each record is handed to the handler of its event's type,
typed; events of other types on those topics are skipped (their records still commit).

    bus = ServiceBus(config, runtime)
    async with AsyncExitStack() as stack:
        await bus.start(stack, topics=[events.EPISODES, events.REWARDS])
        bus.consume(stack, Subscription("harnessrl.reward", {pb.EpisodeFinished: on_finished}))
        await stopping.wait()

Leaving the stack stops in reverse order: each consumer stops fetching, finishes the batch
in hand, commits what is finished and closes; then the producer flushes (spilling what the
broker did not take) and closes. A record is finished, so committed, only once the outputs
its handler published are acknowledged and every hold it took is released
(harnessrl.bus.consumer), so a crash at any point re-delivers exactly what may be missing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from harnessrl import events
from harnessrl.bus.consumer import Consumer, Context, Handler, PartitionHook, Record
from harnessrl.bus.kafka import ensure_topics
from harnessrl.bus.metrics import BusMetrics
from harnessrl.bus.producer import Producer
from harnessrl.config import ServiceConfig
from harnessrl.runtime import Runtime

EventHandler = Callable[[Any, Context], Awaitable[None]]
"""Handles one event of the type it is registered for (typed as that event in the handler),
with the record's Context to publish outputs or hold the record."""

Handlers = Mapping[type[Any], EventHandler]
"""One handler per event type (keyed by type[Any], so that a table of handlers typed for
different events type-checks as one mapping)."""


def dispatch(handlers: Handlers) -> Handler:
    """A consumer handler that hands each record's event to the handler of its type, and
    skips events of other types."""

    async def handle(record: Record, ctx: Context) -> None:
        handler = handlers.get(type(record.event))
        if handler is not None:
            await handler(record.event, ctx)

    return handle


@dataclass(frozen=True, slots=True)
class Subscription:
    """What one consumer of a service consumes: its group and a handler per event type."""

    group_id: str
    """The consumer group (a group per instance makes every instance see every record)."""
    handlers: Handlers
    """One handler per event type consumed; the topics are those of these types."""
    on_revoked: PartitionHook | None = None
    """Called with the partitions another member now owns (after their commit)."""
    co_partitioned: bool = False
    """Partition p of every topic to the same member (topics keyed alike meet)."""

    @property
    def topics(self) -> list[str]:
        """The topics of the handled event types, each once, in table order."""
        return list(dict.fromkeys(events.topic_for(t) for t in self.handlers))


class Consuming:
    """A consumer running in its own task, after an optional `before` (a state rebuild that
    must finish before the first record is handled)."""

    def __init__(
        self, consumer: Consumer, before: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.consumer = consumer
        self._before = before
        self._consuming = asyncio.Event()
        self.task = asyncio.create_task(self._run(), name=f"consume {','.join(consumer.topics)}")

    async def _run(self) -> None:
        if self._before is not None:
            await self._before()
        self._consuming.set()
        await self.consumer.run()

    async def stop(self) -> None:
        """Stop fetching, finish the batch in hand, commit, close, and wait for the task;
        still in `before`, the task is cancelled (nothing is in flight). Idempotent."""
        await self.consumer.stop()
        if not self._consuming.is_set():
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


class ServiceBus:
    """One service's producer (`runtime.producer_name`) and consumers, sharing its bus
    metrics and tracer, started on the service's exit stack and stopped with it. `wal`
    sends every record through the spill log first (producer.wal), whatever the settings."""

    def __init__(self, config: ServiceConfig, runtime: Runtime, *, wal: bool = False) -> None:
        self._config = config
        self._runtime = runtime
        self._producer_settings = config.producer
        if wal:
            self._producer_settings = config.producer.model_copy(update={"wal": True})
        self.metrics = BusMetrics(runtime.registry)
        self._tracer = runtime.tracer
        self._producer: Producer | None = None

    @property
    def producer(self) -> Producer:
        """The started producer. Raises RuntimeError before start()."""
        if self._producer is None:
            raise RuntimeError("the service's producer is not started")
        return self._producer

    @property
    def healthy(self) -> bool:
        """The producer is started and its pump alive."""
        return self._producer is not None and self._producer.healthy

    async def start(self, stack: AsyncExitStack, *, topics: Iterable[str] = ()) -> Producer:
        """Start the producer (flushed and closed when `stack` closes), then make `topics`
        (see create_topics)."""
        producer = Producer(
            self._config.kafka,
            self._producer_settings,
            name=self._runtime.producer_name,
            metrics=self.metrics,
        )
        await producer.start()
        stack.push_async_callback(producer.stop)
        self._producer = producer
        await self.create_topics(topics)
        return producer

    async def create_topics(self, topics: Iterable[str]) -> None:
        """With kafka.create_topics, make the missing ones of `topics`, waiting for the
        broker as long as it takes."""
        topics = list(topics)
        if self._config.kafka.create_topics and topics:
            await ensure_topics(self._config.kafka, topics, max_attempts=10**6)

    def consumer(self, subscription: Subscription) -> Consumer:
        """A consumer of `subscription` on this bus, not running (see consume())."""
        return Consumer(
            self._config.kafka,
            self._config.consumer,
            topics=subscription.topics,
            group_id=subscription.group_id,
            handler=dispatch(subscription.handlers),
            producer=self.producer,
            metrics=self.metrics,
            tracer=self._tracer,
            on_revoked=subscription.on_revoked,
            co_partitioned=subscription.co_partitioned,
        )

    def consume(
        self,
        stack: AsyncExitStack,
        subscription: Subscription,
        *,
        before: Callable[[], Awaitable[None]] | None = None,
    ) -> Consuming:
        """Run a consumer of `subscription` (after `before`) until `stack` closes; the
        returned handle may stop it earlier."""
        consuming = Consuming(self.consumer(subscription), before)
        stack.push_async_callback(consuming.stop)
        return consuming
