"""`swe synth`'s check stage: each candidate bug runs the whole suite once, in a copy of
the project, and is kept or dropped with a reason; results go to a results file line by
line, so a rerun resumes where a run stopped.

FAIL_TO_PASS is the reliable tests that no longer pass. A candidate is kept when
1 <= |FAIL_TO_PASS| <= `max_fail_to_pass` and no kept task of the project has the same
FAIL_TO_PASS, at most `per_project` per project (a bug that stops pytest itself is dropped
as `runner_broken`; one whose run does not add up under the guard as `unguarded`). A kept
candidate becomes a task (task_record.py).
"""

from __future__ import annotations

import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from harnessrl.apps.swe import env as envs
from harnessrl.apps.swe.candidates import Candidate
from harnessrl.apps.swe.repository import export
from harnessrl.apps.swe.synth_report import ProjectReport, count
from harnessrl.apps.swe.synth_settings import SynthSettings
from harnessrl.apps.swe.task_record import TaskSource, task_record


@dataclass(slots=True)
class BugCheck:
    """One project's check stage: what every candidate's check reads and updates."""

    source: TaskSource
    settings: SynthSettings
    report: ProjectReport
    timeout_s: float
    """A candidate's run is cut here."""
    kept_sets: set[tuple[str, ...]]
    kept: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, candidate: Candidate, copy: Path) -> dict[str, Any]:
        """The candidate's result: {"status": "kept", "record": ...} or the drop reason
        ("skipped" once enough are kept: not recorded, so a larger run checks it)."""
        with self.lock:
            if self.kept >= self.settings.per_project:
                return {"status": "skipped"}
        run = self._run(candidate, copy)
        if isinstance(run, dict):
            return run
        broken = sorted(t for t in self.source.reliable if run.outcomes.get(t) != "PASSED")
        if not broken:
            return {"status": "no_failing_tests"}
        if len(broken) > self.settings.max_fail_to_pass:
            return {"status": "too_many_failing_tests", "broken": len(broken)}
        with self.lock:
            if tuple(broken) in self.kept_sets:
                return {"status": "duplicate_failing_tests"}
            if self.kept >= self.settings.per_project:
                return {"status": "skipped"}
            self.kept_sets.add(tuple(broken))
            self.kept += 1
        started = time.monotonic()
        record = task_record(self.source, candidate, broken, run)
        with self.lock:
            stages = self.report.stage_seconds
            stages["task"] = stages.get("task", 0.0) + time.monotonic() - started
        return {"status": "kept", "FAIL_TO_PASS": broken, "record": record}

    def _run(self, candidate: Candidate, copy: Path) -> envs.TestRun | dict[str, Any]:
        """The suite's run with the bug in `copy` (restored after), or the drop reason of a
        run that says nothing of the bug."""
        project, mutation = self.source.project, candidate.mutation
        target = copy / mutation.path
        original = target.read_bytes()
        target.write_bytes(mutation.source.encode("utf-8"))
        try:
            run = envs.run_command(
                self.source.command, copy, self.timeout_s, project.requirement, [project.tests]
            )
        except envs.EnvError:  # the bug stops pytest itself (a conftest that cannot import)
            return {"status": "runner_broken"}
        finally:
            target.write_bytes(original)
        if run.timed_out:
            return {"status": "timeout"}
        if run.problems:  # the run does not add up under the guard: no task of it
            return {"status": "unguarded", "problems": list(run.problems)}
        return run


def check_all(
    job: BugCheck,
    todo: list[Candidate],
    scratch: Path,
    results_path: Path,
    on_progress: Callable[[str, int, int], None] | None,
) -> None:
    """Check `todo` with `settings.jobs` workers, each in its own copy of the project under
    `scratch`, appending each result (but "skipped") to `results_path`."""
    if not todo:
        return
    jobs = max(1, min(job.settings.jobs, len(todo)))
    copies: queue.Queue[Path] = queue.Queue()
    for i in range(jobs):
        copy = scratch / f"copy-{i}"
        if copy.exists():
            shutil.rmtree(copy)
        export(job.source.pristine, copy)
        copies.put(copy)
    write_lock = threading.Lock()
    report = job.report
    total = report.checked + len(todo)

    def one(candidate: Candidate) -> None:
        copy = copies.get()
        try:
            result = job.check(candidate, copy)
        finally:
            copies.put(copy)
        if result["status"] == "skipped":
            return
        line = orjson.dumps({"key": candidate.key, **result}) + b"\n"
        with write_lock:
            with results_path.open("ab") as f:
                f.write(line)
            report.checked += 1
            count(report, result["status"])
            if on_progress is not None:
                on_progress(report.project, report.checked, total)

    with ThreadPoolExecutor(jobs, thread_name_prefix="swe-check") as pool:
        for future in [pool.submit(one, c) for c in todo]:
            future.result()
    for i in range(jobs):
        shutil.rmtree(scratch / f"copy-{i}", ignore_errors=True)


def read_results(path: Path) -> dict[str, dict[str, Any]]:
    """The results file by candidate key (a line a kill cut short is left out)."""
    results: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return results
    for raw in path.read_bytes().splitlines():
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue  # a line cut by a kill: that candidate is checked again
        if isinstance(item, dict) and isinstance(item.get("key"), str):
            results[item["key"]] = item
    return results
