"""`swe synth`'s settings: how many baseline runs, candidates and tasks, and how candidates
are drawn, checked and cut."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SynthSettings:
    runs: int = 3
    """Baseline runs: a test is reliable when it PASSED in every one."""
    candidates: int = 150
    """Most candidate bugs checked per project."""
    per_project: int = 40
    """Most tasks kept per project (checking stops there)."""
    max_fail_to_pass: int = 20
    """Most tests one bug may break (more: the bug is not a focused task)."""
    seed: int = 0
    """Which candidates are drawn, and in which order."""
    jobs: int = 2
    """Candidates checked at once (one test run each)."""
    timeout_factor: float = 6.0
    """A candidate's run is cut at this many times the baseline's (plus 30 s)."""
    full_suite_s: float = 120.0
    """A task runs the whole suite when the baseline run takes at most this many seconds,
    else the test files of its failing tests."""
    hold_back: bool = True
    """Hold back half of the failing test functions from the harness (see `holdback`)."""
