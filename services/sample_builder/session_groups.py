"""Production session groups: parked on disk, built exactly once, published from an outbox.

A session's group (`s.<app>.<session>`, one episode) may wait days for its reward, so none
of it is held in memory or by an uncommitted offset: each event is written to the session
store (session_store.py) and its record released once the write committed. When the store's
summary row says the session has everything, its events are reloaded into a Group and built
(trust/session_samples.py). Building advances the baselines, so it happens once: one
transaction stores the GroupSamples bytes, the advanced baselines and state=built; then the
bytes are published, and on acknowledgement the session is `published` and its events
deleted. At start every built-not-published session is published again from its stored
bytes (the same GroupSamples, byte for byte), and sessions left ready by a crash are built.
A session waiting longer than `production.retention_s` after it ended (or began) is dropped
and its events purged; decided sessions are forgotten after the same time.

The store is used from one thread of its own, so a commit's fsync never blocks the event
loop; builds are serialised by a lock, so each reads the baselines the previous one left.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

from google.protobuf.message import Message
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext, TraceFlags

from harnessrl.bus import Ack
from harnessrl.logs import get_logger
from harnessrl.production import ProductionSection, parse_session_group, session_traceparent
from harnessrl.retry import RetryableError
from harnessrl.services.sample_builder.config import SampleBuilderSection
from harnessrl.services.sample_builder.metrics import SampleMetrics
from harnessrl.services.sample_builder.session_store import SessionStore
from harnessrl.telemetry import extract_context
from harnessrl.trust.group import Group
from harnessrl.trust.samples import Decode
from harnessrl.trust.session_baseline import Baselines
from harnessrl.trust.session_samples import SessionBuilt, build_session
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

T = TypeVar("T")
Publish = Callable[[pb.GroupSamples], "asyncio.Future[Ack]"]


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

    async def start(self) -> None:
        """Load the baselines, publish again what was built but not acknowledged, build
        what a crash left ready."""
        self._baselines.load(await self._db(self._store.baselines))
        unpublished = await self._db(self._store.unpublished)
        for group_id, data in unpublished:
            self._send(group_id, pb.GroupSamples.FromString(data))
        ready = await self._db(self._store.ready_sessions)
        for group_id in ready:
            await self._build(group_id, expired=False)
        await self.refresh()
        log.info("sessions resumed", republished=len(unpublished), built_at_start=len(ready))

    async def close(self) -> None:
        """Wait for the acknowledgements in hand, then close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._acks:
            await asyncio.wait(self._acks, timeout=10)
        await asyncio.get_running_loop().run_in_executor(self._executor, self._store.close)
        self._executor.shutdown(wait=True)

    async def add(self, kind: str, event: Message) -> None:
        """Park one event of a session group; build the session when it completes it."""
        group_id: str = getattr(event, "group_id")  # noqa: B009 - every group event has one
        store = self._store

        def add() -> tuple[str, bool]:
            added = store.add(kind, event, self._clock())
            return added, added == "stored" and store.ready(group_id)

        added, ready = await self._db(add)
        self._metrics.session_events(added).inc()
        if ready:
            await self._build(group_id, expired=False)

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
            data = None
            if samples is not None:
                ids = span.get_span_context()
                samples.span_id = f"{ids.span_id:016x}"
                samples.trace_id = f"{ids.trace_id:032x}"
                data = samples.SerializeToString(deterministic=True)
            span.set_attribute("harnessrl.group_id", group_id)
            span.set_attribute("harnessrl.samples.outcome", built.dropped or "emitted")
            trained = baselines.to_bytes() if samples is not None else None
            if not await self._db(self._store.decide, group_id, data, trained, self._clock()):
                return  # decided meanwhile (it cannot be: builds hold the lock)
            if samples is not None:
                self._baselines = baselines
                self._send(group_id, samples)  # in the span: its record carries the trace
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
        metrics.observe(built, group.mode, expired, seconds)
        metrics.sessions_decided("built" if samples is not None else "dropped").inc()
        if expired:
            metrics.sessions_decided("expired").inc()
        metrics.session_turns("credited").inc(len(result.turns))
        metrics.session_turns("unmatched").inc(result.unmatched_turns)

    def _send(self, group_id: str, samples: pb.GroupSamples) -> None:
        delivery = self._publish(samples)
        delivery.add_done_callback(partial(self._acknowledged, group_id))

    def _acknowledged(self, group_id: str, delivery: asyncio.Future[Ack]) -> None:
        if delivery.cancelled() or self._closed:
            return  # shutting down: still built, published again at the next start
        refused = delivery.exception()
        if refused is not None:
            log.error("session samples refused", group_id=group_id, error=repr(refused))
        task = asyncio.ensure_future(self._settle(group_id, refused=refused is not None))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)

    async def _settle(self, group_id: str, *, refused: bool) -> None:
        if await self._db(partial(self._store.published, group_id, refused=refused)):
            self._metrics.sessions_decided("publish_refused" if refused else "published").inc()

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
