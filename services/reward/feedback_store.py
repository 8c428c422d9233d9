"""The reward service's durable record of production sessions and the feedback they got.

One SQLite file (`<production.store>/reward.sqlite`, WAL, synchronous=FULL): a method that
writes returns only once its transaction is on disk, so whatever it reported (a signal
accepted, a reward decided) survives a crash. Nothing about a waiting session lives only in
memory: the store keeps no Python object per session, and every question asked of many
sessions ("whose window ended", "decided but not published", "past retention") is an
indexed query with a limit, so memory stays flat with any number of sessions waiting.

A session moves awaiting -> decided -> published, in that order only (`_STEPS`); a signal
is one row per (session, idempotency key), numbered in arrival order. A connection is used
by one thread: `StoreThread` runs every call on its own thread, off the event loop.

A deleted session (`delete`) leaves only a tombstone in `deletions` (ids, when, and later
the trainer's answer): its row, its signals and its reward bytes are gone, overwritten in
the file (secure_delete) and out of the WAL (a TRUNCATE checkpoint after the deletion). A
tombstoned session is never registered, ended, given a signal or decided again.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

from harnessrl import sqlite_store
from harnessrl.logs import get_logger

log = get_logger(__name__)

STORE_FILE = "reward.sqlite"
MAX_SIGNALS_PER_SESSION = 256
"""Signals one session may hold: its RewardAssigned carries them all, and must stay small."""
VIEW_STATES = ("open", "awaiting_feedback", "decided", "published", "deleted")
"""How a session is reported: awaiting splits into open (not ended) and awaiting_feedback;
deleted is a tombstone."""

_STEPS = {"awaiting": "decided", "decided": "published"}  # the only transitions

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    group_id TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    session_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    explored INTEGER NOT NULL,
    trace_id TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    ended_by TEXT NOT NULL DEFAULT '',
    state TEXT NOT NULL DEFAULT 'awaiting'
        CHECK (state IN ('awaiting', 'decided', 'published')),
    decided_at REAL,
    reward BLOB
);
CREATE INDEX IF NOT EXISTS sessions_due ON sessions (ended_at)
    WHERE state = 'awaiting' AND ended_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS sessions_unpublished ON sessions (group_id) WHERE state = 'decided';
CREATE INDEX IF NOT EXISTS sessions_age ON sessions (coalesce(ended_at, started_at));
CREATE TABLE IF NOT EXISTS signals (
    seq INTEGER PRIMARY KEY,
    group_id TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    name TEXT NOT NULL,
    value REAL NOT NULL,
    response_id TEXT NOT NULL,
    received_at REAL NOT NULL,
    span_id TEXT NOT NULL,
    trace_id TEXT NOT NULL,
    UNIQUE (group_id, idempotency_key)
);
CREATE TABLE IF NOT EXISTS deletions (
    group_id TEXT PRIMARY KEY,
    app TEXT NOT NULL,
    session_id TEXT NOT NULL,
    deleted_at REAL NOT NULL,
    applied_at REAL,
    trained_versions TEXT NOT NULL DEFAULT '',
    dropped_tokens INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS deletions_age ON deletions (deleted_at);
CREATE TABLE IF NOT EXISTS session_counts (view TEXT PRIMARY KEY, n INTEGER NOT NULL);
INSERT OR IGNORE INTO session_counts VALUES
    ('open', 0), ('awaiting_feedback', 0), ('decided', 0), ('published', 0), ('deleted', 0);
"""
# The gauge of sessions by state is read from session_counts, kept exact by triggers, so a
# scrape never counts 100,000 rows.
_VIEW = (
    "CASE WHEN {r}.state != 'awaiting' THEN {r}.state "
    "WHEN {r}.ended_at IS NULL THEN 'open' ELSE 'awaiting_feedback' END"
)
_TRIGGERS = f"""
CREATE TRIGGER IF NOT EXISTS sessions_counted_in AFTER INSERT ON sessions BEGIN
    UPDATE session_counts SET n = n + 1 WHERE view = {_VIEW.format(r="NEW")};
END;
CREATE TRIGGER IF NOT EXISTS sessions_counted_out AFTER DELETE ON sessions BEGIN
    UPDATE session_counts SET n = n - 1 WHERE view = {_VIEW.format(r="OLD")};
END;
CREATE TRIGGER IF NOT EXISTS sessions_recounted AFTER UPDATE OF state, ended_at ON sessions BEGIN
    UPDATE session_counts SET n = n - 1 WHERE view = {_VIEW.format(r="OLD")};
    UPDATE session_counts SET n = n + 1 WHERE view = {_VIEW.format(r="NEW")};
END;
CREATE TRIGGER IF NOT EXISTS deletions_counted_in AFTER INSERT ON deletions BEGIN
    UPDATE session_counts SET n = n + 1 WHERE view = 'deleted';
END;
CREATE TRIGGER IF NOT EXISTS deletions_counted_out AFTER DELETE ON deletions BEGIN
    UPDATE session_counts SET n = n - 1 WHERE view = 'deleted';
END;
"""
_SESSION_COLUMNS = (
    "group_id, app, session_id, kind, explored, trace_id, started_at, ended_at, ended_by, "
    "state, decided_at, reward"
)
_SIGNAL_COLUMNS = "name, value, response_id, idempotency_key, received_at, span_id, trace_id"
_DELETION_COLUMNS = (
    "group_id, app, session_id, deleted_at, applied_at, trained_versions, dropped_tokens, version"
)
_NOT_DELETED = "NOT EXISTS (SELECT 1 FROM deletions WHERE deletions.group_id = ?)"


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One session as stored. Times are wall-clock seconds since the epoch."""

    group_id: str
    app: str
    session_id: str
    kind: str
    explored: bool
    trace_id: str
    started_at: float
    ended_at: float | None = None
    ended_by: str = ""
    state: Literal["awaiting", "decided", "published"] = "awaiting"
    decided_at: float | None = None
    reward: bytes | None = None
    """The serialised RewardAssigned, once decided (published again as it is)."""

    @property
    def view(self) -> str:
        """The state as the API reports it (one of VIEW_STATES)."""
        if self.state != "awaiting":
            return self.state
        return "open" if self.ended_at is None else "awaiting_feedback"


@dataclass(frozen=True, slots=True)
class StoredSignal:
    """One accepted signal, as stored."""

    name: str
    value: float
    response_id: str
    idempotency_key: str
    received_at: float
    span_id: str
    trace_id: str


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What is left of a deleted session: who it was, when it was deleted, and once the
    trainer answered (`applied_at` set), which policy versions had trained it."""

    group_id: str
    app: str
    session_id: str
    deleted_at: float
    applied_at: float | None = None
    trained_versions: tuple[int, ...] = ()
    dropped_tokens: int = 0
    version: int = 0
    """The trainer's policy version when it applied the deletion."""


