"""The reward service's feedback store on a real SQLite file, with a clock passed in: the
window, idempotency, arrival order, restart, retention, deletion (nothing of a deleted
session left in the file or the WAL), and flat memory at 100k sessions."""

from __future__ import annotations

import gc
import sqlite3
import tracemalloc
from pathlib import Path

import pytest

from harnessrl.production import FeedbackSection, SignalRule
from harnessrl.services.reward.feedback_join import reward_of
from harnessrl.services.reward.feedback_store import (
    MAX_SIGNALS_PER_SESSION,
    STORE_FILE,
    FeedbackStore,
    SessionRecord,
    StoredSignal,
)
from harnessrl.v1 import events_pb2 as pb

WINDOW = 100.0
RULES = FeedbackSection(
    signals={"thumbs": SignalRule(min=-1, max=1, required=True), "resolved": SignalRule(weight=3)},
    window_s=WINDOW,
)
T0 = 1_800_000_000.0


def session(n: int = 0, *, ended_at: float | None = None, started_at: float = T0) -> SessionRecord:
    return SessionRecord(
        group_id=f"s.desk.sess-{n}",
        app="desk",
        session_id=f"sess-{n}",
        kind="chat",
        explored=n % 2 == 0,
        trace_id="ab" * 16,
        started_at=started_at,
        ended_at=ended_at,
        ended_by="" if ended_at is None else "end",
    )


def signal(key: str, at: float, *, name: str = "thumbs", value: float = 1.0) -> StoredSignal:
    return StoredSignal(name, value, "", key, at, "cd" * 8, "ab" * 16)


def take_all(record: SessionRecord, signals: list[StoredSignal], now: float) -> bytes:
    return f"{record.group_id}|{[s.idempotency_key for s in signals]}|{now}".encode()


@pytest.fixture
def store(tmp_path: Path) -> FeedbackStore:
    return FeedbackStore.open(tmp_path / "sessions", window_s=WINDOW)


def test_registering_and_ending_twice_changes_nothing(store: FeedbackStore) -> None:
    assert store.register([session()]) == 1
    assert store.register([session()]) == 0
    assert store.end(session(ended_at=T0 + 5))
    assert not store.end(session(ended_at=T0 + 50))  # the first end stays
    held = store.session("s.desk.sess-0")
    assert held is not None and (held.ended_at, held.view) == (T0 + 5, "awaiting_feedback")
    assert store.counts == {
        "open": 0,
        "awaiting_feedback": 1,
        "decided": 0,
        "published": 0,
        "deleted": 0,
    }


def test_an_end_without_a_start_registers_the_session(store: FeedbackStore) -> None:
    assert store.end(session(3, ended_at=T0 + 1))
    assert store.register([session(3)]) == 0
    held = store.session("s.desk.sess-3")
    assert held is not None and held.ended_at == T0 + 1


def test_a_repeated_key_is_a_duplicate_and_changes_nothing(store: FeedbackStore) -> None:
    store.register([session()])
    assert store.add_signal("s.desk.sess-0", signal("k1", T0 + 1)).outcome == "accepted"
    again = store.add_signal("s.desk.sess-0", signal("k1", T0 + 2))
    changed = store.add_signal("s.desk.sess-0", signal("k1", T0 + 3, value=-1.0))
    assert (again.outcome, again.same_content) == ("duplicate", True)
    assert (changed.outcome, changed.same_content) == ("duplicate", False)
    assert store.signals("s.desk.sess-0") == [signal("k1", T0 + 1)]


def test_signals_come_back_in_arrival_order(store: FeedbackStore) -> None:
    store.register([session()])
    keys = ["z", "a", "m", "b"]
    for i, key in enumerate(keys):
        store.add_signal("s.desk.sess-0", signal(key, T0 + 10 - i))  # clocks need not agree
    assert [s.idempotency_key for s in store.signals("s.desk.sess-0")] == keys


