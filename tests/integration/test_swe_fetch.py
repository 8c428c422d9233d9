"""A pinned project fetched from the package index (PyPI, or the mirror pip is configured
with) into a git repository: checked against its pin, the same commit id every time."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from harnessrl.apps.swe.fetch import FetchError, checkout
from harnessrl.apps.swe.projects import PINNED, pinned

pytestmark = pytest.mark.integration


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_a_pinned_sdist_becomes_one_reproducible_commit(tmp_path: Path) -> None:
    (six,) = pinned(["six"])
    repo = checkout(six, tmp_path / "a")
    assert repo.name == "six-1.17.0"
    files = set(_git(repo, "ls-files").splitlines())
    assert {"six.py", "test_six.py", "setup.py"} <= files
    assert not any(".egg-info" in f or f == "PKG-INFO" for f in files)
    assert _git(repo, "rev-list", "--count", "HEAD") == "1"
    assert _git(repo, "status", "--porcelain") == ""
    again = checkout(six, tmp_path / "b", downloads=tmp_path / "a" / "sdists")
    assert _git(again, "rev-parse", "HEAD") == _git(repo, "rev-parse", "HEAD")
    assert checkout(six, tmp_path / "a") == repo  # reused as it is


def test_an_sdist_that_does_not_match_its_pin_is_refused(tmp_path: Path) -> None:
    (six,) = pinned(["six"])
    forged = dataclasses.replace(six, sha256="0" * 64)
    with pytest.raises(FetchError, match=r"sha256 ff70335d.*pinned 0000"):
        checkout(forged, tmp_path)
    assert not list((tmp_path / "sdists").iterdir())  # the unpinned archive is not kept
    assert not (tmp_path / "six-1.17.0").exists()


def test_the_pins_name_at_least_eight_projects() -> None:
    assert len({p.name for p in PINNED}) >= 8
    with pytest.raises(ValueError, match=r"unknown project.*nope"):
        pinned(["nope"])
    assert pinned(["tabulate==0.8.10"])[0].name == "tabulate"
