"""`harnessrl sample-builder`: calls, episodes and rewards in, one GroupSamples per group out.

The three input topics are keyed by group id and consumed co-partitioned, so one instance
sees everything about a group. Every record of an open group is held (its offset not
committed) until the group's samples are acknowledged, or the group is dropped: a restart
re-delivers exactly the groups still open, and the join state is rebuilt from them. Groups
already emitted are read from hrl.samples' keys at start, so late or re-delivered events of
a finished group are ignored rather than built twice.

Production sessions (`s.<app>.<session>` groups, with `production.apps` configured) wait for
their reward far longer than a group_timeout_s, so they take another path: their events are
parked in the session store on disk and their records released once it committed them
(session_groups.py). Deleted sessions (SessionDeleted on hrl.policy) are followed by a
consumer group of this instance's own, since each instance purges its own store; a deletion's
record is committed once the purge is.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from contextlib import AsyncExitStack
from typing import Any

from opentelemetry import context as otel_context

from harnessrl import events
from harnessrl.bus import Context, Hold
from harnessrl.bus.snapshot import read_keys, read_to_end
from harnessrl.logs import get_logger
from harnessrl.retry import PermanentError
from harnessrl.runtime import Runtime
from harnessrl.service_bus import ServiceBus, Subscription
from harnessrl.services.sample_builder.config import SampleBuilderConfig
from harnessrl.services.sample_builder.metrics import SampleMetrics
from harnessrl.services.sample_builder.session_groups import SessionGroups, call_links, is_session
from harnessrl.services.sample_builder.session_store import SessionStore
from harnessrl.trust.group import Group
from harnessrl.trust.samples import Built, Decode, build, published
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

GROUP_EVENTS = (
    pb.ModelCall,
    pb.EpisodeClosed,
    pb.EpisodeStarted,
    pb.EpisodeFinished,
    pb.RewardAssigned,
)
"""What a group is built from, on hrl.calls, hrl.episodes and hrl.rewards."""
GROUP = "harnessrl.sample-builder"


class SampleBuilderService:
    def __init__(self, config: SampleBuilderConfig, runtime: Runtime) -> None:
        self._config = config
        self._settings = config.sample_builder
        self._runtime = runtime
        self._groups: dict[str, Group] = {}
        self._holds: dict[str, list[Hold]] = {}
        self._partition: dict[str, int] = {}
        self._done: set[str] = set()
        self._decode: Decode | None = None
        self._sessions: SessionGroups | None = None
        self._bus = ServiceBus(config, runtime)
        self._stopping = asyncio.Event()
        self._tracer = runtime.tracer
        self.metrics = SampleMetrics(runtime.registry)
        self.ready = asyncio.Event()

    async def run(self) -> None:
        config, runtime = self._config, self._runtime
        subscription = Subscription(
            GROUP,
            dict.fromkeys(GROUP_EVENTS, self._on_event),
            on_revoked=self._revoked,
            co_partitioned=True,
        )
        async with AsyncExitStack() as stack:
            # Closed after the producer flushed: its last acknowledgements settle sessions.
            stack.push_async_callback(self._close_sessions)
            topics = [*subscription.topics, events.SAMPLES]
            if config.production.apps:
                topics.append(events.POLICY)
            await self._bus.start(stack, topics=topics)
            self._done = await read_keys(
                config.kafka, events.SAMPLES, client_id=f"{runtime.producer_name}/rebuild"
            )
            if self._settings.tokenizer is not None:
                self._decode = await asyncio.to_thread(decoder, str(self._settings.tokenizer))
            if config.production.apps:
                self._sessions = SessionGroups(
                    await asyncio.to_thread(SessionStore, config.production.store),
                    settings=self._settings,
                    production=config.production,
                    publish=self._bus.producer.publish,
                    metrics=self.metrics,
                    tracer=self._tracer,
                    decode=self._decode,
                )
                await self._sessions.start(deleted=self._deleted_sessions)
                deletions = {pb.SessionDeleted: self._on_deleted}
                self._bus.consume(stack, Subscription(f"{GROUP}.{config.instance}", deletions))
            self._bus.consume(stack, subscription)
            sweeper = asyncio.create_task(self._sweep(), name="group timeouts")
            stack.callback(sweeper.cancel)
            self.metrics.open_groups.set_function(lambda: len(self._groups))
            log.info(
                "sample builder running",
                estimator=self._settings.estimator,
                groups_done=len(self._done),
                classify_retokenization=self._decode is not None,
                sessions=str(config.production.store) if self._sessions else None,
            )
            self.ready.set()
            await self._stopping.wait()

    async def stop(self) -> None:
        self._stopping.set()

    async def _close_sessions(self) -> None:
        if self._sessions is not None:
            await self._sessions.close()

    def health(self) -> dict[str, bool]:
        health = {"producer": self._bus.healthy}
        if self._sessions is not None:
            health["session_store"] = self._sessions.healthy
        return health

    async def _on_event(self, event: Any, ctx: Context) -> None:
        """Any of GROUP_EVENTS: added to its group, its record held until the group is."""
        kind = events.kind_of(event)
        _check(kind, event)
        group_id: str = event.group_id
        if group_id in self._done:
            return  # late or re-delivered: the group is built already
        if self._sessions is not None and is_session(group_id):
            await self._sessions.add(kind, event, ctx.hold())  # released once parked on disk
            return
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = Group(group_id, time.monotonic())
            self._holds[group_id] = []
            self._partition[group_id] = ctx.partition
        group.add(kind, event)
        self._holds[group_id].append(ctx.hold())
        if group.ready:
            self._emit(group_id, timed_out=False)

    async def _deleted_sessions(self) -> set[str]:
        """Group ids of every SessionDeleted on hrl.policy so far."""
        return {
            event.group_id
            async for _, event, _ in read_to_end(
                self._config.kafka,
                events.POLICY,
                client_id=f"{self._runtime.producer_name}/deleted",
            )
            if isinstance(event, pb.SessionDeleted)
        }

    async def _on_deleted(self, event: pb.SessionDeleted, ctx: Context) -> None:
        """An app deleted a production session: purged from the store before the record
        is committed."""
        assert self._sessions is not None  # consumed only with sessions
        await self._sessions.delete(event)

    def _emit(self, group_id: str, *, timed_out: bool) -> None:
        """Build the group, publish its samples, release its records once acknowledged."""
        group = self._groups.pop(group_id)
        holds = self._holds.pop(group_id)
        self._partition.pop(group_id, None)
        self._done.add(group_id)
        started = time.perf_counter()
        with self._tracer.start_as_current_span(
            "samples.group", context=otel_context.Context(), links=call_links(group)
        ) as span:
            built = build(group, self._settings, self._decode)
            span.set_attribute("harnessrl.group_id", group_id)
            span.set_attribute("harnessrl.samples.outcome", built.dropped or "emitted")
            # A group that trains nothing (val, zero variance, ...) is published without
            # samples, so that its token books reach hrl.samples too.
            record = published(built, group_id, group.task_id, self._settings.estimator)
            ids = span.get_span_context()
            record.span_id = f"{ids.span_id:016x}"
            record.trace_id = f"{ids.trace_id:032x}"
        self.metrics.observe(built, group.mode, timed_out, time.perf_counter() - started)
        log.info(
            "group built",
            group_id=group_id,
            outcome=built.dropped or "emitted",
            timed_out=timed_out,
            samples=len(built.samples.samples) if built.samples else 0,
            episodes_dropped=[f"{d.episode_id}:{d.reason}" for d in built.episodes_dropped],
            tokens_captured=built.books.captured,
            tokens_trained=built.books.trained,
            tokens_dropped=dict(built.books.dropped),
        )
        delivery = self._bus.producer.publish(record)
        delivery.add_done_callback(lambda f: self._published(f, group_id, holds, built))

    def _published(
        self, delivery: asyncio.Future[Any], group_id: str, holds: list[Hold], built: Built
    ) -> None:
        if delivery.cancelled():
            return  # shutting down: left uncommitted, built again after the restart
        error = delivery.exception()
        if error is not None:
            # Refused for good (e.g. larger than the broker takes): counted, and let go so
            # the partition moves on.
            self.metrics.groups("publish_refused").inc()
            log.error("group samples refused", group_id=group_id, error=repr(error))
        _release(holds)

    async def _sweep(self) -> None:
        settings = self._settings
        while True:
            await asyncio.sleep(settings.sweep_interval_s)
            if self._sessions is not None:
                try:
                    await self._sessions.sweep()
                except Exception as err:  # a loop boundary: tried again at the next tick
                    log.error("session sweep failed", error=repr(err))
            now = time.monotonic()
            for group_id, group in list(self._groups.items()):
                if now - group.first_seen > settings.group_timeout_s:
                    log.warning(
                        "group timed out", group_id=group_id, waiting_for=list(group.missing())
                    )
                    self._emit(group_id, timed_out=True)

    async def _revoked(self, partitions: list[tuple[str, int]]) -> None:
        # Another instance owns these groups now; it rebuilds them from the held records.
        lost = {p for _, p in partitions}
        for group_id in [g for g, p in self._partition.items() if p in lost]:
            self._groups.pop(group_id, None)
            self._holds.pop(group_id, None)
            self._partition.pop(group_id, None)


def _check(kind: str, event: Any) -> None:
    """Refuse (to hrl.dlq) what a group cannot be built from: an event without group, a
    reward that is not a finite number (advantages are computed from it)."""
    name = type(event).__name__
    if not event.group_id:
        raise PermanentError(f"{name}.group_id: required")
    if kind == "reward_assigned" and not event.missing and not math.isfinite(event.value):
        raise PermanentError(f"{name}.value: {event.value} is not a finite number")


def _release(holds: list[Hold]) -> None:
    for hold in holds:
        hold.release()


def decoder(path: str) -> Decode:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    return decode
