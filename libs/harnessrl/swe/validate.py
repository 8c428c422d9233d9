"""`swe clean --validate`: each task checked in its own environment, as the reward will run it.

A task is valid when, in a fresh clone of its repository at its base commit (with its
`test_patch` applied, when it has one), in each of `runs` rounds:

- before the gold patch: no FAIL_TO_PASS test passes, every PASS_TO_PASS test passes;
- after it (it must apply): every FAIL_TO_PASS and PASS_TO_PASS test passes.

"Passes" means pytest reported PASSED: a skipped, xfailed or missing test does not. Repeating
the rounds drops the flaky tasks. The environment is the record's `extra.environment` (a venv)
and the command `extra.test_command` (an argv with `{junit_xml}`, run in the clone's root), as
`swe synth` writes them; an imported task gets them from `clean --environment/--test-command`.
A task without them cannot be validated: it is dropped as `validation:no_environment`.

Drop reasons: validation:no_environment, validation:clone_failed,
validation:test_patch_failed, validation:patch_failed, validation:timeout,
validation:fail_to_pass_passes_before, validation:pass_to_pass_fails_before,
validation:fail_to_pass_fails_after, validation:pass_to_pass_fails_after.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from harnessrl.swe.env import EnvError, TestRun, run_command
from harnessrl.swe.tasks import SweTask


@dataclass(frozen=True, slots=True)
class ValidateSettings:
    runs: int = 2
    """Rounds (before and after the gold patch) a task must pass."""
    timeout_s: float = 600.0
    """Per test run."""
    jobs: int = 2
    """Tasks validated at once."""


def command_of(task: SweTask) -> list[str] | None:
    """The task's test command (an argv), or None when the record has none."""
    command = task.extra.get("test_command")
    if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        return list(command)
    return None


def validate(task: SweTask, settings: ValidateSettings, scratch: Path | None = None) -> str | None:
    """None when the task is valid, else the drop reason (see the module docstring)."""
    command = command_of(task)
    if command is None:
        return "validation:no_environment"
    work = Path(tempfile.mkdtemp(prefix="swe-validate-", dir=scratch))
    try:
        for round_ in range(max(1, settings.runs)):
            reason = _round(task, command, settings.timeout_s, work / f"round-{round_}")
            if reason is not None:
                return reason
        return None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _round(task: SweTask, command: list[str], timeout_s: float, work: Path) -> str | None:
    """One round in a fresh clone: before and after the gold patch."""
    work.mkdir(parents=True)
    copy = work / "repo"
    if not _clone(task, copy):
        return "validation:clone_failed"
    if task.test_patch.strip() and not _apply(copy, task.test_patch, work / "test.diff"):
        return "validation:test_patch_failed"
    before = _run(command, copy, timeout_s)
    if before is None:
        return "validation:timeout"
    if any(before.outcomes.get(t) == "PASSED" for t in task.fail_to_pass):
        return "validation:fail_to_pass_passes_before"
    if any(before.outcomes.get(t) != "PASSED" for t in task.pass_to_pass):
        return "validation:pass_to_pass_fails_before"
    if not _apply(copy, task.patch, work / "gold.diff"):
        return "validation:patch_failed"
    after = _run(command, copy, timeout_s)
    if after is None:
        return "validation:timeout"
    if any(after.outcomes.get(t) != "PASSED" for t in task.fail_to_pass):
        return "validation:fail_to_pass_fails_after"
    if any(after.outcomes.get(t) != "PASSED" for t in task.pass_to_pass):
        return "validation:pass_to_pass_fails_after"
    return None


def validate_all(
    tasks: Iterable[SweTask],
    settings: ValidateSettings,
    on_done: Callable[[SweTask, str | None], None] | None = None,
) -> list[tuple[SweTask, str | None]]:
    """Every task's verdict, in input order; `jobs` at once."""
    items = list(tasks)

    def one(task: SweTask) -> tuple[SweTask, str | None]:
        try:
            reason = validate(task, settings)
        except EnvError:
            reason = "validation:no_environment"
        if on_done is not None:
            on_done(task, reason)
        return task, reason

    with ThreadPoolExecutor(max(1, settings.jobs), thread_name_prefix="swe-validate") as pool:
        return list(pool.map(one, items))


def _run(command: list[str], copy: Path, timeout_s: float) -> TestRun | None:
    run = run_command(command, copy, timeout_s)
    return None if run.timed_out else run


def _clone(task: SweTask, into: Path) -> bool:
    done = subprocess.run(
        ["git", "clone", "-q", "--no-checkout", "--", task.repo, str(into)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        return False
    return _git(into, "checkout", "-q", task.base_commit, "--").returncode == 0


def _apply(copy: Path, patch: str, path: Path) -> bool:
    path.write_bytes((patch if patch.endswith("\n") else patch + "\n").encode())
    return _git(copy, "apply", "--whitespace=nowarn", str(path)).returncode == 0


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["git", "-c", "advice.detachedHead=false", *args],
        cwd=repo,
        capture_output=True,
        check=False,
    )
