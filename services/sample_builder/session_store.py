"""Where production sessions wait for their reward: on disk, never in memory or in offsets.

A session may wait days for its feedback, and there may be 100,000 of them, so the sample
builder parks every event of a session group in SQLite (`<production.store>/
sample-builder.sqlite`, WAL, synchronous=FULL: a commit survives a crash or a power cut) and
lets its Kafka record go once the commit returned. Three tables:

- `events`: each event's serialized bytes, keyed by (group, identity, digest of the bytes):
  a redelivered copy is the same row and changes nothing. Copies of one identity with other
  contents are kept as trust/group.py keeps them: up to 1 + MAX_COPIES whole, the rest of a
  call's copies as a stand-in that carries only their token count (other events' are not
  kept), all in arrival order so a reload hands them to a Group in the same order.
- `sessions`: one summary row per session: closed call_count, finished, distinct calls
  received, reward present, state, first_seen and ended_at (seconds, wall clock), and while
  it is `built` the GroupSamples bytes (the outbox). Readiness is read from this row. A
  deleted session's row is its tombstone: state `deleted`, deleted_at and the completion
  tokens it had captured (`tokens`); nothing else of it is kept.
- `baselines`: the serialized session baselines, written in the transaction of the build
  that advanced them.

A session moves waiting -> built -> published, or to dropped, and from any of these to
deleted when its app takes it back (TRANSITIONS, checked in `_move`); its events are deleted
when it leaves `built` or `waiting` for good, and its row when `purge` finds it decided (or
deleted) longer ago than the retention. Events are parked a batch per transaction (`add`):
one fsync for a consumer's batch rather than one per event.

A deletion leaves no trace of the session's content in the files: the connection runs with
secure_delete (freed content is overwritten with zeros) and `delete` checkpoints the WAL
into the database and truncates it after its commit. One thread uses a store.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from google.protobuf.message import Message

from harnessrl import events, sqlite_store
from harnessrl.logs import get_logger
from harnessrl.trust.group import MAX_COPIES
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

State = Literal["waiting", "built", "published", "dropped", "deleted"]
Added = Literal["stored", "duplicate", "late", "overflow", "deleted"]
"""What `add` did with an event: stored it, found it stored already, found the session
decided already (late), let a copy past the bound go (overflow), or found the session
deleted (the event is not stored)."""

TRANSITIONS: dict[State, frozenset[State]] = {
    "waiting": frozenset({"built", "dropped", "deleted"}),
    "built": frozenset({"published", "dropped", "deleted"}),
    "published": frozenset({"deleted"}),
    "dropped": frozenset({"deleted"}),
    "deleted": frozenset(),
}
FILE_NAME = "sample-builder.sqlite"
KINDS: dict[str, type[Message]] = {
    "model_call": pb.ModelCall,
    "episode_closed": pb.EpisodeClosed,
    "episode_started": pb.EpisodeStarted,
    "episode_finished": pb.EpisodeFinished,
    "reward_assigned": pb.RewardAssigned,
}
"""The events of a session group, by envelope field name."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    group_id TEXT PRIMARY KEY,
    state TEXT NOT NULL DEFAULT 'waiting',
    first_seen REAL NOT NULL,
    ended_at REAL,
    call_count INTEGER,
    finished INTEGER NOT NULL DEFAULT 0,
    calls INTEGER NOT NULL DEFAULT 0,
    reward INTEGER NOT NULL DEFAULT 0,
    decided_at REAL,
    samples BLOB,
    deleted_at REAL,
    tokens INTEGER
);
CREATE INDEX IF NOT EXISTS sessions_by_state ON sessions (state);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY,
    group_id TEXT NOT NULL,
    identity TEXT NOT NULL,
    digest BLOB NOT NULL,
    kind TEXT NOT NULL,
    seq INTEGER,
    body BLOB NOT NULL,
    UNIQUE (group_id, identity, digest)
);
CREATE TABLE IF NOT EXISTS baselines (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    state BLOB NOT NULL
);
"""
_ADDED_COLUMNS = {"deleted_at": "REAL", "tokens": "INTEGER"}
"""Columns of `sessions` a store written before them lacks (added when it is opened)."""


@dataclass(frozen=True, slots=True)
class SessionRow:
    """A session's summary row."""

    group_id: str
    state: State
    first_seen: float
    ended_at: float | None
    call_count: int | None
    finished: bool
    calls: int
    reward: bool


