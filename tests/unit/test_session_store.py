"""The sample builder's store of production sessions (services/sample_builder/session_store.py):
events parked once, a batch per transaction; a session decided once, its outbox surviving a
restart; a deleted session purged down to a tombstone that refuses its later events, with
nothing of its content left in the database file or its WAL. And the writer that parks a
consumer's records (session_groups.py): released only once committed."""

from __future__ import annotations

import asyncio
import sqlite3
from functools import partial
from pathlib import Path

import pytest
from google.protobuf.message import Message
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl.bus import Hold
from harnessrl.production import ProductionSection
from harnessrl.services.sample_builder.config import SampleBuilderSection
from harnessrl.services.sample_builder.metrics import SampleMetrics
from harnessrl.services.sample_builder.session_groups import SessionGroups
from harnessrl.services.sample_builder.session_store import FILE_NAME, Deletion, SessionStore
from harnessrl.trust.group import MAX_COPIES, Group
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import eventually
from tests.unit.test_session_samples import GROUP, group_of, session_events

MARKERS = (b"secret-marker-9f1c2e7a", b"overflowing-marker-4b8d03e1")
"""Bytes that occur nowhere but in the request bodies of the session to be deleted."""


def captured(items: list[tuple[str, Message]]) -> int:
    return sum(len(e.completion_token_ids) for _, e in items if isinstance(e, pb.ModelCall))


def with_markers(items: list[tuple[str, Message]]) -> list[tuple[str, Message]]:
    """`items` whose first call's request body holds MARKERS[0] (a small body, on a b-tree
    page) and whose second call's MARKERS[1] (in a body long enough to overflow a page)."""
    calls = [e for _, e in items if isinstance(e, pb.ModelCall)]
    calls[0].request_body = b'{"messages": "' + MARKERS[0] + b'"}'
    calls[1].request_body = b"a" * 9000 + MARKERS[1] + b"b" * 9000
    return items


def files_hold(directory: Path, marker: bytes) -> bool:
    """Whether the store's database file or its WAL holds `marker`."""
    paths = [directory / FILE_NAME, directory / f"{FILE_NAME}-wal"]
    return any(path.exists() and marker in path.read_bytes() for path in paths)


