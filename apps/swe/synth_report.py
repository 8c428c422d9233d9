"""What `swe synth` reports: per project, the counts of each stage, the drop reasons and the
wall time per stage (`StageClock`); over the run, their sums (`run_summary`, report.json).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harnessrl.apps.swe.synth_settings import SynthSettings


@dataclass(slots=True)
class ProjectReport:
    project: str
    stage_seconds: dict[str, float] = field(default_factory=dict)
    reliable: int = 0
    flaky: int = 0
    baseline_seconds: float = 0.0
    mutations: int = 0
    """Candidate bugs the project's code has (before sampling)."""
    candidates: int = 0
    checked: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "project": self.project,
            "reliable_tests": self.reliable,
            "flaky_tests": self.flaky,
            "baseline_seconds": round(self.baseline_seconds, 2),
            "mutations": self.mutations,
            "candidates": self.candidates,
            "checked": self.checked,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
            "stage_seconds": {k: round(v, 1) for k, v in self.stage_seconds.items()},
            **({"error": self.error} if self.error else {}),
        }


def count(report: ProjectReport, status: str) -> None:
    """A checked candidate's verdict in the report (a drop reason unless it was kept)."""
    if status != "kept":
        report.dropped[status] += 1


class StageClock:
    """Adds each stage's wall time to the report."""

    def __init__(self, report: ProjectReport) -> None:
        self._report = report

    def __call__(self, stage: str) -> _Timed:
        return _Timed(self._report, stage)


class _Timed:
    def __init__(self, report: ProjectReport, stage: str) -> None:
        self._report, self._stage = report, stage

    def __enter__(self) -> None:
        self._started = time.monotonic()

    def __exit__(self, *_: object) -> None:
        seconds = time.monotonic() - self._started
        self._report.stage_seconds[self._stage] = (
            self._report.stage_seconds.get(self._stage, 0.0) + seconds
        )


def run_summary(
    reports: list[ProjectReport],
    records: list[dict[str, Any]],
    settings: SynthSettings,
    out: Path,
    seconds: float,
) -> dict[str, Any]:
    """report.json: the run's tasks and counts, its settings, and each project's report."""
    dropped: Counter[str] = Counter()
    for report in reports:
        dropped.update(report.dropped)
    return {
        "tasks": len(records),
        "projects_with_tasks": len({r["project"] for r in records}),
        "candidates": sum(r.candidates for r in reports),
        "checked": sum(r.checked for r in reports),
        "kept": sum(r.kept for r in reports),
        "dropped": dict(sorted(dropped.items())),
        "errors": sum(1 for r in reports if r.error),
        "wall_seconds": round(seconds, 1),
        "settings": {name: getattr(settings, name) for name in SynthSettings.__dataclass_fields__},
        "projects": [r.as_json() for r in reports],
        "tasks_file": str(out / "tasks.jsonl"),
    }