@dataclass(frozen=True, slots=True)
class Deletion:
    """What `delete` found: the session's state before, and the completion tokens of the
    events it purged (each stored copy, as the books count them)."""

    previous: State
    tokens: int


class SessionStore:
    """The sample builder's SQLite store of sessions (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE_NAME
        self._db = sqlite_store.connect(self.path, any_thread=True)
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in columns:
                self._db.execute(f"ALTER TABLE sessions ADD COLUMN {name} {kind}")

    def close(self) -> None:
        """Idempotent."""
        self._db.close()

    def _transaction(self) -> AbstractContextManager[sqlite3.Connection]:
        return sqlite_store.transaction(self._db)

    # -- waiting -------------------------------------------------------------------------

    def add(self, items: Sequence[tuple[str, Message]], now: float) -> list[Added]:
        """Park events of session groups, (kind, event) with `kind` the envelope field name,
        in one transaction (committed when this returns, or nothing written when it raises);
        what was done with each, in order. Idempotent. `now` (seconds) is the first_seen of a
        session an event opens, the ended_at of one it finishes."""
        with self._transaction() as db:
            return [_add(db, kind, event, now) for kind, event in items]

    def ready(self, group_id: str) -> bool:
        """Whether a waiting session has everything: finished, closed with every call below
        its call_count, rewarded. Reads the summary row; counts its calls only when the
        row says they may all be in."""
        row = self.session(group_id)
        if row is None or row.state != "waiting" or not (row.finished and row.reward):
            return False
        if row.call_count is None or row.calls < row.call_count:
            return False
        (below,) = self._db.execute(
            "SELECT COUNT(DISTINCT seq) FROM events "
            "WHERE group_id = ? AND kind = 'model_call' AND seq < ?",
            (group_id, row.call_count),
        ).fetchone()
        return bool(below >= row.call_count)

    def ready_sessions(self) -> list[str]:
        """Waiting sessions that are ready (a crash between an event's commit and the build
        leaves them so)."""
        rows = self._db.execute(
            "SELECT group_id FROM sessions WHERE state = 'waiting' AND finished AND reward "
            "AND call_count IS NOT NULL AND calls >= call_count ORDER BY group_id"
        ).fetchall()
        return [g for (g,) in rows if self.ready(g)]

    def session(self, group_id: str) -> SessionRow | None:
        row = self._db.execute(
            "SELECT group_id, state, first_seen, ended_at, call_count, finished, calls, reward "
            "FROM sessions WHERE group_id = ?",
            (group_id,),
        ).fetchone()
        if row is None:
            return None
        g, state, first_seen, ended_at, call_count, finished, calls, reward = row
        return SessionRow(
            g, state, first_seen, ended_at, call_count, bool(finished), calls, bool(reward)
        )

    def load(self, group_id: str) -> list[tuple[str, Message]]:
        """(kind, event) of every parked event of the session, in arrival order."""
        rows = self._db.execute(
            "SELECT kind, body FROM events WHERE group_id = ? ORDER BY id", (group_id,)
        ).fetchall()
        return [(kind, KINDS[kind].FromString(body)) for kind, body in rows]

    def expired(self, before: float) -> list[str]:
        """Waiting sessions that ended (else began) before `before` (seconds)."""
        rows = self._db.execute(
            "SELECT group_id FROM sessions WHERE state = 'waiting' "
            "AND COALESCE(ended_at, first_seen) < ? ORDER BY group_id",
            (before,),
        ).fetchall()
        return [g for (g,) in rows]

    def delete(self, group_id: str, now: float) -> Deletion | None:
        """The app took the session back: in one transaction its parked events and stored
        GroupSamples bytes are purged and its row becomes a tombstone (`deleted`, deleted_at
        `now`, the tokens it had captured), made for a session never seen too, so that its
        later events are refused; then the WAL is checkpointed and truncated. None (nothing
        written) when it is deleted already."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO sessions (group_id, first_seen) VALUES (?, ?)",
                (group_id, now),
            )
            (state,) = db.execute(
                "SELECT state FROM sessions WHERE group_id = ?", (group_id,)
            ).fetchone()
            if state == "deleted":
                return None
            bodies = db.execute(
                "SELECT body FROM events WHERE group_id = ? AND kind = 'model_call'", (group_id,)
            ).fetchall()
            tokens = sum(len(pb.ModelCall.FromString(b).completion_token_ids) for (b,) in bodies)
            _move(db, group_id, state, "deleted")
            db.execute(
                "UPDATE sessions SET samples = NULL, deleted_at = ?, tokens = ? WHERE group_id = ?",
                (now, tokens, group_id),
            )
            db.execute("DELETE FROM events WHERE group_id = ?", (group_id,))
        if not sqlite_store.truncate_wal(self._db):  # another connection reads: later
            log.warning("session store checkpoint blocked", path=str(self.path))
        return Deletion(state, tokens)

    # -- the outbox ----------------------------------------------------------------------

    def decide(
        self, group_id: str, samples: bytes | None, baselines: bytes | None, now: float
    ) -> bool:
        """In one transaction: a waiting session becomes `built` with its GroupSamples bytes
        (`samples`), or `dropped` with its events deleted (None); `baselines`, when given,
        replace the stored ones. False (nothing written) when it is not waiting."""
        with self._transaction() as db:
            if not _move(db, group_id, "waiting", "built" if samples is not None else "dropped"):
                return False
            db.execute(
                "UPDATE sessions SET samples = ?, decided_at = ? WHERE group_id = ?",
                (samples, now, group_id),
            )
            if samples is None:
                db.execute("DELETE FROM events WHERE group_id = ?", (group_id,))
            if baselines is not None:
                db.execute(
                    "INSERT INTO baselines (id, state) VALUES (1, ?) "
                    "ON CONFLICT (id) DO UPDATE SET state = excluded.state",
                    (baselines,),
                )
        return True

    def published(self, group_id: str, *, refused: bool = False) -> bool:
        """A built session's samples were acknowledged (or `refused` for good: dropped): its
        bytes and events are deleted. False when it was not built (already published)."""
        with self._transaction() as db:
            if not _move(db, group_id, "built", "dropped" if refused else "published"):
                return False
            db.execute("UPDATE sessions SET samples = NULL WHERE group_id = ?", (group_id,))
            db.execute("DELETE FROM events WHERE group_id = ?", (group_id,))
        return True

    def unpublished(self) -> list[tuple[str, bytes]]:
        """(group id, GroupSamples bytes) of every built session not yet acknowledged."""
        rows = self._db.execute(
            "SELECT group_id, samples FROM sessions WHERE state = 'built' ORDER BY decided_at, "
            "group_id"
        ).fetchall()
        return [(g, bytes(b)) for g, b in rows]

    def baselines(self) -> bytes:
        """The stored baselines state (b"" before the first build)."""
        row = self._db.execute("SELECT state FROM baselines WHERE id = 1").fetchone()
        return bytes(row[0]) if row else b""

    def purge(self, before: float) -> int:
        """Forget published and dropped sessions decided, and tombstones deleted, before
        `before` (seconds): a late copy of their events opens them again (and they expire
        again). Their count."""
        with self._transaction() as db:
            cursor = db.execute(
                "DELETE FROM sessions WHERE state IN ('published', 'dropped', 'deleted') "
                "AND COALESCE(deleted_at, decided_at) < ?",
                (before,),
            )
        return cursor.rowcount

    def counts(self) -> dict[State, int]:
        """Sessions by state (every state present)."""
        counts: dict[State, int] = dict.fromkeys(TRANSITIONS, 0)
        for state, n in self._db.execute("SELECT state, COUNT(*) FROM sessions GROUP BY state"):
            counts[state] = n
        return counts

    def parked_events(self) -> int:
        (n,) = self._db.execute("SELECT COUNT(*) FROM events").fetchone()
        return int(n)


