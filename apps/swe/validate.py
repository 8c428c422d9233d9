"""`swe clean --validate`: each task checked as builtin:tests will score it, jailed and guarded.

A task is valid when, in each of `runs` rounds, in a fresh copy of its repository at its base
commit (its `test_patch`, the held-back tests included, applied), with its test command run
in the reward's jail under the test guard (`TestsReward.run`, the very code that scores):

- before the gold patch: the run adds up (the guard loaded, nothing forged or tampered
  with), no FAIL_TO_PASS test passes, every PASS_TO_PASS test passes;
- after it (it must apply): the gold patch scores 1 with no flag, as the reward grades it:
  every FAIL_TO_PASS and PASS_TO_PASS test passes, no other test fails beyond the task's
  `known_failures`, and its hidden cases match.

Before the rounds, a task gets its hidden cases (`case_synthesis`: calls into the code the
fix changes, with the fixed code's outputs; kept in the record's `extra.hidden_cases` and
in the task's metadata), unless its record holds them already. A task for which none can
be made (a fix in a module-level table that no call with plain inputs reaches, say) is
still kept, for now, with the reason in `extra.hidden_cases_missing`, and `swe clean`'s
report counts such tasks by reason: builtin:tests scores them by their tests alone.

"Passes" means pytest reported it passed: a skipped, xfailed or missing test does not.
Repeating the rounds drops the flaky tasks. The environment and the command are the
record's `extra.environment` and `extra.test_command`, as `swe synth` writes them; an
imported task gets them from `clean --environment/--test-command`. A task without them
cannot be validated: it is dropped as `validation:no_environment`.

Drop reasons: validation:no_environment, validation:clone_failed, validation:test_patch_failed,
validation:patch_failed, validation:timeout, validation:unguarded (the run does not add up
before the gold patch: the task cannot be scored), validation:fail_to_pass_passes_before,
validation:pass_to_pass_fails_before, validation:fail_to_pass_fails_after,
validation:pass_to_pass_fails_after, validation:regression_after,
validation:gold_not_scored (after the gold patch the run does not add up),
validation:hidden_cases_failed (the gold patch does not reproduce its own cases: a flaky
task).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harnessrl.apps.swe.case_synthesis import CaseMaker
from harnessrl.apps.swe.env import EnvError, blocking
from harnessrl.apps.swe.swebench import SweTask, to_harnessrl
from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.episode import standalone_episode
from harnessrl.services.reward.evidence import all_outcomes, inconsistencies
from harnessrl.services.reward.patch_tests import TestsReward
from harnessrl.services.reward.test_names import NameIndex, status_of


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


def validate(
    task: SweTask, settings: ValidateSettings, scratch: Path | None = None
) -> tuple[SweTask, str | None]:
    """The task (with its hidden cases) and None when it is valid, else the drop reason
    (see the module docstring)."""
    if command_of(task) is None:
        return task, "validation:no_environment"
    return blocking(lambda: _validate(task, settings, scratch))


async def _validate(
    task: SweTask, settings: ValidateSettings, scratch: Path | None
) -> tuple[SweTask, str | None]:
    tests = TestsSettings(timeout_s=settings.timeout_s, scratch_dir=scratch)
    reward = TestsReward(tests)
    if "hidden_cases" not in task.extra:
        coding = CodingTask.from_metadata(to_harnessrl(task, "train")["metadata"], tests)
        try:
            made = await CaseMaker(reward).make(coding, task.patch, task.fail_to_pass)
        except ValueError as err:
            return task, _refused(err)
        if isinstance(made, str):  # kept, scored by its tests alone: the report counts it
            task = replace(task, extra={**task.extra, "hidden_cases_missing": made})
        else:
            task = replace(task, extra={**task.extra, "hidden_cases": made.as_metadata()})
    metadata = to_harnessrl(task, "train")["metadata"] | {"scoring": "all_pass"}
    coding = CodingTask.from_metadata(metadata, tests)
    for _ in range(max(1, settings.runs)):
        reason = await _round(reward, coding, metadata, task)
        if reason is not None:
            return task, reason
    return task, None


def _refused(err: ValueError) -> str:
    """The drop reason of a task whose repository or patches do not work as given."""
    if "test_patch" in str(err):
        return "validation:test_patch_failed"
    if "metadata.repo" in str(err) or "metadata.base_commit" in str(err):
        return "validation:clone_failed"
    if "does not apply" in str(err):
        return "validation:patch_failed"
    raise err


async def _round(
    reward: TestsReward, coding: CodingTask, metadata: Mapping[str, Any], task: SweTask
) -> str | None:
    """One round, each half in a fresh copy: before and after the gold patch."""
    try:
        async with reward.copy(coding) as copy:
            outcome, evidence = await reward.run(coding, copy)
    except ValueError as err:
        return _refused(err)
    if outcome.timed_out:
        return "validation:timeout"
    if evidence is None or inconsistencies(evidence, outcome.exit_code) or not evidence.ended:
        return "validation:unguarded"
    outcomes = all_outcomes(evidence)
    index = NameIndex(outcomes)

    def status(name: str) -> str | None:
        return status_of(name, outcomes, evidence.collect_problems, index)

    if any(status(t) == "passed" for t in task.fail_to_pass):
        return "validation:fail_to_pass_passes_before"
    if any(status(t) != "passed" for t in task.pass_to_pass):
        return "validation:pass_to_pass_fails_before"
    gold = await reward(standalone_episode(metadata, result={"patch": task.patch}, mode="val"))
    if gold.value == 1.0 and not gold.flags:
        return None
    return _after(gold.flags, gold.message, task)


def _after(flags: tuple[str, ...], message: str, task: SweTask) -> str:
    """Why the gold patch did not score 1."""
    if "patch_failed" in flags:
        return "validation:patch_failed"
    if "timeout" in flags:
        return "validation:timeout"
    if "tests_regressed" in flags:
        return "validation:regression_after"
    if flags == ("hidden_cases_failed",):
        return "validation:hidden_cases_failed"
    if flags and set(flags) - {"tests_skipped", "tests_xfailed", "tests_xpassed", "tests_missing"}:
        return "validation:gold_not_scored"
    failing = message.split("\n", 1)[0]
    if any(t in failing for t in task.fail_to_pass):
        return "validation:fail_to_pass_fails_after"
    return "validation:pass_to_pass_fails_after"


def validate_all(
    tasks: Iterable[SweTask],
    settings: ValidateSettings,
    on_done: Callable[[SweTask, str | None], None] | None = None,
) -> list[tuple[SweTask, str | None]]:
    """Every task's verdict, in input order; `jobs` at once."""
    items = list(tasks)

    def one(task: SweTask) -> tuple[SweTask, str | None]:
        try:
            task, reason = validate(task, settings)
        except EnvError:
            reason = "validation:no_environment"
        if on_done is not None:
            on_done(task, reason)
        return task, reason

    with ThreadPoolExecutor(max(1, settings.jobs), thread_name_prefix="swe-validate") as pool:
        return list(pool.map(one, items))