def test_the_window_closes_window_s_after_the_end(store: FeedbackStore) -> None:
    store.register([session(0), session(1)])
    assert store.add_signal("s.desk.sess-9", signal("k", T0)).outcome == "unknown_session"
    store.end(session(0, ended_at=T0 + 10))
    assert store.due(T0 + 10 + WINDOW - 0.001, 10) == []
    inside = store.add_signal("s.desk.sess-0", signal("k", T0 + 10 + WINDOW - 0.001))
    late = store.add_signal("s.desk.sess-0", signal("k2", T0 + 10 + WINDOW))
    assert (inside.outcome, inside.ended_at, late.outcome) == ("accepted", T0 + 10, "window_ended")
    assert store.due(T0 + 10 + WINDOW, 10) == ["s.desk.sess-0"]  # never an open session


def test_a_decision_is_stored_once_and_refuses_later_signals(store: FeedbackStore) -> None:
    store.register([session()])
    store.add_signal("s.desk.sess-0", signal("k1", T0 + 1))
    store.end(session(ended_at=T0 + 2))
    decided = store.decide(["s.desk.sess-0"], T0 + 3, take_all)
    assert decided == [("s.desk.sess-0", b"s.desk.sess-0|['k1']|1800000003.0")]
    assert store.decide(["s.desk.sess-0"], T0 + 4, take_all) == []
    assert store.add_signal("s.desk.sess-0", signal("k2", T0 + 5)).outcome == "decided"
    assert store.add_signal("s.desk.sess-0", signal("k1", T0 + 5)).outcome == "duplicate"
    assert store.unpublished("", 10) == decided
    store.mark_published(["s.desk.sess-0"])
    store.mark_published(["s.desk.sess-0"])
    held = store.session("s.desk.sess-0")
    assert held is not None and (held.view, held.reward) == ("published", decided[0][1])
    assert store.unpublished("", 10) == []
    assert store.counts["published"] == 1 and store.counts["decided"] == 0


def test_a_judge_that_waits_leaves_the_session_awaiting(store: FeedbackStore) -> None:
    store.register([session()])
    assert store.decide(["s.desk.sess-0"], T0, lambda *_: None) == []
    held = store.session("s.desk.sess-0")
    assert held is not None and held.view == "open"


def test_a_session_holds_a_bounded_number_of_signals(store: FeedbackStore) -> None:
    store.register([session()])
    for i in range(MAX_SIGNALS_PER_SESSION):
        store.add_signal("s.desk.sess-0", signal(f"k{i}", T0))
    assert store.add_signal("s.desk.sess-0", signal("one-more", T0)).outcome == "too_many"


def test_everything_survives_closing_and_reopening_the_file(tmp_path: Path) -> None:
    first = FeedbackStore.open(tmp_path, window_s=WINDOW)
    first.register([session(0), session(1)])
    first.add_signal("s.desk.sess-0", signal("k1", T0 + 1))
    first.end(session(0, ended_at=T0 + 2))
    first.end(session(1, ended_at=T0 + 2))
    first.decide(["s.desk.sess-1"], T0 + 3, take_all)
    first.close()
    again = FeedbackStore.open(tmp_path, window_s=WINDOW)
    assert again.signals("s.desk.sess-0") == [signal("k1", T0 + 1)]
    assert [g for g, _ in again.unpublished("", 10)] == ["s.desk.sess-1"]
    assert again.counts == {
        "open": 0,
        "awaiting_feedback": 1,
        "decided": 1,
        "published": 0,
        "deleted": 0,
    }
    assert again.add_signal("s.desk.sess-0", signal("k1", T0 + 4)).outcome == "duplicate"


def test_retention_deletes_old_sessions_and_their_signals(store: FeedbackStore) -> None:
    store.register([session(0), session(1), session(2, started_at=T0 + 500)])
    store.add_signal("s.desk.sess-0", signal("k", T0 + 1))
    store.end(session(0, ended_at=T0 + 10))
    store.end(session(1, ended_at=T0 + 300))
    assert store.expire(T0 + 11, 100) == 1  # ended before
    assert store.expire(T0 + 11, 100) == 0
    assert store.session("s.desk.sess-0") is None and store.signals("s.desk.sess-0") == []
    assert store.session("s.desk.sess-1") is not None
    assert store.expire(T0 + 600, 100) == 2  # an ended one and one that never ended
    assert sum(store.counts.values()) == 0


