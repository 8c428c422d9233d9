"""The canary judge's durable record of the sessions it counts: one row per session.

One SQLite file, `<production.store>/canary.sqlite` (harnessrl.sqlite_store: WAL,
synchronous FULL, so a write that returned survives a crash). A production session served
while a canary was pending is recorded when it ends: its candidate, its arm and which
guards it failed, keyed by its group id, so a redelivered end changes nothing. Its reward
is recorded once, when it is decided (none: it counts for its guards only), numbered in the
order rewards were decided. `observations` hands rows back in those two orders, so the
judge rebuilds exactly the sums (the same floats) it held before a restart. A candidate's
rows are dropped once it is decided (`drop`): they hold numbers, never content.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from harnessrl import sqlite_store

STORE_FILE = "canary.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS canary_sessions (
    group_id TEXT PRIMARY KEY,
    candidate INTEGER NOT NULL,
    arm TEXT NOT NULL CHECK (arm IN ('stable', 'candidate')),
    failures TEXT NOT NULL,
    decided INTEGER NOT NULL DEFAULT 0,
    reward REAL,
    reward_seq INTEGER UNIQUE
);
CREATE INDEX IF NOT EXISTS canary_sessions_candidate ON canary_sessions (candidate);
"""


@dataclass(frozen=True, slots=True)
class Observation:
    """One ended session of a canary: which candidate was pending, the arm it was served
    by, and each guard it failed (every guard of rollout.GUARDS, by name)."""

    group_id: str
    candidate: int
    arm: str
    failures: dict[str, bool]


@dataclass(frozen=True, slots=True)
class Recorded:
    """A candidate's rows: its sessions in the order they ended, and (arm, reward) of the
    rewarded ones in the order their rewards were decided."""

    sessions: list[Observation]
    rewards: list[tuple[str, float]]


class CanaryStore:
    """The store (see the module docstring); one caller at a time, from any thread."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / STORE_FILE
        self._db = sqlite_store.connect(self.path, any_thread=True)
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Idempotent."""
        self._db.close()

    def ended(self, observation: Observation) -> bool:
        """Record an ended session; True when it is new (a session already recorded keeps
        its first row)."""
        o = observation
        failures = orjson.dumps(o.failures, option=orjson.OPT_SORT_KEYS).decode()
        with sqlite_store.transaction(self._db) as db:
            cursor = db.execute(
                "INSERT INTO canary_sessions (group_id, candidate, arm, failures) "
                "VALUES (?, ?, ?, ?) ON CONFLICT (group_id) DO NOTHING",
                (o.group_id, o.candidate, o.arm, failures),
            )
            return cursor.rowcount > 0

    def decided(self, group_id: str, reward: float | None) -> Observation | None:
        """Record a recorded session's reward (None: decided without one); the session when
        recorded now, None for a session not recorded here or decided already."""
        with sqlite_store.transaction(self._db) as db:
            row = db.execute(
                "SELECT group_id, candidate, arm, failures FROM canary_sessions "
                "WHERE group_id = ? AND decided = 0",
                (group_id,),
            ).fetchone()
            if row is None:
                return None
            db.execute(
                "UPDATE canary_sessions SET decided = 1, reward = ?, reward_seq = CASE WHEN "
                "? IS NULL THEN NULL ELSE (SELECT coalesce(max(reward_seq), 0) + 1 "
                "FROM canary_sessions) END WHERE group_id = ?",
                (reward, reward, group_id),
            )
            return _observation(row)

    def observations(self, candidate: int) -> Recorded:
        """What is recorded of `candidate`'s sessions (see Recorded)."""
        sessions = self._db.execute(
            "SELECT group_id, candidate, arm, failures FROM canary_sessions "
            "WHERE candidate = ? ORDER BY rowid",
            (candidate,),
        ).fetchall()
        rewards = self._db.execute(
            "SELECT arm, reward FROM canary_sessions WHERE candidate = ? AND reward_seq "
            "IS NOT NULL ORDER BY reward_seq",
            (candidate,),
        ).fetchall()
        return Recorded([_observation(r) for r in sessions], [(a, float(r)) for a, r in rewards])

    def candidates(self) -> list[int]:
        """The candidates with recorded sessions."""
        rows = self._db.execute("SELECT DISTINCT candidate FROM canary_sessions").fetchall()
        return sorted(int(c) for (c,) in rows)

    def drop(self, candidate: int) -> int:
        """Delete a decided candidate's rows; how many."""
        with sqlite_store.transaction(self._db) as db:
            cursor = db.execute("DELETE FROM canary_sessions WHERE candidate = ?", (candidate,))
            return max(cursor.rowcount, 0)


def _observation(row: tuple[Any, ...]) -> Observation:
    group_id, candidate, arm, failures = row
    return Observation(group_id, int(candidate), arm, orjson.loads(failures))
