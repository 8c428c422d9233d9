"""The one way the services open a SQLite store of their own (the production sessions'
stores of the reward service and the sample builder), so each keeps the same promises:

- durable: write-ahead log, `synchronous=FULL` (a committed transaction survives a power
  loss, not only a process death);
- forgetful: `secure_delete=ON`, deleted content is overwritten in the file, never left in
  free pages; `truncate_wal` empties the log after a deletion, so a deleted body is in
  neither file;
- one writer: `transaction` takes the write lock at its start (BEGIN IMMEDIATE), so a
  transaction never fails half-way for want of it, and rolls back whatever raised.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def connect(path: Path, *, any_thread: bool = False) -> sqlite3.Connection:
    """The store at `path` (created with its directory), in autocommit mode: changes are
    made inside `transaction`. `any_thread` lets another thread than the opener use it
    (one at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=not any_thread)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA secure_delete=ON")
    return db


@contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """One write transaction: committed when the block ends, rolled back if it raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def truncate_wal(db: sqlite3.Connection) -> bool:
    """Copy the log into the database file and empty it; False when a reader held it back
    (the content is then deleted from the log at the next checkpoint)."""
    busy, _, _ = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
    return not busy
