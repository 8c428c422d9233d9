"""Episodes opened by hand on a running stack (`harnessrl episode open`), recorded beside
its stack file so that `harnessrl episode close` needs only the episode id.

One JSON line per episode, appended under an exclusive lock, so two `open`s at once get
distinct ids. The file is private (0600) like the stack file, and goes with it when the
stack stops: the episodes' tokens are signed with that run's secret.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from harnessrl.apps.up.stackfile import PRIVATE, StackFileError
from harnessrl.episode_token import Mode


@dataclass(frozen=True, slots=True)
class ManualEpisode:
    episode_id: str
    attempt: int
    group_id: str
    mode: Mode
    expires_at: float
    """Unix seconds: when its token stops working."""


def record_new(path: Path, group_id: str, mode: Mode, expires_at: float) -> ManualEpisode:
    """Record a new episode of `group_id` (attempt 1) in `path` and return it. Its id is
    `<group_id>-manual-<n>`, n counting the group's episodes recorded there before: the
    controller names its episodes `<group_id>-<n>`, so the two never collide, even in a
    group the controller runs. Raises StackFileError when `path` is not such a record."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, PRIVATE)
    with os.fdopen(fd, "r+", encoding="utf-8") as record:
        fcntl.flock(record, fcntl.LOCK_EX)  # released when the file is closed
        os.fchmod(record.fileno(), PRIVATE)
        index = sum(1 for e in _parse(path, record.read()) if e.group_id == group_id)
        episode = ManualEpisode(f"{group_id}-manual-{index}", 1, group_id, mode, expires_at)
        record.write(json.dumps(dataclasses.asdict(episode)) + "\n")
    return episode


def find(path: Path, episode_id: str) -> ManualEpisode | None:
    """The episode recorded in `path` under `episode_id` (None when it is not there, or
    there is no record). Raises StackFileError when `path` is not such a record."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    found = [e for e in _parse(path, text) if e.episode_id == episode_id]
    return found[-1] if found else None


def _parse(path: Path, text: str) -> list[ManualEpisode]:
    episodes = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
            mode = data["mode"]
            if mode not in ("train", "val"):
                raise ValueError(f"mode {mode!r}")
            episodes.append(
                ManualEpisode(
                    episode_id=str(data["episode_id"]),
                    attempt=int(data["attempt"]),
                    group_id=str(data["group_id"]),
                    mode=mode,
                    expires_at=float(data["expires_at"]),
                )
            )
        except (ValueError, KeyError, TypeError) as err:
            raise StackFileError(f"{path}:{number}: not a recorded episode ({err})") from err
    return episodes
