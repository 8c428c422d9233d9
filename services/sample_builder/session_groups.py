"""Production session groups: parked on disk, built exactly once, published from an outbox.

A session's group (`s.<app>.<session>`, one episode) may wait days for its reward, so none
of it is held in memory or by an uncommitted offset: each event is queued with its record's
hold, and a writer parks what is queued in the session store (session_store.py), a batch per
transaction, and releases the batch's records once it committed. When the store's summary
row says the session has everything, its events are reloaded into a Group and built
(trust/session_samples.py). Building advances the baselines, so it happens once: one
transaction stores the GroupSamples bytes, the advanced baselines and state=built; then the
bytes are published, and on acknowledgement the session is `published` and its events
deleted. At start every built-not-published session is published again from its stored
bytes (the same GroupSamples, byte for byte), and sessions left ready by a crash are built.
A session waiting longer than `production.retention_s` after it ended (or began) is dropped
and its events purged; decided sessions are forgotten after the same time.

An app that deletes a session (SessionDeleted on hrl.policy) has its parked events and
unpublished samples purged (`delete`); the tombstone left refuses its later events, and every
completion token of it that is not on its way to the trainer is counted as dropped, `deleted`.
The token books of a built session are counted when its samples are acknowledged, so that a
session deleted before that is counted once, as deleted.

The store is used from one thread of its own, so a commit's fsync never blocks the event
loop; builds are serialised by a lock, so each reads the baselines the previous one left.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, TraceFlags

from harnessrl.bus import Ack, Hold
from harnessrl.logs import get_logger
from harnessrl.production import ProductionSection, parse_session_group, session_traceparent
from harnessrl.retry import Backoff, PermanentError, RetryableError
from harnessrl.services.sample_builder.config import SampleBuilderSection
from harnessrl.services.sample_builder.metrics import SampleMetrics
from harnessrl.services.sample_builder.session_store import SessionStore
from harnessrl.telemetry import extract_context
from harnessrl.trust.group import Group
from harnessrl.trust.samples import Decode, published
from harnessrl.trust.session_baseline import Baselines
from harnessrl.trust.session_samples import ESTIMATOR as SESSION_ESTIMATOR
from harnessrl.trust.session_samples import SessionBuilt, build_session
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

T = TypeVar("T")
Publish = Callable[[pb.GroupSamples], "asyncio.Future[Ack]"]
BATCH = 1000
"""Most events parked in one transaction."""
MAX_QUEUED = 4 * BATCH
"""Most events queued for the writer; `add` waits for room beyond (backpressure)."""


def is_session(group_id: str) -> bool:
    """Whether `group_id` names a production session's group (production.session_group)."""
    return parse_session_group(group_id) is not None


