"""A project's test suite on its pristine tree: which tests pass reliably, which are flaky,
which fail, how long a run takes (`swe synth`'s baseline stage).

Every run is jailed and guarded as builtin:tests runs it (`env.run_command`); a baseline
whose runs do not add up under the guard, or in which no test passes, is an EnvError: no
task can be made of that project in that environment.
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import orjson

from harnessrl.apps.swe import env as envs
from harnessrl.apps.swe.projects import Project
from harnessrl.apps.swe.repository import export

BASELINE_RECIPE = 2
"""In baseline.json: a baseline measured by an older recipe (unguarded runs, no failing
tests recorded) is measured again."""


@dataclass(frozen=True, slots=True)
class Baseline:
    reliable: list[str]
    """PASSED in every run."""
    flaky: list[str]
    """PASSED in some runs only."""
    failing: list[str]
    """FAILED or ERROR in some run."""
    seconds: float
    """Median run time."""


def measure(project: Project, pristine: Path, env: Path, runs: int, scratch: Path) -> Baseline:
    """The suite's baseline on the pristine tree, cached in scratch/baseline.json."""
    cache = scratch / "baseline.json"
    if cache.is_file():
        data = orjson.loads(cache.read_bytes())
        if data.get("runs") == runs and data.get("recipe") == BASELINE_RECIPE:
            return Baseline(data["reliable"], data["flaky"], data["failing"], data["seconds"])
    scratch.mkdir(parents=True, exist_ok=True)
    copy = scratch / "baseline-copy"
    if copy.exists():
        shutil.rmtree(copy)
    export(pristine, copy)
    try:
        command = envs.pytest_command(project, env)
        done = [
            envs.run_command(command, copy, 1800.0, project.requirement, [project.tests])
            for _ in range(max(1, runs))
        ]
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if any(run.timed_out for run in done):
        raise envs.EnvError(f"{project.requirement}: the baseline run timed out")
    problems = sorted({p for run in done for p in run.problems})
    if problems:
        raise envs.EnvError(f"{project.requirement}: the guarded baseline run: {problems}")
    passed = [run.passed for run in done]
    reliable = sorted(set.intersection(*passed))
    if not reliable:
        raise envs.EnvError(f"{project.requirement}: no test passes at baseline")
    baseline = Baseline(
        reliable,
        sorted(set.union(*passed) - set(reliable)),
        sorted({t for run in done for t, o in run.outcomes.items() if o in ("FAILED", "ERROR")}),
        statistics.median(run.seconds for run in done),
    )
    cache.write_bytes(
        orjson.dumps(
            {
                "runs": runs,
                "recipe": BASELINE_RECIPE,
                "reliable": baseline.reliable,
                "flaky": baseline.flaky,
                "failing": baseline.failing,
                "seconds": baseline.seconds,
            }
        )
    )
    return baseline
