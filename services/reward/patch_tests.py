"""The built-in `tests` reward: apply the harness's patch, run the task's tests, score them.

For each episode: the task's repository is cloned at its base commit into a fresh directory
(deleted afterwards, whatever happens), the harness's patch is applied, and the task's test
command runs there, contained (see `sandbox`). The score is the share of the named tests
that pass ("fraction") or 1 only when all pass ("all_pass"); without named tests, 1 when
the command exits 0. Scores of 0 carry a flag saying why:

- empty_patch: the harness produced no patch (nothing is run);
- patch_failed: git could not apply it (git's message is the score's);
- tests_modified: it changes a protected path, the task's tests (nothing is run);
- timeout: the test run was cut at its timeout;
- tests_missing (with any value): a named test appears in no report; it counts as failed.

The metadata fields are described in `coding_task`. Infrastructure problems (git missing,
a clone timing out, no network namespace where one is required) raise: the reward is then
missing, not 0.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harnessrl.logs import get_logger
from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.episode import Episode, Score
from harnessrl.services.reward.repo_copy import (
    apply_patch,
    changed_paths,
    clone_at,
    protected_in,
    restore,
)
from harnessrl.services.reward.run_report import (
    RunReport,
    SummaryScanner,
    outcome_of,
    read_report,
)
from harnessrl.services.reward.sandbox import NetworkPolicy, RunOutcome, clean_env, run_group

log = get_logger(__name__)

_LISTED = 10
"""Most test names a message lists."""


class TestsReward:
    """builtin:tests; see the module docstring. One instance scores any number of episodes
    concurrently (each in its own copy)."""

    def __init__(self, settings: TestsSettings) -> None:
        self._settings = settings
        self._network = NetworkPolicy(settings.network)

    async def __call__(self, episode: Episode) -> Score:
        """Score the episode's patch. Raises ValueError naming the metadata field when the
        task is ill-described, RuntimeError or TimeoutError when scoring itself failed."""
        task = CodingTask.from_metadata(episode.task_metadata, self._settings)
        patch = read_patch(episode, self._settings)
        if not patch.strip():
            return Score(0.0, flags=("empty_patch",), message="the harness produced no patch")
        prefix = await self._network.prefix()
        scratch = self._settings.scratch_dir
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="harnessrl-tests-", dir=scratch))
        try:
            return await self._score(task, patch, workdir, prefix)
        finally:
            await asyncio.to_thread(_remove, workdir)

    async def _score(
        self, task: CodingTask, patch: str, workdir: Path, prefix: tuple[str, ...]
    ) -> Score:
        copy = workdir / "repo"
        await clone_at(task.repo, task.base_commit, copy)
        patch_path = workdir / "patch.diff"
        text = patch if patch.endswith("\n") else patch + "\n"  # git needs the last newline
        patch_path.write_bytes(text.encode("utf-8", "surrogateescape"))
        error = await apply_patch(copy, patch_path)
        if error is not None:
            return Score(0.0, flags=("patch_failed",), message=f"git apply: {error}")
        touched = protected_in(await changed_paths(copy), task.protected_paths)
        if touched:
            return Score(
                0.0,
                components={"protected_paths_touched": float(len(touched))},
                flags=("tests_modified",),
                message=f"the patch changes protected paths: {_listed(touched)}",
            )
        await restore(copy, task.protected_paths)  # defence in depth: the check above holds
        outcome, report = await self._run(task, workdir, copy, prefix)
        return _grade(task, outcome, report)

    async def _run(
        self, task: CodingTask, workdir: Path, copy: Path, prefix: tuple[str, ...]
    ) -> tuple[RunOutcome, RunReport]:
        home, tmp, reports = workdir / "home", workdir / "tmp", workdir / "reports"
        for directory in (home, tmp, reports):
            directory.mkdir()
        junit_xml = reports / "junit.xml"
        summary = SummaryScanner()
        command = task.command_with(str(junit_xml))
        env = clean_env(home, tmp)
        # Checked here, not left to exec: under unshare a missing program is exit code 127.
        if "/" not in command[0] and shutil.which(command[0], path=env["PATH"]) is None:
            raise ValueError(f"task metadata.test_command[0]: {command[0]!r} is not on PATH")
        try:
            outcome = await run_group(
                (*prefix, *command),
                cwd=copy,
                env=env,
                timeout_s=task.timeout_s,
                kill_grace_s=self._settings.kill_grace_s,
                output_cap_bytes=self._settings.output_cap_bytes,
                on_line=summary.feed,
            )
        except OSError as err:
            raise ValueError(f"task metadata.test_command: cannot start it: {err}") from err
        return outcome, read_report(junit_xml, summary)


def read_patch(episode: Episode, settings: TestsSettings) -> str:
    """The harness's patch: the artifacts' patch file when there is one, else the result's
    patch key when it holds a string, else ""."""
    if episode.artifacts_dir is not None:
        path = episode.artifacts_dir / settings.patch_file
        if path.is_file():
            return path.read_text("utf-8", errors="surrogateescape")
    result: Any = episode.result
    if isinstance(result, dict) and isinstance(result.get(settings.patch_key), str):
        return str(result[settings.patch_key])
    return ""


def _grade(task: CodingTask, outcome: RunOutcome, report: RunReport) -> Score:
    components: dict[str, float] = {}
    if outcome.exit_code is not None:
        components["exit_code"] = float(outcome.exit_code)
    tail = outcome.output_tail.decode("utf-8", "replace").strip()
    notes = [report.note] if report.note else []
    if outcome.timed_out:
        message = f"test run killed after its {task.timeout_s:g} s timeout"
        return Score(0.0, components, ("timeout",), _message(message, notes, tail))
    if not task.tests:
        if report.cases:
            components["tests_passed"] = float(sum(case.passed for case in report.cases))
            components["tests_total"] = float(len(report.cases))
        if outcome.exit_code == 0:
            return Score(1.0, components, (), "the test command exited 0")
        message = f"the test command exited {outcome.exit_code}"
        return Score(0.0, components, (), _message(message, notes, tail))
    outcomes = {name: outcome_of(name, report.cases) for name in task.tests}
    passed = [name for name, ok in outcomes.items() if ok]
    failed = [name for name, ok in outcomes.items() if ok is False]
    missing = [name for name, ok in outcomes.items() if ok is None]
    components["tests_passed"] = float(len(passed))
    components["tests_total"] = float(len(task.tests))
    if task.scoring == "fraction":
        value = len(passed) / len(task.tests)
    else:
        value = 1.0 if len(passed) == len(task.tests) else 0.0
    flags = ("tests_missing",) if missing else ()
    if not failed and not missing:
        return Score(value, components, flags, f"all {len(passed)} named tests passed")
    parts = [f"{len(passed)} of {len(task.tests)} named tests passed"]
    if failed:
        parts.append(f"failed: {_listed(failed)}")
    if missing:
        where = "no test report found" if report.source == "none" else "not in the report"
        parts.append(f"{where}: {_listed(missing)}")
    return Score(value, components, flags, _message("; ".join(parts), notes, tail))


def _message(summary: str, notes: list[str], tail: str) -> str:
    lines = [summary, *notes]
    if tail:
        lines.append(f"output (end):\n{tail}")
    return "\n".join(lines)


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown} and {len(names) - _LISTED} more"


def _remove(path: Path) -> None:
    """Delete the episode's directory, also where the tests made parts of it read-only
    (a Go module cache, say)."""
    try:
        _remove_tree(str(path))
    except OSError as err:  # a process that escaped its group may still be writing there
        log.warning("could not delete a test run's directory", path=str(path), error=str(err))


def _remove_tree(path: str) -> None:
    def unlock(_: Callable[..., Any], failed: str, __: Any) -> None:
        parent = os.path.dirname(failed)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, os.stat(failed).st_mode | stat.S_IRWXU)
            _remove_tree(failed)
        else:
            os.unlink(failed)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=unlock)
    else:
        shutil.rmtree(path, onerror=unlock)