def test_the_store_parks_events_once_and_reads_readiness_from_the_summary(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    items = session_events()
    for item in items[:-1]:
        assert store.add([item, item], 10.0) == ["stored", "duplicate"]  # one transaction
        assert store.add([item], 11.0) == ["duplicate"]
    assert not store.ready(GROUP)
    assert store.add([items[-1]], 12.0) == ["stored"]
    assert store.ready(GROUP) and store.ready_sessions() == [GROUP]
    row = store.session(GROUP)
    assert row is not None and (row.first_seen, row.ended_at, row.calls) == (10.0, 10.0, 3)
    loaded = store.load(GROUP)
    assert [(k, e.SerializeToString()) for k, e in loaded] == [
        (k, e.SerializeToString()) for k, e in items
    ]
    store.close()


def test_a_batch_that_fails_parks_none_of_its_events(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    items = session_events()
    with pytest.raises(AttributeError):
        store.add([*items[:3], ("model_call", pb.PolicyVersion(version=1))], 1.0)
    assert store.session(GROUP) is None and store.parked_events() == 0
    assert store.add(items, 1.0) == ["stored"] * len(items)
    store.close()


def test_a_session_is_decided_once_and_its_outbox_survives_a_restart(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    store.add(session_events(), 1.0)
    assert store.decide(GROUP, b"samples", b"[1]", 2.0)
    assert not store.decide(GROUP, b"other", b"[2]", 3.0)  # built already: nothing changes
    assert store.add([session_events()[-1]], 4.0) == ["late"]
    store.close()
    store = SessionStore(tmp_path)
    assert store.unpublished() == [(GROUP, b"samples")] and store.baselines() == b"[1]"
    assert store.published(GROUP) and not store.published(GROUP)
    assert store.unpublished() == [] and store.load(GROUP) == [] and store.parked_events() == 0
    assert store.counts()["published"] == 1
    assert store.purge(2.5) == 1 and store.session(GROUP) is None
    store.close()


def test_the_store_bounds_conflicting_copies_as_the_group_does(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    items = session_events(calls=1)
    call = items[1][1]
    assert isinstance(call, pb.ModelCall)
    copies = []
    for i in range(MAX_COPIES + 3):
        copy = pb.ModelCall()
        copy.CopyFrom(call)
        copy.completion_logprobs[0] = -0.01 * (i + 1)
        copies.append(copy)
    in_memory = group_of([*items, *(("model_call", c) for c in copies)])
    store.add([*items, *(("model_call", c) for c in copies)], 1.0)
    reloaded = Group(GROUP, 0.0)
    for kind, event in store.load(GROUP):
        reloaded.add(kind, event)
    ((mine,), (theirs,)) = reloaded.episodes(), in_memory.episodes()
    assert mine.calls == theirs.calls and mine.overflow() == theirs.overflow() == (9, 3)
    store.close()


# -- deletion ------------------------------------------------------------------------------


def test_a_deleted_waiting_session_leaves_a_tombstone_that_refuses_its_events(
    tmp_path: Path,
) -> None:
    store = SessionStore(tmp_path)
    items = session_events(reward=None)
    other = session_events(reward=None, group="s.desk.chat-2")
    store.add([*items, *other], 1.0)
    assert store.delete(GROUP, 5.0) == Deletion("waiting", captured(items))
    row = store.session(GROUP)
    assert row is not None and row.state == "deleted"
    assert store.load(GROUP) == [] and store.parked_events() == len(other)
    late = session_events()
    assert store.add([late[1], late[-1]], 6.0) == ["deleted", "deleted"]  # a call, the reward
    assert store.load(GROUP) == [] and not store.ready(GROUP)
    assert store.delete(GROUP, 7.0) is None  # a redelivered deletion changes nothing
    assert store.counts()["deleted"] == 1 and store.expired(10.0) == ["s.desk.chat-2"]
    store.close()


def test_a_built_session_deleted_before_its_acknowledgement_leaves_the_outbox(
    tmp_path: Path,
) -> None:
    store = SessionStore(tmp_path)
    items = session_events()
    store.add(items, 1.0)
    assert store.decide(GROUP, b"samples", b"[1]", 2.0)
    assert store.delete(GROUP, 3.0) == Deletion("built", captured(items))
    assert store.unpublished() == [] and store.parked_events() == 0
    assert not store.published(GROUP)  # a late acknowledgement does not revive it
    row = store.session(GROUP)
    assert row is not None and row.state == "deleted"
    store.close()


def test_a_published_session_or_one_never_seen_is_deleted_with_no_tokens(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    store.add(session_events(), 1.0)
    assert store.decide(GROUP, b"samples", None, 2.0) and store.published(GROUP)
    assert store.delete(GROUP, 3.0) == Deletion("published", 0)  # the trainer's to drop
    assert store.delete("s.desk.unseen", 3.0) == Deletion("waiting", 0)
    assert store.add([session_events(group="s.desk.unseen")[1]], 4.0) == ["deleted"]
    store.close()


def test_a_deleted_sessions_content_is_in_neither_the_database_nor_its_wal(
    tmp_path: Path,
) -> None:
    store = SessionStore(tmp_path)
    store.add(with_markers(session_events(reward=None)), 1.0)
    store.close()  # the last connection checkpoints: the markers are in the database file
    assert all(files_hold(tmp_path, m) for m in MARKERS)
    store = SessionStore(tmp_path)
    for n in range(40):  # other sessions around it, and a copy parked since the restart
        store.add(session_events(group=f"s.desk.other-{n}"), 2.0)
    late = with_markers(session_events(reward=None))[2]
    assert isinstance(late[1], pb.ModelCall)
    late[1].completion_logprobs[0] = -0.25  # another copy: parked in the WAL
    assert store.add([late], 3.0) == ["stored"]
    assert store.delete(GROUP, 4.0) is not None
    assert not any(files_hold(tmp_path, m) for m in MARKERS)  # while the store is open
    assert store.parked_events() == 40 * len(session_events())
    store.close()
    assert not any(files_hold(tmp_path, m) for m in MARKERS)


def test_a_tombstone_survives_a_restart_and_goes_after_the_retention(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    items = session_events()
    store.add(items, 1.0)
    store.delete(GROUP, 100.0)
    store.close()
    store = SessionStore(tmp_path)
    assert store.add(items, 150.0) == ["deleted"] * len(items)
    assert store.purge(99.0) == 0  # decided_at (1.0) is not what a tombstone is kept by
    assert store.purge(101.0) == 1 and store.session(GROUP) is None
    store.close()


def test_a_store_written_before_tombstones_gains_their_columns(tmp_path: Path) -> None:
    old = sqlite3.connect(tmp_path / FILE_NAME)
    old.execute(
        "CREATE TABLE sessions (group_id TEXT PRIMARY KEY, state TEXT NOT NULL DEFAULT "
        "'waiting', first_seen REAL NOT NULL, ended_at REAL, call_count INTEGER, finished "
        "INTEGER NOT NULL DEFAULT 0, calls INTEGER NOT NULL DEFAULT 0, reward INTEGER NOT NULL "
        "DEFAULT 0, decided_at REAL, samples BLOB)"
    )
    old.execute("INSERT INTO sessions (group_id, first_seen) VALUES (?, 1.0)", (GROUP,))
    old.commit()
    old.close()
    store = SessionStore(tmp_path)
    assert store.delete(GROUP, 2.0) == Deletion("waiting", 0)
    store.close()
    store = SessionStore(tmp_path)  # opened again: nothing to add
    assert store.counts()["deleted"] == 1
    store.close()


# -- the writer ----------------------------------------------------------------------------


async def test_records_are_released_only_once_their_batch_committed(tmp_path: Path) -> None:
    """Another connection holds the database's write lock: the writer's transaction fails
    (busy after SQLite's 5 s wait), nothing is released and the store says it is unhealthy;
    once the lock goes, the batch commits and every record is released."""
    groups = SessionGroups(
        SessionStore(tmp_path),
        settings=SampleBuilderSection(),
        production=ProductionSection(),
        publish=lambda samples: asyncio.get_running_loop().create_future(),
        metrics=SampleMetrics(CollectorRegistry()),
        tracer=TracerProvider().get_tracer("test"),
    )
    await groups.start(deleted=lambda: asyncio.sleep(0, result=set()))
    blocker = sqlite3.connect(tmp_path / FILE_NAME, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    released: list[int] = []
    items = session_events(reward=None)
    for n, (kind, event) in enumerate(items):
        await groups.add(kind, event, Hold(partial(released.append, n)))
    await eventually(lambda: not groups.healthy, timeout=20)
    assert released == []
    blocker.execute("ROLLBACK")
    blocker.close()
    await eventually(lambda: len(released) == len(items), timeout=20)
    assert groups.healthy and sorted(released) == list(range(len(items)))
    await groups.close()
    store = SessionStore(tmp_path)
    assert store.parked_events() == len(items)
    store.close()
