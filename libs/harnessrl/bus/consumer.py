"""The bus consumer: decode, trace, handle, publish outputs, then commit.

For each polled batch, partitions are processed concurrently and each partition's records in
order. A record's handler runs inside a CONSUMER span whose parent is the trace context from
the record's headers. Outputs published through the handler's `Context` are awaited before
the record counts as finished, and offsets are committed only up to the first unfinished
record, so a crash at any point re-delivers exactly the records whose effects may be missing.

Records that cannot be decoded, whose handler fails with a non-retryable error (or keeps
failing with retryable ones), or whose outputs the broker refuses go to hrl.dlq with the
original key, value and headers plus `dlq.*` headers that say why; the consumer goes on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from harnessrl import events
from harnessrl.bus.kafka import client_kwargs, start_client
from harnessrl.bus.metrics import BusMetrics
from harnessrl.bus.offsets import TP, OffsetTracker
from harnessrl.bus.producer import Ack, Producer
from harnessrl.config import ConsumerSettings, KafkaSettings
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, is_retryable
from harnessrl.telemetry import extract_context
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Record:
    """A decoded record, as a handler sees it."""

    topic: str
    partition: int
    offset: int
    key: str | None
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...]
    meta: pb.EventMeta
    kind: str  # name of the envelope's oneof field, e.g. "model_call"
    event: Message


class Hold:
    """Keeps a record's offset uncommitted until `release()` (idempotent)."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release: Callable[[], None] | None = release

    def release(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None


class Context:
    """What a handler may do while processing one record."""

    def __init__(self, producer: Producer, tracker: OffsetTracker, tp: TP, offset: int) -> None:
        self._producer = producer
        self._tracker = tracker
        self._tp = tp
        self._offset = offset
        self.deliveries: list[asyncio.Future[Ack]] = []
        self.held = False

    @property
    def partition(self) -> int:
        """The partition of the record being processed."""
        return self._tp[1]

    def publish(self, event: Message, **kwargs: Any) -> asyncio.Future[Ack]:
        """Publish an output; the input record is finished only once it is acknowledged."""
        delivery = self._producer.publish(event, **kwargs)
        self.deliveries.append(delivery)
        return delivery

    def hold(self) -> Hold:
        """Keep this record's offset uncommitted until the returned hold is released (for
        state that is rebuilt from the topic after a restart)."""
        self.held = True
        epoch = self._tracker.epoch(self._tp)
        return Hold(lambda: self._tracker.finish(self._tp, self._offset, epoch))


Handler = Callable[[Record, Context], Awaitable[None]]
PartitionHook = Callable[[list[TP]], Awaitable[None]]


class Consumer:
    """Consumes `topics` as member of `group_id`, handing each record to `handler`.

    `run()` returns after `stop()`; `stop()` is idempotent: polling stops, the batch in hand
    finishes, offsets are committed, the Kafka client closes. The producer is the caller's;
    it carries outputs and dead letters and is flushed by its owner after the consumer stops.
    `co_partitioned=True` assigns partition p of every topic to the same member (the topics
    must have equal partition counts).
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        settings: ConsumerSettings,
        *,
        topics: Iterable[str],
        group_id: str,
        handler: Handler,
        producer: Producer,
        metrics: BusMetrics | None = None,
        tracer: trace.Tracer | None = None,
        on_assigned: PartitionHook | None = None,
        on_revoked: PartitionHook | None = None,
        co_partitioned: bool = False,
    ) -> None:
        self.topics = list(topics)
        self._co_partitioned = co_partitioned
        self.group_id = group_id
        self._kafka = kafka
        self._settings = settings
        self._handler = handler
        self._producer = producer
        self._metrics = metrics or BusMetrics()
        self._tracer = tracer or trace.get_tracer("harnessrl.bus")
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._tracker = OffsetTracker()
        self._backoff = Backoff(settings.retry_backoff_ms / 1000, 30.0)
        self._stopping = asyncio.Event()
        self._client: Any = None
        self.assigned: set[TP] = set()

    async def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """Consume until stop(). Raises only for non-retryable client errors."""
        self._client = await self._start_client()
        if self._client is None:
            return
        try:
            while not self._stopping.is_set():
                batch = await self._client.getmany(
                    timeout_ms=self._settings.poll_timeout_ms,
                    max_records=self._settings.max_poll_records,
                )
                if batch:
                    await self._process(batch)
                await self._commit()
        finally:
            await self._commit()
            await self._client.stop()
            self._client = None

    # -- processing --------------------------------------------------------------------------

    async def _process(self, batch: dict[Any, list[Any]]) -> None:
        done: list[tuple[Any, Context]] = []
        await asyncio.gather(
            *(self._process_partition(records, done) for records in batch.values())
        )
        for raw, ctx in done:
            if ctx.deliveries:
                results = await asyncio.gather(*ctx.deliveries, return_exceptions=True)
                refused = [r for r in results if isinstance(r, BaseException)]
                if refused:
                    await self._dead_letter(raw, "output", f"output refused: {refused[0]!r}")
                    self._tracker.finish((raw.topic, raw.partition), raw.offset)
                    continue
            if not ctx.held:
                self._tracker.finish((raw.topic, raw.partition), raw.offset)

    async def _process_partition(self, records: list[Any], done: list[tuple[Any, Context]]) -> None:
        for raw in records:
            tp = (raw.topic, raw.partition)
            self._tracker.begin(tp, raw.offset)
            ctx = Context(self._producer, self._tracker, tp, raw.offset)
            started = time.perf_counter()
            await self._handle(raw, ctx)
            self._metrics.handler_seconds(raw.topic).observe(time.perf_counter() - started)
            self._metrics.consumed(raw.topic).inc()
            done.append((raw, ctx))

    async def _handle(self, raw: Any, ctx: Context) -> None:
        try:
            envelope = events.decode(raw.topic, raw.value)
        except events.DecodeError as err:
            await self._dead_letter(raw, "decode", str(err))
            return
        meta, kind, event = events.unwrap(envelope)
        key = raw.key.decode("utf-8", "replace") if raw.key is not None else None
        headers = tuple(raw.headers or ())
        record = Record(
            raw.topic, raw.partition, raw.offset, key, raw.timestamp, headers, meta, kind, event
        )
        # start_span + attach/detach rather than start_as_current_span: the generator-based
        # context managers cost more than the rest of this path together.
        span = self._tracer.start_span(
            f"{raw.topic} process", context=extract_context(headers), kind=SpanKind.CONSUMER
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            if span.is_recording():
                span.set_attributes(
                    {
                        "messaging.system": "kafka",
                        "messaging.operation.type": "process",
                        "messaging.destination.name": raw.topic,
                        "messaging.destination.partition.id": str(raw.partition),
                        "messaging.kafka.offset": raw.offset,
                        "messaging.consumer.group.name": self.group_id,
                        "messaging.message.id": meta.event_id,
                        "harnessrl.event": kind,
                    }
                )
            try:
                await self._handler(record, ctx)
            except Exception as err:
                await self._retry_or_dead_letter(raw, record, ctx, span, err)
        finally:
            otel_context.detach(token)
            span.end()

    async def _retry_or_dead_letter(
        self, raw: Any, record: Record, ctx: Context, span: trace.Span, err: Exception
    ) -> None:
        delays = self._backoff.delays()
        attempt = 1
        while is_retryable(err) and attempt < self._settings.handler_max_attempts:
            self._metrics.handler_retries(raw.topic).inc()
            log.warning(
                "handler failed; retrying",
                topic=raw.topic,
                offset=raw.offset,
                attempt=attempt,
                error=repr(err),
            )
            await asyncio.sleep(next(delays))
            attempt += 1
            try:
                await self._handler(record, ctx)
                return
            except Exception as again:
                err = again
        span.record_exception(err)
        span.set_status(Status(StatusCode.ERROR, type(err).__name__))
        reason = f"{type(err).__name__}: {err}"
        if is_retryable(err):
            reason = f"retries exhausted after {attempt} attempts: {reason}"
        await self._dead_letter(raw, "handler", reason)

    async def _dead_letter(self, raw: Any, stage: str, reason: str) -> None:
        log.warning(
            "record sent to dead-letter topic",
            topic=raw.topic,
            partition=raw.partition,
            offset=raw.offset,
            stage=stage,
            reason=reason,
        )
        headers = [
            *(raw.headers or ()),
            ("dlq.reason", reason.encode()),
            ("dlq.stage", stage.encode()),
            ("dlq.topic", raw.topic.encode()),
            ("dlq.partition", str(raw.partition).encode()),
            ("dlq.offset", str(raw.offset).encode()),
            ("dlq.group", self.group_id.encode()),
        ]
        self._metrics.dead_lettered(raw.topic, stage).inc()
        await self._producer.publish_raw(events.DLQ, raw.key, raw.value or b"", headers)

    # -- group membership and commits --------------------------------------------------------

    async def _start_client(self) -> Any:
        from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener

        consumer = self

        class Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # untyped base
            async def on_partitions_revoked(self, revoked: Any) -> None:
                await consumer._revoked([(tp.topic, tp.partition) for tp in revoked])

            async def on_partitions_assigned(self, assigned: Any) -> None:
                await consumer._assigned([(tp.topic, tp.partition) for tp in assigned])

        def make() -> Any:
            extra: dict[str, Any] = {}
            if self._co_partitioned:
                # Range assignment gives one member partition p of every topic, so records
                # keyed alike on several topics (a group's calls, episodes and rewards) meet.
                from aiokafka.coordinator.assignors.range import RangePartitionAssignor

                extra["partition_assignment_strategy"] = (RangePartitionAssignor,)
            client = AIOKafkaConsumer(
                **extra,
                **client_kwargs(self._kafka, f"{self._producer.name}/{self.group_id}"),
                group_id=self.group_id,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_poll_records=self._settings.max_poll_records,
                fetch_max_wait_ms=self._settings.fetch_max_wait_ms,
                session_timeout_ms=self._settings.session_timeout_ms,
                heartbeat_interval_ms=self._settings.heartbeat_interval_ms,
                max_poll_interval_ms=self._settings.max_poll_interval_ms,
            )
            client.subscribe(self.topics, listener=Listener())
            return client

        starting = asyncio.ensure_future(
            start_client(make, self._backoff, who=self.group_id, waiting="consumer waiting")
        )
        stopped = asyncio.ensure_future(self._stopping.wait())
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not starting.done():  # stop() while the broker was unreachable
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return None
        log.info("consumer started", group=self.group_id, topics=self.topics)
        return starting.result()

    async def _commit(self, tps: Iterable[TP] | None = None) -> None:
        if self._client is None:
            return
        from aiokafka import TopicPartition

        offsets = self._tracker.committable(tps)
        offsets = {tp: o for tp, o in offsets.items() if tp in self.assigned}
        if not offsets:
            return
        try:
            await self._client.commit({TopicPartition(*tp): o for tp, o in offsets.items()})
        except Exception as err:
            # After a rebalance the new owner re-reads from the last commit: duplicates, never
            # loss. A transient failure is retried on the next tick.
            self._metrics.commits("failed").inc()
            log.warning("offset commit failed", group=self.group_id, error=repr(err))
            return
        self._tracker.committed(offsets)
        self._metrics.commits("ok").inc()

    async def _revoked(self, tps: list[TP]) -> None:
        await self._commit(tps)
        self._tracker.forget(tps)
        self.assigned.difference_update(tps)
        if self._on_revoked is not None and tps:
            await self._on_revoked(tps)

    async def _assigned(self, tps: list[TP]) -> None:
        self.assigned.update(tps)
        log.info("partitions assigned", group=self.group_id, partitions=sorted(tps))
        if self._on_assigned is not None and tps:
            await self._on_assigned(tps)