def plan(path: Path, sql: str, *params: object) -> str:
    """SQLite's query plan for `sql` on the store's file."""
    db = sqlite3.connect(path / STORE_FILE)
    try:
        return "\n".join(str(row[-1]) for row in db.execute(f"EXPLAIN QUERY PLAN {sql}", params))
    finally:
        db.close()


def test_the_questions_about_many_sessions_are_indexed(
    store: FeedbackStore, tmp_path: Path
) -> None:
    due = plan(
        tmp_path / "sessions",
        "SELECT group_id FROM sessions WHERE state = 'awaiting' AND ended_at IS NOT NULL "
        "AND ended_at <= ? ORDER BY ended_at LIMIT ?",
        T0,
        10,
    )
    unpublished = plan(
        tmp_path / "sessions",
        "SELECT group_id, reward FROM sessions WHERE state = 'decided' AND group_id > ? "
        "ORDER BY group_id LIMIT ?",
        "",
        10,
    )
    old = plan(
        tmp_path / "sessions",
        "SELECT group_id FROM sessions WHERE coalesce(ended_at, started_at) < ? LIMIT ?",
        T0,
        10,
    )
    assert "USING INDEX sessions_due" in due
    assert "USING INDEX sessions_unpublished" in unpublished
    assert "USING INDEX sessions_age" in old


def test_a_hundred_thousand_waiting_sessions_keep_no_python_objects(store: FeedbackStore) -> None:
    n = 100_000
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        store.register(session(i, ended_at=T0 + i / 1000) for i in range(n))
        assert store.counts["awaiting_feedback"] == n
        assert len(store.due(T0 + WINDOW + 1000, 500)) == 500
        store.add_signal("s.desk.sess-77", signal("k", T0 + 100))
        gc.collect()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # A Python object per session would hold at least 100 bytes each: 10 MB.
    assert held - base < 512 * 1024, "memory grows with the sessions stored"
    assert peak - base < 4 * 1024 * 1024


def judge(record: SessionRecord, signals: list[StoredSignal], now: float) -> bytes | None:
    reward = reward_of(record, signals, RULES, now)
    return None if reward is None else reward.SerializeToString(deterministic=True)


def test_the_stored_reward_is_the_feedback_rule_applied_to_the_stored_signals(
    store: FeedbackStore,
) -> None:
    store.register([session()])
    store.add_signal("s.desk.sess-0", signal("r", T0 + 1, name="resolved", value=0.0))
    store.end(session(ended_at=T0 + 2))
    assert store.decide(["s.desk.sess-0"], T0 + 3, judge) == []  # thumbs is required
    store.add_signal("s.desk.sess-0", signal("t", T0 + 4, value=1.0))
    [(_, data)] = store.decide(["s.desk.sess-0"], T0 + 5, judge)
    reward = pb.RewardAssigned.FromString(data)
    assert (reward.value, reward.missing, reward.source) == (0.25, False, "feedback")
    assert dict(reward.components) == {"resolved": 0.0, "thumbs": 1.0}
    assert [s.idempotency_key for s in reward.signals] == ["r", "t"]
    assert reward.decided_at.ToNanoseconds() == int((T0 + 5) * 1e9)
    again = judge(session(ended_at=T0 + 2), store.signals("s.desk.sess-0"), T0 + 5)
    assert again == data  # deterministic: a republication sends the same bytes


def test_a_window_that_ends_without_the_required_signal_decides_by_at_window_end(
    store: FeedbackStore,
) -> None:
    store.register([session(0), session(1)])
    store.add_signal("s.desk.sess-1", signal("r", T0 + 1, name="resolved", value=1.0))
    store.end(session(0, ended_at=T0 + 2))
    store.end(session(1, ended_at=T0 + 2))
    due = store.due(T0 + 2 + WINDOW, 10)
    decided = dict(store.decide(due, T0 + 2 + WINDOW, judge))
    empty = pb.RewardAssigned.FromString(decided["s.desk.sess-0"])
    partial = pb.RewardAssigned.FromString(decided["s.desk.sess-1"])
    assert empty.missing and "no feedback within the window" in empty.message
    assert (partial.missing, partial.value) == (False, 1.0)  # at_window_end: train


