"""Reading a topic from its beginning to where it ends now (state rebuilt after restarts)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf.message import Message

from harnessrl import events
from harnessrl.bus.kafka import client_kwargs
from harnessrl.config import KafkaSettings
from harnessrl.logs import get_logger

log = get_logger(__name__)


async def end_offsets(consumer: Any, partitions: list[Any]) -> dict[Any, int]:
    """The end offset (high watermark) of each partition, as fetches report it.

    Assigns `partitions` to `consumer` (a started, group-less AIOKafkaConsumer) and leaves
    its positions anywhere. ListOffsets alone is not enough: Tansu 0.6 answers it with an
    end that can lag one record behind concurrent produce requests, while its fetch
    responses carry the true high watermark; the larger of the two is the end.
    """
    listed = await consumer.end_offsets(partitions)
    consumer.assign(partitions)
    await consumer.seek_to_beginning(*partitions)
    marks: dict[Any, int] = {}
    while len(marks) < len(partitions):
        await consumer.getmany(*[tp for tp in partitions if tp not in marks], timeout_ms=200)
        for tp in partitions:
            mark = consumer.highwater(tp)
            if mark is not None:
                marks[tp] = max(mark, listed[tp])
    return marks


async def raw_to_end(
    kafka: KafkaSettings, topic: str, *, client_id: str, since_ms: int | None = None
) -> AsyncIterator[Any]:
    """Every raw record of `topic` that exists when called, partition by partition in
    offset order; with `since_ms`, from the first record stamped at or after it (a broker
    that cannot look offsets up by time, as Tansu, is read from the beginning: a superset).
    Raises what aiokafka raises when Kafka is unreachable."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        **client_kwargs(kafka, client_id),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = [
            TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        if not partitions:
            return  # no such topic (yet): nothing to read
        ends = await end_offsets(consumer, partitions)
        todo = {tp for tp in partitions if ends[tp] > 0}
        await consumer.seek_to_beginning(*partitions)
        if since_ms is not None and todo:
            found = await consumer.offsets_for_times({tp: since_ms for tp in todo})
            for tp in list(todo):
                hit = found.get(tp)
                if hit is None:
                    todo.discard(tp)  # nothing that new
                elif hit.timestamp is not None and hit.timestamp >= 0:
                    if hit.offset >= ends[tp]:
                        todo.discard(tp)
                    else:
                        consumer.seek(tp, hit.offset)
        while todo:
            batch = await consumer.getmany(*todo, timeout_ms=1000)
            for tp, records in batch.items():
                for record in records:
                    if record.offset < ends[tp]:
                        yield record
                if records and records[-1].offset >= ends[tp] - 1:
                    todo.discard(tp)
    finally:
        await consumer.stop()


async def read_to_end(
    kafka: KafkaSettings, topic: str, *, client_id: str, since_ms: int | None = None
) -> AsyncIterator[tuple[str, Message, Any]]:
    """(event kind, event, raw record) of every decodable record of `topic` that exists when
    called, partition by partition in offset order (`since_ms`: see raw_to_end). Undecodable
    records are skipped (their consumers send them to the DLQ). Raises what aiokafka raises
    when Kafka is unreachable."""
    async for record in raw_to_end(kafka, topic, client_id=client_id, since_ms=since_ms):
        try:
            envelope = events.decode(topic, record.value)
        except events.DecodeError:
            continue
        _, kind, event = events.unwrap(envelope)
        yield kind, event, record


async def read_keys(kafka: KafkaSettings, topic: str, *, client_id: str) -> set[str]:
    """The record keys of `topic` as it is when called (values are not decoded)."""
    return {
        record.key.decode()
        async for record in raw_to_end(kafka, topic, client_id=client_id)
        if record.key
    }
