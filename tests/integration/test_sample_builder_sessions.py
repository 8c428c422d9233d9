"""Production sessions through the sample builder on the real broker: parked on disk while
they wait for their reward (their records released, nothing held in memory), built exactly
once when it comes, across restarts and redeliveries, and published again from the store's
outbox after a crash between the build and the acknowledgement; a session its app deleted
(SessionDeleted on hrl.policy) purged from the store and never published, across restarts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from google.protobuf.message import Message
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.production import (
    AppSpec,
    FeedbackSection,
    ProductionSection,
    key_digest,
    session_traceparent,
)
from harnessrl.runtime import Runtime
from harnessrl.services.sample_builder.config import SampleBuilderConfig, SampleBuilderSection
from harnessrl.services.sample_builder.service import GROUP, SampleBuilderService
from harnessrl.services.sample_builder.session_store import SessionStore
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, committed_offsets, events_on, eventually, topic_size
from tests.integration.test_sample_builder import publish, samples_on_topic
from tests.unit.test_session_samples import GROUP as SESSION
from tests.unit.test_session_samples import reward_event, session_events
from tests.unit.test_session_store import MARKERS, captured, files_hold, with_markers

pytestmark = pytest.mark.integration

TURNS = (("thumbs", 1.0, ""), ("thumbs", -1.0, "resp-1"))
"""The user liked the session, and disliked its second answer."""


@asynccontextmanager
async def session_builder(
    broker: EmbeddedBroker,
    tmp_path: Path,
    name: str,
    registry: CollectorRegistry,
    retention_s: float = 30 * 86_400.0,
) -> AsyncIterator[SampleBuilderService]:
    """A sample builder serving the app `desk`, its session store under tmp_path."""
    config = SampleBuilderConfig(
        instance=name,
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / f"{name}-spill"),
        sample_builder=SampleBuilderSection(port=0, sweep_interval_s=0.2),
        production=ProductionSection(
            apps=[AppSpec(name="desk", key_sha256=key_digest("desk-key"))],
            store=tmp_path / "sessions",
            retention_s=retention_s,
            feedback=FeedbackSection(window_s=min(retention_s, 86_400.0)),
        ),
    )
    runtime = Runtime("sample-builder", name, registry, TracerProvider())
    service = SampleBuilderService(config, runtime)
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield service
    finally:
        await service.stop()
        await task


def events_only(items: list[tuple[str, Message]]) -> list[Message]:
    return [event for _, event in items]


def count(registry: CollectorRegistry, outcome: str) -> float:
    value = registry.get_sample_value(
        "harnessrl_samples_session_events_total", {"outcome": outcome}
    )
    return value or 0.0


async def parked(registry: CollectorRegistry, n: int) -> None:
    async def stored() -> bool:
        return count(registry, "stored") >= n

    await eventually(stored, timeout=60, interval=0.1)


def check_credit(group: pb.GroupSamples) -> None:
    """The session's advantage everywhere, the disliked answer's tokens lowered by its own."""
    assert group.group_id == SESSION and group.estimator == "session_baseline"
    # Built in the session's own trace, which every call and feedback signal shares.
    assert group.trace_id == session_traceparent("desk", "chat-1").split("-")[1]
    (sample,) = group.samples
    calls = {e.seq: e for e in events_only(session_events()) if isinstance(e, pb.ModelCall)}
    assert sample.advantage == pytest.approx(1.0)  # the app's first session: m = 0
    mask = np.array(sample.loss_mask)
    per_token = np.array(sample.advantages, dtype=np.float32)
    start = len(calls[1].prompt_token_ids)
    end = start + len(calls[1].completion_token_ids)
    assert np.allclose(per_token[start:end], 1.0 + -1.0)
    assert np.allclose(
        np.delete(per_token, range(start, end))[np.delete(mask, range(start, end))], 1.0
    )
    assert np.all(per_token[~mask] == 0)
    assert (
        group.books.captured
        == group.books.trained
        == sum(len(c.completion_token_ids) for c in calls.values())
    )


async def test_a_session_waits_on_disk_and_its_reward_builds_it_once(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    waiting = events_only(session_events(reward=None))
    async with session_builder(broker, tmp_path, "sb-s", registry) as service:
        await publish(broker, tmp_path, waiting)
        await parked(registry, len(waiting))
        # Nothing of the waiting session is in memory, and its records are released.
        assert service._groups == {} and service._holds == {}

        async def released() -> bool:
            offsets = await committed_offsets(broker.bootstrap, GROUP, events.CALLS)
            return sum(offsets.values()) == 4  # three calls and the close

        await eventually(released, timeout=30, interval=0.2)
        assert await topic_size(broker.bootstrap, events.SAMPLES) == 0
        reward = reward_event(1.0, TURNS, group=SESSION)
        await publish(broker, tmp_path, [reward])
        (group,) = await samples_on_topic(broker, 1)
        check_credit(group)
        # The reward again (a redelivery), and a late call copy: nothing new.
        await publish(broker, tmp_path, [reward, waiting[1]])

        async def ignored() -> bool:
            return count(registry, "late") == 2

        await eventually(ignored, timeout=30, interval=0.1)
        await asyncio.sleep(0.5)
        assert await topic_size(broker.bootstrap, events.SAMPLES) == 1

        async def settled() -> bool:
            value = registry.get_sample_value
            return value("harnessrl_samples_sessions", {"state": "published"}) == 1

        await eventually(settled, timeout=30, interval=0.1)
    store = SessionStore(tmp_path / "sessions")
    assert store.parked_events() == 0 and store.counts()["published"] == 1
    store.close()


async def test_a_restart_while_a_session_waits_still_builds_it_once_from_its_reward(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    waiting = events_only(session_events(reward=None))
    first = CollectorRegistry()
    async with session_builder(broker, tmp_path, "sb-a", first):
        await publish(broker, tmp_path, waiting)
        await parked(first, len(waiting))
    second = CollectorRegistry()
    async with session_builder(broker, tmp_path, "sb-b", second) as service:
        reward = reward_event(1.0, TURNS, group=SESSION)
        await publish(broker, tmp_path, [reward, reward])
        (group,) = await samples_on_topic(broker, 1)
        check_credit(group)
        assert service._groups == {}
        await asyncio.sleep(1.0)
        assert await topic_size(broker.bootstrap, events.SAMPLES) == 1
        # The waiting events were released before the restart: not read again.
        assert count(second, "stored") == 1


async def test_samples_built_before_a_crash_are_published_again_byte_for_byte(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """The crash is staged in the store: a session built (its bytes and baselines committed)
    whose publication was never acknowledged."""
    store = SessionStore(tmp_path / "sessions")
    store.add(session_events(), 1.0)
    built = pb.GroupSamples(group_id=SESSION, estimator="session_baseline", span_id="ab" * 8)
    built.samples.add(sample_id=f"{SESSION}/1/0", token_ids=[1, 2, 3], advantages=[0, 1, 2])
    built.books.dropped["retried"] = 3
    data = built.SerializeToString(deterministic=True)
    assert store.decide(SESSION, data, b'[[["desk","",""],1,1.0,0.0]]', 2.0)
    store.close()
    registry = CollectorRegistry()
    async with session_builder(broker, tmp_path, "sb-r", registry):
        (group,) = await samples_on_topic(broker, 1)
        assert group.SerializeToString(deterministic=True) == data

        async def settled() -> bool:
            value = registry.get_sample_value
            return value("harnessrl_samples_sessions_decided_total", {"outcome": "published"}) == 1

        await eventually(settled, timeout=30, interval=0.1)
    store = SessionStore(tmp_path / "sessions")
    assert store.unpublished() == [] and store.parked_events() == 0
    store.close()


async def test_a_session_waiting_past_its_retention_is_dropped_and_purged(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    waiting = events_only(session_events(reward=None))
    async with session_builder(broker, tmp_path, "sb-x", registry, retention_s=1.0):
        await publish(broker, tmp_path, waiting)

        async def expired() -> bool:
            value = registry.get_sample_value
            return value("harnessrl_samples_sessions_decided_total", {"outcome": "expired"}) == 1

        await eventually(expired, timeout=30, interval=0.1)
        value = registry.get_sample_value
        tokens = sum(len(e.completion_token_ids) for e in waiting if isinstance(e, pb.ModelCall))

        async def counted() -> bool:  # when its record (no samples, its books) is acknowledged
            outcome = {"outcome": "reward_missing"}
            return value("harnessrl_samples_completion_tokens_total", outcome) == tokens

        await eventually(counted, timeout=30, interval=0.1)

        async def purged() -> bool:
            store = SessionStore(tmp_path / "sessions")
            try:
                return store.session(SESSION) is None and store.parked_events() == 0
            finally:
                store.close()

        await eventually(purged, timeout=30, interval=0.2)
        (record,) = [g for _, g in await events_on(broker.bootstrap, events.SAMPLES)]
        assert not record.samples and record.dropped_reason == "reward_missing"
        assert record.books.dropped["reward_missing"] == tokens


# -- deletion ------------------------------------------------------------------------------


def deleted(group_id: str = SESSION) -> pb.SessionDeleted:
    deletion = pb.SessionDeleted(
        group_id=group_id, session=pb.SessionInfo(app="desk", session_id="chat-1")
    )
    deletion.requested_at.FromSeconds(1_000)
    return deletion


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def deleted_tokens(registry: CollectorRegistry) -> float:
    return value(registry, "harnessrl_samples_completion_tokens_total", outcome="deleted")


async def test_a_session_deleted_before_its_reward_is_never_built_and_leaves_no_trace(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    items = with_markers(session_events(reward=None))
    tokens = captured(items)
    store = tmp_path / "sessions"
    async with session_builder(broker, tmp_path, "sb-d", registry):
        await publish(broker, tmp_path, events_only(items))
        await parked(registry, len(items))
        assert all(files_hold(store, m) for m in MARKERS)
        await publish(broker, tmp_path, [deleted()])

        async def purged() -> bool:
            offsets = await committed_offsets(broker.bootstrap, f"{GROUP}.sb-d", events.POLICY)
            return deleted_tokens(registry) == tokens and sum(offsets.values()) == 1

        await eventually(purged, timeout=30, interval=0.1)
        assert not any(files_hold(store, m) for m in MARKERS)  # while the builder runs
        # Its reward, a late call and the deletion again: dropped, nothing stored or built.
        late = items[2][1]
        assert isinstance(late, pb.ModelCall)
        await publish(broker, tmp_path, [reward_event(1.0, TURNS), late, deleted()])

        async def dropped() -> bool:
            return count(registry, "deleted") == 2

        await eventually(dropped, timeout=30, interval=0.1)
        await asyncio.sleep(0.5)
        assert deleted_tokens(registry) == tokens + len(late.completion_token_ids)
        decided = "harnessrl_samples_sessions_decided_total"
        assert value(registry, decided, outcome="deleted") == 1
        assert await topic_size(broker.bootstrap, events.SAMPLES) == 0
    sessions = SessionStore(store)
    row = sessions.session(SESSION)
    assert row is not None and row.state == "deleted" and sessions.parked_events() == 0
    sessions.close()
    assert not any(files_hold(store, m) for m in MARKERS)


async def test_a_deleted_session_stays_deleted_across_a_restart(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    items = events_only(session_events(reward=None))
    first = CollectorRegistry()
    async with session_builder(broker, tmp_path, "sb-t", first):
        await publish(broker, tmp_path, items)
        await parked(first, len(items))
        await publish(broker, tmp_path, [deleted()])

        async def purged() -> bool:
            return deleted_tokens(first) > 0

        await eventually(purged, timeout=30, interval=0.1)
    second = CollectorRegistry()
    async with session_builder(broker, tmp_path, "sb-t", second):
        # Its events again (as a redelivery brings them) and its reward: the tombstone on
        # disk drops them; the deletion, committed, is not applied again.
        await publish(broker, tmp_path, [*items, reward_event(1.0, TURNS)])

        async def dropped() -> bool:
            return count(second, "deleted") == len(items) + 1

        await eventually(dropped, timeout=30, interval=0.1)
        await asyncio.sleep(0.5)
        assert count(second, "stored") == 0
        decided = "harnessrl_samples_sessions_decided_total"
        assert value(second, decided, outcome="deleted") == 0
        assert await topic_size(broker.bootstrap, events.SAMPLES) == 0


async def test_samples_built_but_unpublished_at_a_crash_are_not_published_once_deleted(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """The crash is staged in the store (a built session whose publication was never
    acknowledged); its app deleted the session while the builder was down."""
    items = session_events()
    store = SessionStore(tmp_path / "sessions")
    store.add(items, 1.0)
    built = pb.GroupSamples(group_id=SESSION, estimator="session_baseline")
    built.samples.add(sample_id=f"{SESSION}/1/0", token_ids=[1, 2, 3])
    assert store.decide(SESSION, built.SerializeToString(), b"", 2.0)
    store.close()
    await publish(broker, tmp_path, [deleted()])
    registry = CollectorRegistry()
    async with session_builder(broker, tmp_path, "sb-u", registry):

        async def purged() -> bool:
            offsets = await committed_offsets(broker.bootstrap, f"{GROUP}.sb-u", events.POLICY)
            return sum(offsets.values()) == 1

        await eventually(purged, timeout=30, interval=0.1)
        assert deleted_tokens(registry) == captured(items)
        await asyncio.sleep(0.5)
        assert await topic_size(broker.bootstrap, events.SAMPLES) == 0
    store = SessionStore(tmp_path / "sessions")
    assert store.unpublished() == [] and store.parked_events() == 0
    store.close()