def test_a_deleted_session_leaves_only_its_tombstone(store: FeedbackStore) -> None:
    store.register([session(0), session(1)])
    store.add_signal("s.desk.sess-0", signal("k1", T0 + 1))
    store.end(session(0, ended_at=T0 + 5))
    [(_, reward)] = store.decide(["s.desk.sess-0"], T0 + 6, take_all)
    assert store.delete("s.desk.nobody", T0 + 7) is None  # unknown: nothing changes
    tomb = store.delete("s.desk.sess-0", T0 + 7)
    assert tomb is not None and (tomb.app, tomb.session_id, tomb.deleted_at) == (
        "desk",
        "sess-0",
        T0 + 7,
    )
    assert tomb.applied_at is None and tomb.trained_versions == ()
    assert store.delete("s.desk.sess-0", T0 + 9) == tomb  # idempotent: the first deletion
    assert store.session("s.desk.sess-0") is None and store.signals("s.desk.sess-0") == []
    assert store.unpublished("", 10) == []  # its decided reward is gone with it
    assert store.decide(["s.desk.sess-0"], T0 + 8, take_all) == []
    # Its events redelivered, a late signal: it stays deleted.
    assert store.register([session(0)]) == 0
    assert not store.end(session(0, ended_at=T0 + 5))
    assert store.add_signal("s.desk.sess-0", signal("k2", T0 + 8)).outcome == "deleted"
    assert store.session("s.desk.sess-0") is None
    assert store.counts["deleted"] == 1 and store.counts["open"] == 1
    assert sum(store.counts.values()) == 2
    # The trainer's answer: recorded once, the first counts.
    assert store.applied("s.desk.sess-0", [3, 5], 40, 6, T0 + 10)
    assert not store.applied("s.desk.sess-0", [9], 0, 9, T0 + 11)
    assert not store.applied("s.desk.sess-1", [1], 0, 1, T0 + 11)  # not deleted
    answered = store.tombstone("s.desk.sess-0")
    assert answered is not None and answered.applied_at == T0 + 10
    assert (answered.trained_versions, answered.dropped_tokens, answered.version) == ((3, 5), 40, 6)
    assert store.delete("s.desk.sess-0", T0 + 12) == answered
    assert reward  # what was decided existed before the deletion


def test_deleted_content_is_gone_from_the_database_file_and_the_wal(tmp_path: Path) -> None:
    marker = "marker-7f3c9e1a-do-not-keep"
    store = FeedbackStore.open(tmp_path / "sessions", window_s=WINDOW)
    store.register([session(0), session(1)])
    for n in range(40):  # enough rows to spread over several pages
        store.add_signal("s.desk.sess-1", signal(f"other-{n}", T0 + 1))
    store.add_signal("s.desk.sess-0", signal(f"{marker}-signal", T0 + 1))
    store.end(session(0, ended_at=T0 + 5))
    store.decide(["s.desk.sess-0"], T0 + 200, take_all)  # the reward bytes name the key too
    files = [tmp_path / "sessions" / STORE_FILE, tmp_path / "sessions" / f"{STORE_FILE}-wal"]
    assert any(marker.encode() in path.read_bytes() for path in files if path.exists())

    assert store.delete("s.desk.sess-0", T0 + 300) is not None
    for path in files:
        assert not path.exists() or marker.encode() not in path.read_bytes(), path
    assert len(store.signals("s.desk.sess-1")) == 40  # the others are untouched
    store.close()
    for path in files:
        assert not path.exists() or marker.encode() not in path.read_bytes(), path


def test_retention_deletes_old_tombstones(store: FeedbackStore) -> None:
    store.register([session(0)])
    store.delete("s.desk.sess-0", T0 + 10)
    assert store.expire(T0 + 10, 100) == 0
    assert store.expire(T0 + 11, 100) == 1
    assert store.tombstone("s.desk.sess-0") is None and store.counts["deleted"] == 0