def _add(db: sqlite3.Connection, kind: str, event: Message, now: float) -> Added:
    """Park one event (see SessionStore.add)."""
    group_id: str = getattr(event, "group_id")  # noqa: B009 - every group event has one
    identity = events.event_id(event)
    body = event.SerializeToString(deterministic=True)
    digest = hashlib.blake2b(body, digest_size=16).digest()
    db.execute(
        "INSERT OR IGNORE INTO sessions (group_id, first_seen) VALUES (?, ?)", (group_id, now)
    )
    (state,) = db.execute("SELECT state FROM sessions WHERE group_id = ?", (group_id,)).fetchone()
    if state != "waiting":
        return "deleted" if state == "deleted" else "late"
    held = db.execute(
        "SELECT digest = ? FROM events WHERE group_id = ? AND identity = ?",
        (digest, group_id, identity),
    ).fetchall()
    if any(same for (same,) in held):
        return "duplicate"
    if len(held) > MAX_COPIES:
        if kind != "model_call":
            return "overflow"
        body = _stand_in(event, digest)  # type: ignore[arg-type]  # a model_call
    seq = getattr(event, "seq") if kind == "model_call" else None  # noqa: B009
    db.execute(
        "INSERT INTO events (group_id, identity, digest, kind, seq, body) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (group_id, identity, digest, kind, seq, body),
    )
    _summarise(db, kind, event, group_id, first=not held, now=now)
    return "stored"


