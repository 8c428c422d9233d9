"""The controller's episode directories are kept for `controller.episode_retention_s`, not
forever: a run's directory (its stdout, stderr, result, progress and whatever the harness
wrote) is deleted once nothing in it has changed for that long. A run in progress always
changes within its timeout, so it is never touched; the sweep runs every tenth of the
retention (at most hourly) and at start."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from harnessrl.logs import get_logger

log = get_logger(__name__)


def newest_change(directory: Path) -> float:
    """The latest modification time of `directory` and anything below it."""
    newest = directory.stat().st_mtime
    for root, dirs, files in os.walk(directory):
        for name in [*dirs, *files]:
            try:
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
            except OSError:
                continue  # removed meanwhile
    return newest


def prune(workdir: Path, older_than_s: float, now: float | None = None) -> int:
    """Delete the run directories under `workdir` unchanged for `older_than_s`; how many."""
    now = time.time() if now is None else now
    if not workdir.is_dir():
        return 0
    removed = 0
    for entry in workdir.iterdir():
        if not entry.is_dir() or entry.is_symlink():
            continue
        try:
            if now - newest_change(entry) < older_than_s:
                continue
        except OSError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    if removed:
        log.info("episode directories pruned", removed=removed, older_than_s=older_than_s)
    return removed
