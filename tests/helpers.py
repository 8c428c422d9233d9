"""Helpers for tests: waiting for a condition, messages with every field set."""

from __future__ import annotations

import asyncio
import os
import random
import string
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

FULL = os.environ.get("HARNESSRL_TEST_FULL", "") not in ("", "0")
"""`make test-full`: the long versions of the heaviest suites (more fuzzed requests, a longer
chaos run); `make test` runs the short ones."""

FAST_GROUP = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 500}
"""Consumer settings that make group joins on Tansu take ~1 s instead of ~5 s."""


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], timeout: float = 30.0, interval: float = 0.05
) -> None:
    """Wait until `check()` is true; fail the test with its name after `timeout` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"condition {getattr(check, '__name__', check)} not met in {timeout}s")
        await asyncio.sleep(interval)


def filled(cls: type[Message], seed: int = 0) -> Message:
    """An instance of `cls` with every field set to a non-default value (recursively)."""
    rng = random.Random(seed)
    message = cls()
    for field in cls.DESCRIPTOR.fields:
        _fill(message, field, rng)
    return message


def _scalar(field: FieldDescriptor, rng: random.Random) -> Any:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return field.name + "-" + "".join(rng.choices(string.ascii_lowercase, k=6))
    if t == FieldDescriptor.TYPE_BYTES:
        return bytes(rng.randrange(256) for _ in range(8))
    if t == FieldDescriptor.TYPE_BOOL:
        return True
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return rng.choice([0.5, -1.25, 3.0])
    if t == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT32):
        return -rng.randrange(1, 1000)
    return rng.randrange(1, 200_000)


def _fill(message: Message, field: FieldDescriptor, rng: random.Random) -> None:
    name = field.name
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        getattr(message, name).update({f"k{i}": _scalar(value_field, rng) for i in range(3)})
    elif field.message_type is not None:
        if field.is_repeated:
            for _ in range(2):
                child = getattr(message, name).add()
                for sub in field.message_type.fields:
                    _fill(child, sub, rng)
        elif field.message_type.full_name == "google.protobuf.Timestamp":
            getattr(message, name).FromNanoseconds(1_790_000_000_123_456_789)
        else:
            child = getattr(message, name)
            for sub in field.message_type.fields:
                _fill(child, sub, rng)
    elif field.is_repeated:
        getattr(message, name).extend(_scalar(field, rng) for _ in range(5))
    else:
        setattr(message, name, _scalar(field, rng))


async def read_topic(bootstrap: str, topic: str, count: int, timeout: float = 30.0) -> list[Any]:
    """The first `count` records of `topic` (all partitions, from the beginning), raw.

    Fails the test if fewer arrive within `timeout` seconds.
    """
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=None,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    records: list[Any] = []
    try:
        async with asyncio.timeout(timeout):
            while len(records) < count:
                batch = await consumer.getmany(timeout_ms=200)
                for part in batch.values():
                    records.extend(part)
    except TimeoutError:
        pytest.fail(f"{topic}: {len(records)} of {count} records within {timeout}s")
    finally:
        await consumer.stop()
    return records


async def topic_size(bootstrap: str, topic: str) -> int:
    """Number of records on `topic` (sum of its partitions' end offsets, as fetches report
    them: see harnessrl.bus.snapshot.end_offsets)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from harnessrl.bus.snapshot import end_offsets

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        await consumer.topics()
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        return sum((await end_offsets(consumer, tps)).values()) if tps else 0
    finally:
        await consumer.stop()


async def events_on(bootstrap: str, topic: str) -> list[tuple[str, Any]]:
    """(kind, event) of every record now on `topic`, in partition order."""
    from harnessrl import events

    size = await topic_size(bootstrap, topic)
    records = await read_topic(bootstrap, topic, size) if size else []
    out = []
    for record in records:
        envelope = events.decode(topic, record.value)
        kind = envelope.WhichOneof("event")
        out.append((kind, getattr(envelope, kind)))
    return out


async def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """Committed offset per partition of `topic` for `group` (0 where none)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        await consumer.topics()
        partitions = sorted(consumer.partitions_for_topic(topic) or ())
        return {p: (await consumer.committed(TopicPartition(topic, p))) or 0 for p in partitions}
    finally:
        await consumer.stop()