SignalOutcome = Literal[
    "accepted", "duplicate", "unknown_session", "decided", "window_ended", "too_many", "deleted"
]


@dataclass(frozen=True, slots=True)
class SignalReceipt:
    """What became of a signal offered to the store."""

    outcome: SignalOutcome
    ended_at: float | None = None
    """The session's end, when it has ended (None also for an unknown session)."""
    same_content: bool = True
    """For a duplicate: whether the stored signal under that key has the same content."""


Judge = Callable[[SessionRecord, list[StoredSignal], float], bytes | None]
"""(session, its signals in arrival order, now) -> its serialised reward, or None to wait."""


class FeedbackStore:
    """The store; see the module docstring. Use from one thread (see StoreThread)."""

    def __init__(self, connection: sqlite3.Connection, window_s: float) -> None:
        self._db = connection
        self._window_s = window_s
        self.counts: dict[str, int] = {}
        """Sessions by view state, as of the last transaction (read from any thread)."""
        self._recount()

    @classmethod
    def open(cls, directory: Path, *, window_s: float) -> FeedbackStore:
        """Open (creating) the store in `directory`."""
        db = sqlite_store.connect(directory / STORE_FILE)
        db.executescript(_SCHEMA + _TRIGGERS)
        return cls(db, window_s)

    def close(self) -> None:
        """Close the file (idempotent: a closed connection closes again harmlessly)."""
        self._db.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with sqlite_store.transaction(self._db) as db:
            yield db
        self._recount()

    def _recount(self) -> None:
        rows = self._db.execute("SELECT view, n FROM session_counts").fetchall()
        self.counts = {view: int(n) for view, n in rows}

    # -- sessions ----------------------------------------------------------------------------

    def register(self, sessions: Iterable[SessionRecord]) -> int:
        """Record sessions (one transaction); a session already known, or deleted, is left
        as it is. Returns how many were new."""
        with self._transaction() as db:
            cursor = db.executemany(
                f"INSERT INTO sessions ({_SESSION_COLUMNS}) SELECT ?,?,?,?,?,?,?,?,?,?,?,? "
                f"WHERE {_NOT_DELETED} ON CONFLICT (group_id) DO NOTHING",
                ((*_row(s), s.group_id) for s in sessions),
            )
            return max(cursor.rowcount, 0)

    def end(self, session: SessionRecord) -> bool:
        """Record that `session` ended (`ended_at`, `ended_by` set), registering it when it
        is unknown. A session that already ended keeps its first end; a deleted one stays a
        tombstone. True when changed."""
        if session.ended_at is None:
            raise ValueError("SessionRecord.ended_at: required to end a session")
        with self._transaction() as db:
            cursor = db.execute(
                f"INSERT INTO sessions ({_SESSION_COLUMNS}) SELECT ?,?,?,?,?,?,?,?,?,?,?,? "
                f"WHERE {_NOT_DELETED} ON CONFLICT (group_id) DO UPDATE SET "
                "ended_at = excluded.ended_at, ended_by = excluded.ended_by "
                "WHERE sessions.ended_at IS NULL",
                (*_row(session), session.group_id),
            )
            return cursor.rowcount > 0

    def session(self, group_id: str) -> SessionRecord | None:
        row = self._db.execute(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE group_id = ?", (group_id,)
        ).fetchone()
        return None if row is None else _session(row)

    def signals(self, group_id: str) -> list[StoredSignal]:
        """The session's signals in the order they were accepted."""
        return _signals(self._db, group_id)

    # -- signals -----------------------------------------------------------------------------

    def add_signal(self, group_id: str, signal: StoredSignal) -> SignalReceipt:
        """Accept a signal for a session, once per idempotency key.

        A key already stored is a duplicate whatever the session's state (a retry of the
        signal that decided it finds it decided): nothing changes, `same_content` says
        whether the content matches. Otherwise the signal is refused when the session is
        deleted, unknown, decided, past its window (`signal.received_at` is now) or full.
        """
        with self._transaction() as db:
            head = db.execute(
                "SELECT state, ended_at FROM sessions WHERE group_id = ?", (group_id,)
            ).fetchone()
            if head is None:
                gone = db.execute("SELECT 1 FROM deletions WHERE group_id = ?", (group_id,))
                return SignalReceipt("deleted" if gone.fetchone() else "unknown_session")
            state, ended_at = head
            held = db.execute(
                f"SELECT {_SIGNAL_COLUMNS} FROM signals WHERE group_id = ? AND idempotency_key = ?",
                (group_id, signal.idempotency_key),
            ).fetchone()
            if held is not None:
                same = _same_content(StoredSignal(*held), signal)
                return SignalReceipt("duplicate", ended_at, same)
            if state != "awaiting":
                return SignalReceipt("decided", ended_at)
            if ended_at is not None and signal.received_at >= ended_at + self._window_s:
                return SignalReceipt("window_ended", ended_at)
            (count,) = db.execute(
                "SELECT count(*) FROM signals WHERE group_id = ?", (group_id,)
            ).fetchone()
            if count >= MAX_SIGNALS_PER_SESSION:
                return SignalReceipt("too_many", ended_at)
            db.execute(
                f"INSERT INTO signals (group_id, {_SIGNAL_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)",
                (
                    group_id,
                    signal.name,
                    signal.value,
                    signal.response_id,
                    signal.idempotency_key,
                    signal.received_at,
                    signal.span_id,
                    signal.trace_id,
                ),
            )
            return SignalReceipt("accepted", ended_at)

    # -- decisions ---------------------------------------------------------------------------

    def decide(self, group_ids: Sequence[str], now: float, judge: Judge) -> list[tuple[str, bytes]]:
        """Ask `judge` about each awaiting session of `group_ids`; store each reward it gives
        with the state decided, all in one transaction (what `judge` saw is what is stored:
        no signal can slip in between). Returns (group id, reward) of those decided now."""
        decided = []
        with self._transaction() as db:
            for group_id in group_ids:
                session = self.session(group_id)
                if session is None or session.state != "awaiting":
                    continue
                reward = judge(session, _signals(db, group_id), now)
                if reward is None:
                    continue
                _step(db, group_id, "awaiting", "decided", decided_at=now, reward=reward)
                decided.append((group_id, reward))
        return decided

    def mark_published(self, group_ids: Sequence[str]) -> None:
        """Record that these sessions' rewards are acknowledged (idempotent)."""
        with self._transaction() as db:
            for group_id in group_ids:
                _step(db, group_id, "decided", "published")

    def due(self, now: float, limit: int) -> list[str]:
        """Up to `limit` awaiting sessions whose window has ended by `now`, oldest end first."""
        rows = self._db.execute(
            "SELECT group_id FROM sessions WHERE state = 'awaiting' AND ended_at IS NOT NULL "
            "AND ended_at <= ? ORDER BY ended_at LIMIT ?",
            (now - self._window_s, limit),
        ).fetchall()
        return [group_id for (group_id,) in rows]

    def unpublished(self, after: str, limit: int) -> list[tuple[str, bytes]]:
        """Up to `limit` decided sessions not yet published, by group id after `after`."""
        rows = self._db.execute(
            "SELECT group_id, reward FROM sessions WHERE state = 'decided' AND group_id > ? "
            "ORDER BY group_id LIMIT ?",
            (after, limit),
        ).fetchall()
        return [(group_id, bytes(reward)) for group_id, reward in rows]

    def expire(self, before: float, limit: int) -> int:
        """Delete up to `limit` sessions (and their signals) that ended, or started and never
        ended, before `before`, and up to `limit` tombstones of deletions before `before`.
        Returns how many were deleted."""
        with self._transaction() as db:
            old = db.execute(
                "SELECT group_id FROM sessions WHERE coalesce(ended_at, started_at) < ? LIMIT ?",
                (before, limit),
            ).fetchall()
            db.executemany("DELETE FROM signals WHERE group_id = ?", old)
            db.executemany("DELETE FROM sessions WHERE group_id = ?", old)
            tombs = db.execute(
                "SELECT group_id FROM deletions WHERE deleted_at < ? LIMIT ?", (before, limit)
            ).fetchall()
            db.executemany("DELETE FROM deletions WHERE group_id = ?", tombs)
            return len(old) + len(tombs)

    # -- deletions ---------------------------------------------------------------------------

    def delete(self, group_id: str, now: float) -> Tombstone | None:
        """Delete a session: its row, signals and reward go, a tombstone stays (one
        transaction), then a TRUNCATE checkpoint moves the overwritten pages into the file
        and empties the WAL. Idempotent: a session already deleted answers its tombstone as
        it is. None, changing nothing, for a session the store does not know."""
        with self._transaction() as db:
            tomb = self.tombstone(group_id)
            if tomb is not None:
                return tomb
            head = db.execute(
                "SELECT app, session_id FROM sessions WHERE group_id = ?", (group_id,)
            ).fetchone()
            if head is None:
                return None
            db.execute("DELETE FROM signals WHERE group_id = ?", (group_id,))
            db.execute("DELETE FROM sessions WHERE group_id = ?", (group_id,))
            db.execute(
                "INSERT INTO deletions (group_id, app, session_id, deleted_at) VALUES (?,?,?,?)",
                (group_id, *head, now),
            )
        if not sqlite_store.truncate_wal(self._db):
            log.warning("feedback store checkpoint blocked: the log is emptied later")
        return Tombstone(group_id, head[0], head[1], now)

    def tombstone(self, group_id: str) -> Tombstone | None:
        """The session's tombstone, None when it is not deleted."""
        row = self._db.execute(
            f"SELECT {_DELETION_COLUMNS} FROM deletions WHERE group_id = ?", (group_id,)
        ).fetchone()
        if row is None:
            return None
        group, app, session_id, deleted_at, applied_at, versions, dropped, version = row
        trained = tuple(int(v) for v in versions.split(",") if v)
        return Tombstone(
            group, app, session_id, deleted_at, applied_at, trained, int(dropped), int(version)
        )

    def applied(
        self, group_id: str, trained_versions: Sequence[int], dropped_tokens: int, version: int,
        now: float,
    ) -> bool:  # fmt: skip
        """Record the trainer's answer on the tombstone (the first answer counts). True when
        recorded now; False for a session not deleted here or already answered."""
        with self._transaction() as db:
            cursor = db.execute(
                "UPDATE deletions SET applied_at = ?, trained_versions = ?, dropped_tokens = ?, "
                "version = ? WHERE group_id = ? AND applied_at IS NULL",
                (now, ",".join(str(v) for v in trained_versions), dropped_tokens, version,
                 group_id),
            )  # fmt: skip
            return cursor.rowcount > 0


