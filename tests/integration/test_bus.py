"""The bus on the real embedded broker: round trips, traces, dead letters, holds, refusals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from harnessrl import events
from harnessrl.bus import BusMetrics, Consumer, Context, Producer, Record
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.retry import RetryableError
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import committed_offsets, eventually, filled, read_topic

pytestmark = pytest.mark.integration

Handler = Callable[[Record, Context], Awaitable[None]]


@asynccontextmanager
async def running(
    kafka: KafkaSettings,
    settings: ConsumerSettings,
    producer: Producer,
    topics: list[str],
    handler: Handler,
    group: str = "test",
    **kwargs: Any,
) -> AsyncIterator[Consumer]:
    """A consumer running in the background, joined to its group, stopped on exit."""
    consumer = Consumer(
        kafka, settings, topics=topics, group_id=group, handler=handler, producer=producer, **kwargs
    )
    task = asyncio.create_task(consumer.run())
    await eventually(lambda: bool(consumer.assigned) or task.done())
    try:
        yield consumer
    finally:
        await consumer.stop()
        await task


@asynccontextmanager
async def started(
    kafka: KafkaSettings, settings: ProducerSettings, name: str = "test/0", **kwargs: Any
) -> AsyncIterator[Producer]:
    producer = Producer(kafka, settings, name=name, **kwargs)
    await producer.start()
    try:
        yield producer
    finally:
        await producer.stop()


async def test_every_event_type_round_trips_through_kafka(
    kafka: KafkaSettings, producer_settings: ProducerSettings, consumer_settings: ConsumerSettings
) -> None:
    originals = {cls: filled(cls, seed=i) for i, cls in enumerate(events.EVENT_TYPES)}
    received: dict[type, Record] = {}

    async def handle(record: Record, ctx: Context) -> None:
        received[type(record.event)] = record

    async with started(kafka, producer_settings) as producer:
        topics = sorted({events.topic_of(e) for e in originals.values()})
        async with running(kafka, consumer_settings, producer, topics, handle):
            acks = await asyncio.gather(*(producer.publish(e) for e in originals.values()))
            await eventually(lambda: len(received) == len(originals))
    assert {a.topic for a in acks} == set(topics)
    for cls, original in originals.items():
        record = received[cls]
        assert record.event == original, cls.__name__
        same = record.event.SerializeToString(deterministic=True)
        assert same == original.SerializeToString(deterministic=True)
        assert record.meta.event_id == events.event_id(original)
        assert record.meta.producer == "test/0"
        assert record.key == events.event_key(original)
        assert record.topic == events.topic_of(original)


async def test_consumer_span_continues_the_producer_trace(
    kafka: KafkaSettings, producer_settings: ProducerSettings, consumer_settings: ConsumerSettings
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    seen: list[str] = []

    async def handle(record: Record, ctx: Context) -> None:
        seen.append(record.meta.event_id)

    async with (
        started(kafka, producer_settings) as producer,
        running(kafka, consumer_settings, producer, [events.CALLS], handle, tracer=tracer),
    ):
        with tracer.start_as_current_span("harness call") as call_span:
            await producer.publish(pb.ModelCall(episode_id="e", attempt=1, group_id="g", seq=0))
        await eventually(lambda: len(seen) == 1)
    process = next(s for s in exporter.get_finished_spans() if s.name == "hrl.calls process")
    assert process.context.trace_id == call_span.get_span_context().trace_id
    assert process.parent is not None
    assert process.parent.span_id == call_span.get_span_context().span_id
    assert process.attributes is not None
    assert process.attributes["messaging.message.id"] == "call/e/1/0"


async def test_poison_record_lands_in_the_dlq_and_the_consumer_goes_on(
    broker: Any,
    kafka: KafkaSettings,
    producer_settings: ProducerSettings,
    consumer_settings: ConsumerSettings,
) -> None:
    handled: list[str] = []

    async def handle(record: Record, ctx: Context) -> None:
        handled.append(record.event.task_id)

    async with started(kafka, producer_settings) as producer:
        await producer.publish(pb.TaskSubmitted(task_id="before", group_id="g1"))
        await producer.publish_raw(
            events.TASKS, b"g1", b"\x08\xff garbage", [("traceparent", b"x")]
        )
        await producer.publish(pb.TaskSubmitted(task_id="after", group_id="g1"))
        async with running(kafka, consumer_settings, producer, [events.TASKS], handle):
            await eventually(lambda: handled == ["before", "after"])
    dead = await read_topic(broker.bootstrap, events.DLQ, 1)
    headers = dict(dead[0].headers)
    assert dead[0].value == b"\x08\xff garbage"
    assert dead[0].key == b"g1"
    assert headers["dlq.stage"] == b"decode"
    assert b"not a TaskEnvelope" in headers["dlq.reason"]
    assert headers["dlq.topic"] == b"hrl.tasks"
    assert headers["dlq.offset"] == b"1"
    assert headers["traceparent"] == b"x"  # original headers kept
    committed = await committed_offsets(broker.bootstrap, "test", events.TASKS)
    assert committed[dead[0].partition] == 3  # the poison record is behind us, not in the way


async def test_handler_errors_retry_when_transient_and_dead_letter_otherwise(
    broker: Any,
    kafka: KafkaSettings,
    producer_settings: ProducerSettings,
    consumer_settings: ConsumerSettings,
) -> None:
    attempts: dict[str, int] = {}
    metrics = BusMetrics()

    async def handle(record: Record, ctx: Context) -> None:
        task_id = record.event.task_id
        attempts[task_id] = attempts.get(task_id, 0) + 1
        if task_id == "flaky" and attempts[task_id] < 3:
            raise RetryableError("downstream busy")
        if task_id == "broken":
            raise ValueError("metadata.answer: missing")
        if task_id == "always-busy":
            raise RetryableError("still busy")

    async with started(kafka, producer_settings) as producer:
        for task_id in ("flaky", "broken", "always-busy", "fine"):
            await producer.publish(pb.TaskSubmitted(task_id=task_id, group_id="same-group"))
        async with running(
            kafka, consumer_settings, producer, [events.TASKS], handle, metrics=metrics
        ):
            await eventually(lambda: attempts.get("fine") == 1)
    assert attempts == {"flaky": 3, "broken": 1, "always-busy": 5, "fine": 1}
    dead = await read_topic(broker.bootstrap, events.DLQ, 2)
    reasons = sorted(dict(r.headers)["dlq.reason"].decode() for r in dead)
    assert reasons == [
        "ValueError: metadata.answer: missing",
        "retries exhausted after 5 attempts: RetryableError: still busy",
    ]
    assert metrics.handler_retries(events.TASKS)._value.get() == 2 + 4


async def test_a_held_record_is_not_committed_until_released(
    broker: Any,
    kafka: KafkaSettings,
    producer_settings: ProducerSettings,
    consumer_settings: ConsumerSettings,
) -> None:
    holds = []

    async def handle(record: Record, ctx: Context) -> None:
        if record.event.task_id == "wait":
            holds.append(ctx.hold())

    async with started(kafka, producer_settings) as producer:
        for task_id in ("a", "wait", "b", "c"):
            await producer.publish(pb.TaskSubmitted(task_id=task_id, group_id="one-group"))
        partition = (
            await producer.publish(pb.TaskSubmitted(task_id="d", group_id="one-group"))
        ).partition
        async with running(kafka, consumer_settings, producer, [events.TASKS], handle):
            await eventually(lambda: len(holds) == 1)

            async def committed_at(offset: int) -> bool:
                got = await committed_offsets(broker.bootstrap, "test", events.TASKS)
                return got[partition] == offset

            await eventually(lambda: committed_at(1))
            await asyncio.sleep(1.0)
            assert await committed_at(1)  # still parked on the held record
            holds[0].release()
            await eventually(lambda: committed_at(5))


async def test_oversized_records_are_refused_at_publish(
    kafka: KafkaSettings, producer_settings: ProducerSettings
) -> None:
    small = kafka.model_copy(update={"max_request_bytes": 1024 * 1024})
    async with started(small, producer_settings) as producer:
        with pytest.raises(ValueError, match=r"exceeds kafka\.max_request_bytes"):
            producer.publish(pb.ModelCall(group_id="g", prompt_token_ids=[200_000] * 400_000))


async def test_records_left_at_stop_are_sent_by_the_next_run(tmp_path: Path) -> None:
    from harnessrl.broker import EmbeddedBroker, free_port

    port = free_port()
    kafka = KafkaSettings(bootstrap_servers=f"127.0.0.1:{port}", partitions=3)
    settings = ProducerSettings(spill_dir=tmp_path / "spill", buffer_max_bytes=2000)
    producer = Producer(kafka, settings, name="svc/0")
    await producer.start()  # no broker yet: everything waits in memory, then on disk
    deliveries = [
        producer.publish(pb.TaskSubmitted(task_id=str(i), group_id=f"g{i % 4}")) for i in range(50)
    ]
    await producer.stop(timeout=0.5)
    assert all(isinstance(d.exception(), Exception) for d in deliveries)

    broker = EmbeddedBroker(port=port)
    await broker.start()
    try:
        from harnessrl.bus import ensure_topics

        await ensure_topics(kafka)
        async with started(kafka, settings, name="svc/0") as again:
            assert await again.flush(30)
        records = await read_topic(broker.bootstrap, events.TASKS, 50)
        ids = sorted(
            int(events.decode(events.TASKS, r.value).task_submitted.task_id) for r in records
        )
        assert ids == list(range(50))
    finally:
        await broker.stop()


async def test_a_consumer_waiting_for_an_unreachable_broker_stops_promptly(
    producer_settings: ProducerSettings, consumer_settings: ConsumerSettings
) -> None:
    from harnessrl.broker import free_port

    nowhere = KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}")

    async def handle(record: Record, ctx: Context) -> None:
        raise AssertionError("no record can arrive")

    async with started(nowhere, producer_settings) as producer:
        consumer = Consumer(
            nowhere,
            consumer_settings,
            topics=[events.TASKS],
            group_id="g",
            handler=handle,
            producer=producer,
        )
        task = asyncio.create_task(consumer.run())
        await asyncio.sleep(0.5)
        await consumer.stop()
        await asyncio.wait_for(task, 5)


async def test_reading_a_topic_that_does_not_exist_yet_yields_nothing(broker: Any) -> None:
    from harnessrl.bus.snapshot import read_to_end

    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap, create_topics=False)
    found = [r async for r in read_to_end(kafka, "hrl.not-yet", client_id="t")]
    found += [r async for r in read_to_end(kafka, "hrl.not-yet", client_id="t", since_ms=0)]
    assert found == []
