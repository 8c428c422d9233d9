"""The bus producer: publish never fails because the broker is slow or away.

A published record waits in memory (up to `buffer_max_bytes`), then in the on-disk spill log,
until a single pump task hands it to aiokafka, keeping at most `in_flight_max_bytes`
unacknowledged. Retryable failures put the record back at the head of the line after a
backoff, and nothing newer is sent meanwhile, so records leave in the order they were
published (per key, the order consumers see). Each publish returns a future that resolves
with the broker's acknowledgement: consumers commit their input offsets only after the
futures of its outputs resolve.

Guarantees: at least once, in publish order per key. A record can be sent twice after a
timeout whose write did land, or after a crash between the broker's acknowledgement and the
spill watermark being persisted; event ids make duplicates harmless. On `stop()` with the
broker away, unsent records go to the spill log and the next run sends them. Records in
memory are lost only if the process is killed; with `wal` set every record goes through the
spill log first, so not even that loses one.
"""

from __future__ import annotations

import asyncio
import heapq
import re
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from google.protobuf.message import Message

from harnessrl import events
from harnessrl.bus.kafka import client_kwargs, start_client
from harnessrl.bus.metrics import BusMetrics
from harnessrl.bus.spill import Headers, Position, SpilledRecord, SpillLog
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, is_retryable
from harnessrl.telemetry import inject_headers

log = get_logger(__name__)


class ProducerClosedError(RuntimeError):
    """The producer is stopped (or its pump failed) and accepts no more records."""


@dataclass(frozen=True, slots=True)
class Ack:
    """Where the broker stored a record."""

    topic: str
    partition: int
    offset: int


@dataclass(slots=True, order=True)
class _Pending:
    seq: int
    topic: str = field(compare=False)
    key: bytes | None = field(compare=False)
    value: bytes = field(compare=False)
    headers: Headers = field(compare=False)
    delivery: asyncio.Future[Ack] | None = field(compare=False)
    spill_pos: Position | None = field(compare=False, default=None)
    size: int = field(compare=False, default=0)

    def __post_init__(self) -> None:
        self.size = (
            len(self.value) + len(self.key or b"") + sum(len(k) + len(v) for k, v in self.headers)
        )