def _step(db: sqlite3.Connection, group_id: str, old: str, new: str, **values: object) -> None:
    assert _STEPS[old] == new, f"{old} -> {new} is not a session transition"
    sets = "".join(f", {column} = ?" for column in values)
    db.execute(
        f"UPDATE sessions SET state = ?{sets} WHERE group_id = ? AND state = ?",
        (new, *values.values(), group_id, old),
    )


def _signals(db: sqlite3.Connection, group_id: str) -> list[StoredSignal]:
    rows = db.execute(
        f"SELECT {_SIGNAL_COLUMNS} FROM signals WHERE group_id = ? ORDER BY seq", (group_id,)
    ).fetchall()
    return [StoredSignal(*row) for row in rows]


def _same_content(held: StoredSignal, offered: StoredSignal) -> bool:
    return (held.name, held.value, held.response_id) == (
        offered.name,
        offered.value,
        offered.response_id,
    )


def _row(s: SessionRecord) -> tuple[object, ...]:
    """The session as a row of _SESSION_COLUMNS (not dataclasses.astuple, which deep-copies
    every value of every row)."""
    return (s.group_id, s.app, s.session_id, s.kind, s.explored, s.trace_id, s.started_at,
            s.ended_at, s.ended_by, s.state, s.decided_at, s.reward)  # fmt: skip


