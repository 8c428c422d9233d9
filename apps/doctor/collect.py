"""Running a harness's episodes through a stack and keeping what it captured.

The doctor is a client of the stack like any other: it submits task groups on hrl.tasks and
reads back, from the topics alone, every event of those groups (episodes started and
finished, model calls, closes, rewards); around the run it reads the gateway's /metrics
(requests by route and status, budgets clamped) and the engine's context length. Nothing
is trained for it: a stack it starts runs without the trainer and the sample builder.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from harnessrl.apps.up.attach import RunningStack
from harnessrl.command import Progress
from harnessrl.logs import get_logger
from harnessrl.tasks import TaskLine

log = get_logger(__name__)

KINDS = frozenset(
    {"episode_started", "episode_finished", "model_call", "episode_closed", "reward_assigned"}
)
"""The events a report is drawn from."""


class DoctorError(RuntimeError):
    """The doctor could not run its episodes; the message says where and why."""


@dataclass(slots=True)
class Collected:
    """What a doctor run captured: every event of its groups, and the stack's figures."""

    mode: str
    groups: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)
    """Group id -> its events as (kind, event), in arrival order."""
    sizes: dict[str, int] = field(default_factory=dict)
    """Group id -> episodes submitted."""
    gateway_before: dict[str, float] = field(default_factory=dict)
    gateway_after: dict[str, float] = field(default_factory=dict)
    """The gateway's counters before and after (sample name{labels} -> value)."""
    context_limit: int | None = None
    started_at: float = 0.0
    finished_at: float = 0.0
    incomplete: list[str] = field(default_factory=list)
    """Groups that had not finished when the run's time was up."""


async def collect(
    stack: RunningStack,
    tasks: list[TaskLine],
    *,
    episodes: int,
    mode: str,
    group_size: int,
    progress: IO[str],
    timeout_s: float,
    context_limit: int | None = None,
) -> Collected:
    """Run at least `episodes` episodes of `tasks` (cycled, one group per task of the task's
    `group_size`, else `group_size`) in `mode` and return what they captured. Stops waiting
    after `timeout_s` (the groups still open are listed in `incomplete`)."""
    from harnessrl.tasks import new_group_id, to_event

    collected = Collected(mode=mode, started_at=time.time())
    gateway = stack.urls["gateway"]
    collected.gateway_before = await _counters(gateway)
    collected.context_limit = context_limit or await _context_limit(stack.urls.get("inference"))
    async with _bus(stack.bootstrap, collected) as (publish, changed, done):
        submitted = 0
        for task in itertools.cycle(tasks):
            if submitted >= episodes:
                break
            size = task.group_size or group_size
            split = {"split": mode, "group_size": size}
            group_id = new_group_id()
            collected.groups[group_id] = []
            collected.sizes[group_id] = size
            await publish(to_event(task.model_copy(update=split), group_id))
            submitted += size
        bar = Progress("doctor episodes", submitted, progress)
        deadline = time.monotonic() + timeout_s
        while (finished := done()) < submitted:
            failure = stack.failure()
            if failure is not None:
                raise DoctorError(failure)
            if time.monotonic() > deadline:
                collected.incomplete = [g for g in collected.groups if not _complete(collected, g)]
                log.warning("doctor: time is up", incomplete=len(collected.incomplete))
                break
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), 1.0)
            bar.update(finished)
        bar.update(done())
        bar.close()
    collected.gateway_after = await _counters(gateway)
    collected.finished_at = time.time()
    return collected


def _complete(collected: Collected, group_id: str) -> bool:
    return _finished(collected, group_id) >= collected.sizes[group_id]


def _finished(collected: Collected, group_id: str) -> int:
    """Episodes of the group whose final attempt is finished, closed and rewarded."""
    final: set[tuple[str, int]] = set()
    closed: set[tuple[str, int]] = set()
    rewarded: set[tuple[str, int]] = set()
    for kind, event in collected.groups[group_id]:
        key = (event.episode_id, event.attempt) if kind != "episode_started" else None
        if kind == "episode_finished" and event.final:
            final.add(key)  # type: ignore[arg-type]
        elif kind == "episode_closed":
            closed.add(key)  # type: ignore[arg-type]
        elif kind == "reward_assigned":
            rewarded.add(key)  # type: ignore[arg-type]
    return len(final & closed & rewarded)


