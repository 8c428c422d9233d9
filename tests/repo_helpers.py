"""Small real git repositories for tests, and patches against them.

Commits are made with an identity given on the command line, so they work on a machine
where git has none configured.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harnessrl.services.reward.episode import Episode, standalone_episode

_IDENTITY = ("-c", "user.name=harnessrl tests", "-c", "user.email=tests@harnessrl.invalid")

PYTEST = (
    "env",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1",  # the venv's plugins add ~1.5 s to each run
    sys.executable,
    "-m",
    "pytest",
    "-p",
    "no:cacheprovider",
    "-q",
)
"""The start of a test command running this venv's pytest in a task's repository."""


def git(cwd: Path, *args: str) -> str:
    """Run git in `cwd`; its stdout. Fails the test on a non-zero exit."""
    done = subprocess.run(
        ["git", *_IDENTITY, *args], cwd=cwd, check=True, capture_output=True, text=True
    )
    return done.stdout


def write_files(root: Path, files: Mapping[str, str | None]) -> None:
    """Write each file (parents made); None deletes it."""
    for name, text in files.items():
        path = root / name
        if text is None:
            path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)


def make_repo(path: Path, files: Mapping[str, str]) -> str:
    """A repository at `path` with one commit holding `files`; the commit's sha."""
    path.mkdir(parents=True)
    git(path, "init", "--quiet", "--initial-branch=main")
    write_files(path, files)
    git(path, "add", "--all")
    git(path, "commit", "--quiet", "-m", "base")
    return git(path, "rev-parse", "HEAD").strip()


def patch_for(repo: Path, work: Path, changes: Mapping[str, str | None]) -> str:
    """The unified diff (git's form, renames detected) that makes `changes` to `repo`'s HEAD.

    Made in a clone at `work`, so `repo` itself is never touched. A change maps a path to
    its new text; None deletes it.
    """
    subprocess.run(["git", "clone", "--quiet", str(repo), str(work)], check=True)
    write_files(work, changes)
    git(work, "add", "--all")
    return git(work, "diff", "--cached", "-M")


def coding_episode(
    metadata: Mapping[str, Any], *, result: Any = None, artifacts_dir: Path | None = None
) -> Episode:
    """A finished episode of a coding task, as the reward service would build it."""
    return standalone_episode(
        metadata, result=result, artifacts_dir=artifacts_dir, task_input={"prompt": "fix the bug"}
    )
