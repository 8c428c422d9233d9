"""The controller's episode directories go after their retention, never a live one."""

from __future__ import annotations

import os
import time
from pathlib import Path

from harnessrl.services.controller.retention import prune


def _run(root: Path, name: str, age_s: float, now: float) -> Path:
    run = root / name
    (run / "out").mkdir(parents=True)
    (run / "out" / "stdout").write_text("...")
    for path in (run / "out" / "stdout", run / "out", run):
        os.utime(path, (now - age_s, now - age_s))
    return run


def test_directories_unchanged_past_the_retention_are_deleted_and_the_rest_kept(
    tmp_path: Path,
) -> None:
    now = time.time()
    old = _run(tmp_path, "g-1-0-1", 8 * 86_400, now)
    recent = _run(tmp_path, "g-2-0-1", 3600, now)
    live = _run(tmp_path, "g-3-0-1", 9 * 86_400, now)
    (live / "progress.json").write_text("{}")  # a run in progress writes: it is new again
    (tmp_path / "stack.json").write_text("{}")  # not a run directory: left alone
    assert prune(tmp_path, 7 * 86_400, now=now) == 1
    assert not old.exists() and recent.exists() and live.exists()
    assert (tmp_path / "stack.json").exists()
    assert prune(tmp_path / "missing", 60, now=now) == 0