@contextlib.asynccontextmanager
async def _bus(bootstrap: str, collected: Collected) -> AsyncIterator[tuple[Any, Any, Any]]:
    """A producer for tasks and a follower filing the events of the submitted groups; the
    follower starts at the topics' ends, so a running stack's history is never read."""
    from harnessrl.bus import Producer
    from harnessrl.config import KafkaSettings, ProducerSettings

    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    changed = asyncio.Event()
    consumer = await _consumer(kafka)
    follower = asyncio.create_task(_follow(consumer, collected, changed), name="doctor follow")
    counts: dict[str, int] = {}

    def done() -> int:
        for group_id in collected.groups:
            counts[group_id] = _finished(collected, group_id)
        return sum(counts.values())

    with tempfile.TemporaryDirectory(prefix="harnessrl-doctor-") as spill:
        producer = Producer(
            kafka, ProducerSettings(spill_dir=Path(spill), wal=False), name="doctor/0"
        )
        await producer.start()
        try:
            yield producer.publish, changed, done
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await consumer.stop()
            await producer.stop(timeout=5.0)


async def _consumer(kafka: Any) -> Any:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from harnessrl import events
    from harnessrl.bus import client_kwargs

    consumer = AIOKafkaConsumer(
        **client_kwargs(kafka, "harnessrl-doctor"), group_id=None, enable_auto_commit=False
    )
    await consumer.start()
    partitions = [
        TopicPartition(topic, p)
        for topic in (events.EPISODES, events.CALLS, events.REWARDS)
        for p in sorted(consumer.partitions_for_topic(topic) or [])
    ]
    if not partitions:
        await consumer.stop()
        raise DoctorError("the stack's topics do not exist (is its broker the one named?)")
    consumer.assign(partitions)
    await consumer.seek_to_end(*partitions)
    for tp in partitions:  # resolve the end offsets now, before any task is submitted
        await consumer.position(tp)
    return consumer


async def _follow(consumer: Any, collected: Collected, changed: asyncio.Event) -> None:
    from harnessrl import events

    while True:
        batch = await consumer.getmany(timeout_ms=500)
        for records in batch.values():
            for record in records:
                try:
                    _, kind, event = events.unwrap(events.decode(record.topic, record.value))
                except events.DecodeError:
                    continue  # the services dead-letter what they cannot read
                held = collected.groups.get(getattr(event, "group_id", ""))
                if held is not None and kind in KINDS:
                    held.append((kind, event))
        if batch:
            changed.set()


async def _counters(base_url: str) -> dict[str, float]:
    """The gateway's counters and gauges, as {"name{label=value,...}": value}; {} (logged)
    when its /metrics cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = await _get(f"{base_url}/metrics")
    except OSError as err:
        log.warning("doctor: gateway metrics unreadable", url=base_url, error=repr(err))
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return out


async def _context_limit(engine_url: str | None) -> int | None:
    """The engine's context length (`max_model_len` of its /v1/models), None if unknown."""
    if engine_url is None:
        return None
    try:
        data = json.loads(await _get(f"{engine_url}/v1/models"))
        limits = [m.get("max_model_len") for m in data.get("data", [])]
        return next((int(v) for v in limits if isinstance(v, int) and v > 0), None)
    except (OSError, ValueError, AttributeError) as err:
        log.warning("doctor: engine models unreadable", url=engine_url, error=repr(err))
        return None


async def _get(url: str, timeout_s: float = 5.0) -> str:
    """The body of a GET answered 200; OSError when it cannot be had."""
    import httpx

    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url)
            response.raise_for_status()
    except httpx.HTTPError as err:
        raise OSError(f"{url}: {err!r}") from err
    return response.text