class SessionGroups:
    """The sample builder's production sessions (see the module docstring). `clock` is
    wall-clock seconds (first_seen, ended_at and the retention are measured with it)."""

    def __init__(
        self,
        store: SessionStore,
        *,
        settings: SampleBuilderSection,
        production: ProductionSection,
        publish: Publish,
        metrics: SampleMetrics,
        tracer: trace.Tracer,
        decode: Decode | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._settings = settings
        self._production = production
        self._publish = publish
        self._metrics = metrics
        self._tracer = tracer
        self._decode = decode
        self._clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="session-store")
        self._building = asyncio.Lock()
        self._acks: set[asyncio.Task[None]] = set()
        self._baselines = self._fresh_baselines()
        self._closed = False
        self._queued: list[tuple[str, Message, Hold]] = []
        self._room = asyncio.Semaphore(MAX_QUEUED)
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._failing = False

    @property
    def healthy(self) -> bool:
        """False while the writer's last transaction failed (it is tried again), or when
        the writer ended before close()."""
        writer = self._writer
        return not self._failing and (writer is None or not writer.done() or self._closed)

    async def start(self, deleted: Callable[[], Awaitable[Collection[str]]]) -> None:
        """Load the baselines, publish again what was built but not acknowledged (unless
        `deleted()`, the sessions deleted so far, names it: then it is deleted here), build
        what a crash left ready, start the writer. `deleted` is called only when something
        is to be published again."""
        self._baselines.load(await self._db(self._store.baselines))
        unpublished = await self._db(self._store.unpublished)
        gone = set(await deleted()) if unpublished else set()
        for group_id, data in unpublished:
            if group_id in gone:
                await self._delete(group_id)
            else:
                self._send(group_id, pb.GroupSamples.FromString(data))
        ready = await self._db(self._store.ready_sessions)
        for group_id in ready:
            await self._build(group_id, expired=False)
        await self.refresh()
        self._writer = asyncio.create_task(self._write(), name="session writer")
        log.info("sessions resumed", republished=len(unpublished), built_at_start=len(ready))

    async def close(self) -> None:
        """Park what is queued and wait for the acknowledgements in hand (10 s each at
        most), then close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._writer is not None:
            await asyncio.wait([self._writer], timeout=10)
            self._writer.cancel()  # still failing: what is queued is redelivered
            await asyncio.gather(self._writer, return_exceptions=True)
        if self._acks:
            await asyncio.wait(self._acks, timeout=10)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._store.close)
        self._executor.shutdown(wait=True)

    async def add(self, kind: str, event: Message, hold: Hold) -> None:
        """Queue one event of a session group to be parked; `hold` (its record's) is released
        once the store committed it. Waits while MAX_QUEUED events are queued."""
        await self._room.acquire()
        self._queued.append((kind, event, hold))
        self._wake.set()

    async def _write(self) -> None:
        """The writer: park what is queued, a batch per transaction; release the batch's
        records, then build the sessions it completed. A failed transaction is tried again
        after a backoff (its records still held); close() ends the loop once nothing is
        queued."""
        delays = Backoff(0.1, 5.0).delays()
        while not (self._closed and not self._queued):
            await self._wake.wait()
            self._wake.clear()
            while self._queued:
                batch = self._queued[:BATCH]
                try:
                    added, ready = await self._db(self._park, [(k, e) for k, e, _ in batch])
                except Exception as err:  # a loop boundary: the batch is tried again
                    self._failing = True
                    log.error("parking session events failed", events=len(batch), error=repr(err))
                    await asyncio.sleep(next(delays))
                    continue
                self._failing, delays = False, Backoff(0.1, 5.0).delays()
                del self._queued[: len(batch)]
                for (_, event, hold), outcome in zip(batch, added, strict=True):
                    hold.release()
                    self._room.release()
                    self._count(event, outcome)
                for group_id in ready:
                    await self._build_logged(group_id)

    def _count(self, event: Message, outcome: str) -> None:
        """An event parked (or not): a deleted session's tokens are dropped, `deleted`."""
        self._metrics.session_events(outcome).inc()
        if outcome == "deleted" and isinstance(event, pb.ModelCall):
            self._metrics.completion_tokens("deleted").inc(len(event.completion_token_ids))

    def _park(self, items: Sequence[tuple[str, Message]]) -> tuple[list[str], list[str]]:
        """On the store's thread: park `items` in one transaction; what was done with each,
        and the sessions they completed."""
        added = self._store.add(items, self._clock())
        stored = {
            getattr(event, "group_id")  # noqa: B009 - every group event has one
            for (_, event), outcome in zip(items, added, strict=True)
            if outcome == "stored"
        }
        return list(added), [g for g in sorted(stored) if self._store.ready(g)]

    async def _build_logged(self, group_id: str) -> None:
        """Build a session the writer completed; a failure is logged and leaves it ready
        (built at the next start, or when another of its events arrives)."""
        try:
            await self._build(group_id, expired=False)
        except Exception as err:  # a loop boundary: the writer goes on
            log.error("session build failed", group_id=group_id, error=repr(err))

    async def delete(self, event: pb.SessionDeleted) -> None:
        """The app took the session back: its parked events and unpublished samples are
        purged (committed when this returns), its tombstone refuses its later events, and
        the tokens purged are counted as dropped, `deleted`. Samples already published are
        the trainer's to drop. Idempotent. Raises PermanentError for a group id that names
        no session."""
        if not is_session(event.group_id):
            raise PermanentError(f"SessionDeleted.group_id: {event.group_id!r} names no session")
        await self._delete(event.group_id)

    async def _delete(self, group_id: str) -> None:
        deletion = await self._db(self._store.delete, group_id, self._clock())
        if deletion is None:
            log.info("session deleted already", group_id=group_id)
            return
        self._metrics.completion_tokens("deleted").inc(deletion.tokens)
        self._metrics.sessions_decided("deleted").inc()
        log.info(
            "session deleted", group_id=group_id, was=deletion.previous, tokens=deletion.tokens
        )

    async def sweep(self) -> None:
        """Drop sessions past the retention, forget decided ones past it, update gauges."""
        before = self._clock() - self._production.retention_s
        for group_id in await self._db(self._store.expired, before):
            log.warning("session expired", group_id=group_id)
            await self._build(group_id, expired=True)
        await self._db(self._store.purge, before)
        await self.refresh()

    async def refresh(self) -> None:
        """Set the sessions gauge from the store."""
        for state, count in (await self._db(self._store.counts)).items():
            self._metrics.sessions(state).set(count)

    async def _build(self, group_id: str, *, expired: bool) -> None:
        async with self._building:
            row = await self._db(self._store.session, group_id)
            if row is None or row.state != "waiting":
                return
            items = await self._db(self._store.load, group_id)
            group = Group(group_id, row.first_seen)
            for kind, event in items:
                group.add(kind, event)
            waiting = [e.state.missing() for e in group.episodes()]
            if not expired and (not waiting or any(waiting)):
                log.error("session summary disagrees with its events", group_id=group_id)
                return
            await self._decide(group, items, expired)

    async def _decide(
        self, group: Group, items: Sequence[tuple[str, Message]], expired: bool
    ) -> None:
        """Build `group`, store the outcome (and the advanced baselines) in one transaction,
        publish its samples."""
        group_id = group.group_id
        app, session_id = parse_session_group(group_id) or ("", "")
        baselines = self._fresh_baselines()
        baselines.load(self._baselines.to_bytes())
        unfinished = [e for _, e in items if isinstance(e, pb.ModelCall)]
        if group.episodes():
            unfinished = []  # only a session that never finished is counted from its calls
        parent = extract_context([("traceparent", session_traceparent(app, session_id).encode())])
        started = time.perf_counter()
        with self._tracer.start_as_current_span(
            "samples.session", context=parent, links=call_links(group)
        ) as span:
            result = build_session(
                group,
                self._settings,
                baselines,
                self._production.feedback,
                app=app,
                expired=expired,
                unfinished=unfinished,
                decode=self._decode,
            )
            built = result.built
            samples = built.samples
            # A session that trains nothing is published too, without samples: its token
            # books reach hrl.samples like every other group's.
            record = published(built, group_id, group_id, SESSION_ESTIMATOR)
            ids = span.get_span_context()
            record.span_id = f"{ids.span_id:016x}"
            record.trace_id = f"{ids.trace_id:032x}"
            data = record.SerializeToString(deterministic=True)
            span.set_attribute("harnessrl.group_id", group_id)
            span.set_attribute("harnessrl.samples.outcome", built.dropped or "emitted")
            trained = baselines.to_bytes() if samples is not None else None
            if not await self._db(self._store.decide, group_id, data, trained, self._clock()):
                return  # decided meanwhile (it cannot be: builds hold the lock)
            if samples is not None:
                self._baselines = baselines
            self._send(group_id, record)  # in the span: its record carries the trace
            self._report(result, group, app, expired, time.perf_counter() - started)

    def _report(
        self, result: SessionBuilt, group: Group, app: str, expired: bool, seconds: float
    ) -> None:
        """The log line (with the current trace) and the metrics of one decided session."""
        built = result.built
        samples = built.samples
        log.info(
            "session built",
            group_id=group.group_id,
            app=app,
            kind=result.kind,
            outcome=built.dropped or "emitted",
            expired=expired,
            reward=built.rewards[0] if built.rewards else None,
            advantage=result.advantage,
            turns_credited=len(result.turns),
            turns_unmatched=result.unmatched_turns,
            samples=len(samples.samples) if samples is not None else 0,
            tokens_captured=built.books.captured,
            tokens_trained=built.books.trained,
            tokens_dropped=dict(built.books.dropped),
        )
        metrics = self._metrics
        # A session's books are counted when its record is acknowledged (_settle).
        metrics.observe(built, group.mode, expired, seconds, books=False)
        metrics.sessions_decided("built" if samples is not None else "dropped").inc()
        if expired:
            metrics.sessions_decided("expired").inc()
        metrics.session_turns("credited").inc(len(result.turns))
        metrics.session_turns("unmatched").inc(result.unmatched_turns)

    def _send(self, group_id: str, samples: pb.GroupSamples) -> None:
        delivery = self._publish(samples)
        delivery.add_done_callback(partial(self._acknowledged, group_id, samples.books))

    def _acknowledged(
        self, group_id: str, books: pb.TokenBooks, delivery: asyncio.Future[Ack]
    ) -> None:
        if delivery.cancelled() or self._closed:
            return  # shutting down: still built, published again at the next start
        refused = delivery.exception()
        if refused is not None:
            log.error("session samples refused", group_id=group_id, error=repr(refused))
        task = asyncio.ensure_future(self._settle(group_id, books, refused=refused is not None))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _settle(self, group_id: str, books: pb.TokenBooks, *, refused: bool) -> None:
        """The acknowledged session is published (or dropped, refused) and its books counted;
        nothing when it is not built any more (deleted meanwhile: counted as deleted)."""
        if not await self._db(partial(self._store.published, group_id, refused=refused)):
            return
        self._metrics.sessions_decided("publish_refused" if refused else "published").inc()
        if refused:  # what would have trained is dropped
            books = pb.TokenBooks(dropped={**books.dropped, "publish_refused": books.trained})
        self._metrics.count_books(books)

    async def _db(self, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` on the store's thread; SQLite's operational errors (busy, locked,
        I/O) are retryable: the record is handled again."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, partial(call, *args))
        except sqlite3.OperationalError as err:
            raise RetryableError(f"session store: {err}") from err

    def _fresh_baselines(self) -> Baselines:
        settings = self._production.baseline
        return Baselines(
            halflife=settings.halflife, min_count=settings.min_sessions, scale=settings.scale
        )


def call_links(group: Group) -> Sequence[Link]:
    """Links to the gateway's span of every call of `group`."""
    links = []
    for episode in group.episodes():
        for call in episode.state.calls.values():
            try:
                trace_id, span_id = int(call.trace_id, 16), int(call.span_id, 16)
            except ValueError:
                continue
            context = SpanContext(trace_id, span_id, True, TraceFlags(TraceFlags.SAMPLED))
            links.append(Link(context, {"harnessrl.seq": call.seq}))
    return links