def _move(db: sqlite3.Connection, group_id: str, old: State, new: State) -> bool:
    """The one place a session changes state; False when it is not in `old`."""
    if new not in TRANSITIONS[old]:
        raise ValueError(f"session state: {old} -> {new} is not a transition")
    cursor = db.execute(
        "UPDATE sessions SET state = ? WHERE group_id = ? AND state = ?", (new, group_id, old)
    )
    return cursor.rowcount == 1


def _summarise(
    db: sqlite3.Connection, kind: str, event: Message, group_id: str, *, first: bool, now: float
) -> None:
    """What the event adds to its session's summary row."""
    if kind == "model_call" and first:
        db.execute("UPDATE sessions SET calls = calls + 1 WHERE group_id = ?", (group_id,))
    elif kind == "episode_closed":
        count = getattr(event, "call_count")  # noqa: B009
        db.execute("UPDATE sessions SET call_count = ? WHERE group_id = ?", (count, group_id))
    elif kind == "episode_finished" and getattr(event, "final"):  # noqa: B009
        db.execute(
            "UPDATE sessions SET finished = 1, ended_at = COALESCE(ended_at, ?) WHERE group_id = ?",
            (now, group_id),
        )
    elif kind == "reward_assigned":
        db.execute("UPDATE sessions SET reward = 1 WHERE group_id = ?", (group_id,))


def _stand_in(call: pb.ModelCall, digest: bytes) -> bytes:
    """A copy of a seq past the bound, as group.py holds one: its identity and completion
    token count (the tokens are zeros; `response_id` its digest, so stand-ins of distinct
    copies stay distinct). A reload adds it after the whole copies, so the Group counts it
    among the overflow and never merges it."""
    stand_in = pb.ModelCall(
        episode_id=call.episode_id,
        attempt=call.attempt,
        group_id=call.group_id,
        seq=call.seq,
        completion_token_ids=[0] * len(call.completion_token_ids),
        response_id=f"overflow:{digest.hex()}",
    )
    return stand_in.SerializeToString(deterministic=True)
