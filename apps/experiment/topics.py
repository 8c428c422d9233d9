"""A client of a running stack's topics: a producer for tasks, and a follower that feeds
every event an experiment (or a chaos run) measures into a `RunLedger`."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from harnessrl.apps.experiment.ledger import KINDS, RunLedger


@contextlib.asynccontextmanager
async def task_bus(bootstrap: str, ledger: RunLedger) -> AsyncIterator[tuple[Any, asyncio.Event]]:
    """A producer for tasks, and a follower feeding every relevant event to `ledger`."""
    from harnessrl.bus import Producer
    from harnessrl.config import KafkaSettings, ProducerSettings

    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    changed = asyncio.Event()
    with tempfile.TemporaryDirectory(prefix="harnessrl-experiment-") as spill:
        producer = Producer(
            kafka, ProducerSettings(spill_dir=Path(spill), wal=False), name="experiment/0"
        )
        await producer.start()
        follower = asyncio.create_task(_follow(kafka, ledger, changed), name="follow topics")

        async def publish(event: Any) -> None:
            await producer.publish(event)

        try:
            yield publish, changed
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await producer.stop(timeout=5.0)


async def _follow(kafka: Any, ledger: RunLedger, changed: asyncio.Event) -> None:
    from aiokafka import AIOKafkaConsumer

    from harnessrl import events
    from harnessrl.bus import client_kwargs

    topics = [events.EPISODES, events.CALLS, events.REWARDS, events.SAMPLES, events.POLICY]
    consumer = AIOKafkaConsumer(
        **client_kwargs(kafka, "harnessrl-experiment"),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        consumer.subscribe(topics)
        while True:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    _apply(ledger, record, events)
            if batch:
                changed.set()
    finally:
        await consumer.stop()


def _apply(ledger: RunLedger, record: Any, events: Any) -> None:
    try:
        meta, kind, event = events.unwrap(events.decode(record.topic, record.value))
    except events.DecodeError:
        return  # the services dead-letter what they cannot read; nothing to measure here
    if kind in KINDS:
        ledger.apply(kind, event, meta.created_at.ToMicroseconds() / 1e6 or time.time())
