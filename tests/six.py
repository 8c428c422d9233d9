"""The pinned six (and tabulate), fetched and with its environment, shared by the integration
tests of harnessrl.apps.swe and builtin:tests (the `six_ready` and `tabulate_ready` session
fixtures): built once, at the paths `harnessrl swe synth --out root` uses, so a synth run
there reuses them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harnessrl.apps.swe.env import environment
from harnessrl.apps.swe.fetch import checkout
from harnessrl.apps.swe.projects import Project, pinned


@dataclass(frozen=True)
class SixReady:
    project: Project
    checkout: Path
    """The pristine checkout (a git repository of one commit): copy it before changing it."""
    env: Path
    root: Path
    """`--out` for a synth run that reuses both."""


def prepare_six(root: Path) -> SixReady:
    return prepare_project("six", root)


def prepare_project(name: str, root: Path) -> SixReady:
    """A pinned project fetched (its sdist from the package index) and its environment
    built, at the paths `harnessrl swe synth --out root` uses."""
    (project,) = pinned([name])
    repo = checkout(project, root / "work" / "checkouts", root / "work" / "sdists")
    return SixReady(project, repo, environment(project, root / "envs"), root)