class Producer:
    """Publishes events and raw records; see the module docstring for the guarantees.

    `name` ("<service>/<instance>") is written into EventMeta.producer and names the spill
    directory. Use from one event loop. `start()` does not need the broker; `stop()` is
    idempotent.
    """

    def __init__(
        self,
        kafka: KafkaSettings,
        settings: ProducerSettings,
        *,
        name: str,
        metrics: BusMetrics | None = None,
    ) -> None:
        self.name = name
        self._kafka = kafka
        self._settings = settings
        self._metrics = metrics or BusMetrics()
        self._spill = SpillLog(
            settings.spill_dir / re.sub(r"[^A-Za-z0-9_.-]", "_", name), fsync=settings.spill_fsync
        )
        self._backoff = Backoff(
            settings.retry_backoff_ms / 1000, settings.retry_backoff_max_ms / 1000
        )
        self._memory: deque[_Pending] = deque()
        self._buffered = 0
        self._spill_futures: deque[asyncio.Future[Ack]] = deque()
        self._retry: list[_Pending] = []
        self._retry_at = 0.0
        self._failures = 0  # consecutive failed acknowledgements: the backoff exponent
        self._in_flight: dict[int, _Pending] = {}
        self._in_flight_bytes = 0
        self._seq = 0
        self._wake = asyncio.Event()
        self._window = asyncio.Event()
        self._idle = asyncio.Event()
        self._client: Any = None
        self._pump_task: asyncio.Task[None] | None = None
        self._accepting = False
        self._stopped = False
        self._metrics.track_producer(
            lambda: self._buffered, lambda: self._in_flight_bytes, lambda: self._spill.unread_bytes
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the spill log (replaying what an earlier run left) and start sending."""
        self._spill.open()
        self._accepting = True
        self._pump_task = asyncio.create_task(self._pump(), name=f"producer-pump:{self.name}")
        self._pump_task.add_done_callback(self._pump_done)

    async def stop(self, timeout: float = 10.0) -> None:
        """Flush for up to `timeout` seconds, spill what is left, close. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._accepting = False
        if not await self.flush(timeout):
            log.warning(
                "producer stopping with records unsent; they stay in the spill log",
                producer=self.name,
                buffered_bytes=self._buffered,
                in_flight=len(self._in_flight),
                spilled_bytes=self._spill.unread_bytes,
            )
        if self._pump_task is not None:
            self._pump_task.cancel()
            await asyncio.gather(self._pump_task, return_exceptions=True)
        if self._client is not None:
            try:  # sends what aiokafka already holds, if the broker is there
                await asyncio.wait_for(self._client.stop(), timeout=2.0)
            except Exception as err:  # the broker may be away: leftovers are spilled below
                log.warning("kafka producer did not close cleanly", error=repr(err))
        self._spill_leftovers()
        self._spill.close()

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record published so far is acknowledged (or refused).

        Returns False if `timeout` seconds pass first.
        """
        try:
            async with asyncio.timeout(timeout):
                while not self._check_idle():
                    self._idle.clear()
                    await self._idle.wait()
        except TimeoutError:
            return False
        return True

    @property
    def healthy(self) -> bool:
        """False once the pump has died; the service should then restart."""
        return self._pump_task is not None and not self._pump_task.done()

    # -- publishing --------------------------------------------------------------------------

    def publish(
        self,
        event: Message,
        *,
        key: str | None = None,
        event_id: str | None = None,
        headers: Headers | None = None,
    ) -> asyncio.Future[Ack]:
        """Publish an event on its topic, keyed by its group id, with the current trace context.

        Returns immediately; the future resolves when the broker acknowledges the record, or
        fails if the broker refuses it for good (e.g. too large). Raises TypeError for a
        non-event, ValueError for an event without a key, ProducerClosedError after stop().
        """
        value = events.encode(event, producer=self.name, event_id_=event_id)
        record_headers = inject_headers(list(headers or ()))
        return self.publish_raw(
            events.topic_of(event), (key or events.event_key(event)).encode(), value, record_headers
        )

    def roll_spill(self) -> None:
        """Start a fresh spill segment: the records written so far are deleted from disk as
        soon as they are acknowledged (see SpillLog.roll)."""
        self._spill.roll()

    def publish_raw(
        self, topic: str, key: bytes | None, value: bytes, headers: Headers | None = None
    ) -> asyncio.Future[Ack]:
        """Publish bytes as they are (dead letters, benchmarks). Same contract as publish()."""
        if not self._accepting:
            raise ProducerClosedError(f"producer {self.name} is not running")
        pending = _Pending(0, topic, key, value, list(headers or ()), None)
        if pending.size > self._kafka.max_request_bytes:
            raise ValueError(
                f"{topic}: record of {pending.size} bytes exceeds kafka.max_request_bytes "
                f"({self._kafka.max_request_bytes})"
            )
        delivery: asyncio.Future[Ack] = asyncio.get_running_loop().create_future()
        pending.delivery = delivery
        if (
            self._settings.wal
            or self._spill.has_unread
            or self._buffered + pending.size > self._settings.buffer_max_bytes
        ):
            self._spill.append(SpilledRecord(topic, key, value, pending.headers))
            self._spill_futures.append(delivery)
            self._metrics.spilled.inc()
        else:
            self._memory.append(pending)
            self._buffered += pending.size
        self._idle.clear()
        self._wake.set()
        return delivery

    # -- the pump ----------------------------------------------------------------------------

    async def _pump(self) -> None:
        await self._connect()
        delays = self._backoff.delays()
        while True:
            record = await self._next()
            while True:
                if self._client is None:
                    await self._connect()
                await self._reserve(record.size)
                self._in_flight[record.seq] = record
                try:
                    future = await self._client.send(
                        record.topic, record.value, key=record.key, headers=record.headers
                    )
                except Exception as err:
                    self._release(record)
                    if not is_retryable(err):
                        self._refuse(record, err)
                        break
                    self._metrics.publish_retries(record.topic).inc()
                    await asyncio.sleep(next(delays))
                    continue
                delays = self._backoff.delays()
                future.add_done_callback(partial(self._on_sent, record))
                break

    async def _next(self) -> _Pending:
        while True:
            if self._retry:
                wait = self._retry_at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue
                return heapq.heappop(self._retry)
            if self._memory:
                record = self._memory.popleft()
                self._buffered -= record.size
            elif self._spill.has_unread:
                position, spilled = self._spill.read()
                delivery = (
                    self._spill_futures.popleft() if position > self._spill.replay_end else None
                )
                record = _Pending(
                    0,
                    spilled.topic,
                    spilled.key,
                    spilled.value,
                    spilled.headers,
                    delivery,
                    position,
                )
            else:
                self._check_idle()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._seq += 1
            record.seq = self._seq
            return record

    async def _connect(self) -> None:
        from aiokafka import AIOKafkaProducer

        self._client = await start_client(
            lambda: AIOKafkaProducer(
                **client_kwargs(self._kafka, self.name),
                acks="all",
                enable_idempotence=False,  # Tansu has no idempotent producers; ids dedupe
                linger_ms=self._kafka.linger_ms,
                max_batch_size=self._kafka.max_batch_bytes,
                max_request_size=self._kafka.max_request_bytes,
            ),
            self._backoff,
            who=self.name,
            waiting="buffering",
        )
        log.info("producer connected", producer=self.name, bootstrap=self._kafka.bootstrap_servers)

    async def _reserve(self, size: int) -> None:
        while self._in_flight and self._in_flight_bytes + size > self._settings.in_flight_max_bytes:
            self._window.clear()
            await self._window.wait()
        self._in_flight_bytes += size

    def _release(self, record: _Pending) -> None:
        self._in_flight.pop(record.seq, None)
        self._in_flight_bytes -= record.size
        self._window.set()

    def _on_sent(self, record: _Pending, future: asyncio.Future[Any]) -> None:
        self._release(record)
        err = BaseException("cancelled") if future.cancelled() else future.exception()
        if err is None:
            meta = future.result()
            self._failures = 0
            self._settle(record)
            if record.delivery is not None and not record.delivery.done():
                record.delivery.set_result(Ack(record.topic, meta.partition, meta.offset))
            self._metrics.published(record.topic).inc()
        elif future.cancelled() or is_retryable(err):
            self._metrics.publish_retries(record.topic).inc()
            heapq.heappush(self._retry, record)
            delay = min(self._backoff.max_s, self._backoff.first_s * 2**self._failures)
            self._failures = min(self._failures + 1, 16)
            self._retry_at = max(self._retry_at, time.monotonic() + delay)
            self._wake.set()
        else:
            self._refuse(record, err)
        self._check_idle()

    def _refuse(self, record: _Pending, err: BaseException) -> None:
        log.error("broker refused record", topic=record.topic, error=repr(err))
        self._metrics.publish_rejected(record.topic).inc()
        self._settle(record)
        if record.delivery is not None and not record.delivery.done():
            record.delivery.set_exception(err)

    def _settle(self, record: _Pending) -> None:
        if record.spill_pos is not None:
            self._spill.ack(record.spill_pos)

    def _check_idle(self) -> bool:
        idle = not (self._memory or self._retry or self._in_flight or self._spill.has_unread)
        if idle:
            self._idle.set()
        return idle

    def _pump_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._accepting = False
            log.error(
                "producer pump failed; producer closed",
                producer=self.name,
                error=repr(task.exception()),
            )

    def _spill_leftovers(self) -> None:
        """At stop: keep unacknowledged records for the next run (the spill log replays)."""
        leftovers = sorted([*self._retry, *self._in_flight.values()]) + list(self._memory)
        closed = ProducerClosedError(f"producer {self.name} stopped; record kept in spill log")
        for record in leftovers:
            if record.spill_pos is None:  # spilled records are replayed from the watermark
                self._spill.append(
                    SpilledRecord(record.topic, record.key, record.value, record.headers)
                )
            if record.delivery is not None and not record.delivery.done():
                record.delivery.set_exception(closed)
        for delivery in self._spill_futures:
            if not delivery.done():
                delivery.set_exception(closed)
        self._memory.clear()
        self._retry.clear()
        self._in_flight.clear()