def _session(row: tuple[Any, ...]) -> SessionRecord:
    group_id, app, session_id, kind, explored, *rest = row
    return SessionRecord(group_id, app, session_id, kind, bool(explored), *rest)


P = ParamSpec("P")
T = TypeVar("T")


class StoreThread:
    """Runs a FeedbackStore on one thread of its own: the connection is made, used and
    closed there, and calls queue in submission order (so they are serialised, and a
    caller's fsync never blocks the event loop). A call whose awaiting coroutine is
    cancelled still runs to its end: what it commits stays committed."""

    def __init__(self, open_store: Callable[[], FeedbackStore]) -> None:
        self._open = open_store
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="feedback-store")
        self._store: FeedbackStore | None = None

    async def start(self) -> None:
        self._store = await self._run(self._open)

    @property
    def counts(self) -> dict[str, int]:
        """Sessions by view state, as of the last transaction."""
        return {} if self._store is None else self._store.counts

    async def call(
        self, method: Callable[Concatenate[FeedbackStore, P], T], *args: P.args, **kwargs: P.kwargs
    ) -> T:
        """`method(store, *args, **kwargs)` on the store's thread."""
        store = self._store
        if store is None:
            raise RuntimeError("the feedback store is not open")
        return await self._run(lambda: method(store, *args, **kwargs))

    async def close(self) -> None:
        """Close the store and end its thread (idempotent)."""
        store, self._store = self._store, None
        if store is not None:
            await self._run(store.close)
        self._executor.shutdown(wait=False)

    async def _run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)
