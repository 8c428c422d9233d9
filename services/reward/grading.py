"""The score of a test run: how many of the task's named tests the runner reports passed.

A named test counts only when its outcome (`run_report.status_of`) is "passed". The score
is the share of them that passed ("fraction") or 1 only when all did ("all_pass"); without
named tests, 1 when the command exits 0. A score of 0 and a flag, whatever passed, when:

- timeout: the run was cut at its timeout;
- early_exit: the command asks for a JUnit report and ended without writing one (the
  process exited before pytest finished its session: `os._exit` at import, a crash);
- report_invalid: the JUnit report it asked for is not one (too large, not JUnit XML);
  the summary lines are then not trusted either;
- runner_error: pytest stopped with an internal error (its report holds the case
  `pytest.internal`: a SystemExit raised while it collected, say); every named test
  errored;
- tests_skipped / tests_xfailed / tests_xpassed: a named test was skipped (at run time or
  with its whole module), xfailed, or marked xfail and passed. The task's tests pass,
  plainly, on the fixed code; none of these can come from its pristine tests, so the patch
  made the runner report them.

tests_missing: a named test is in no report, or JUnit passed it but the summary, which
lists the passes, does not (it never ran its call). It counts as failed, and flags the
score, which is not forced to 0: a misnamed test is a fault of the task as often as of the
patch.
"""

from __future__ import annotations

from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.episode import Score
from harnessrl.services.reward.run_report import INTERNAL_ERROR, RunReport, status_of
from harnessrl.services.reward.sandbox import RunOutcome

LISTED = 10
"""Most test names a message lists."""
_ZEROING = {"skipped": "tests_skipped", "xfailed": "tests_xfailed", "xpassed": "tests_xpassed"}
"""Outcomes of a named test that score the whole run 0, and their flags."""


def grade(task: CodingTask, outcome: RunOutcome, report: RunReport) -> Score:
    """The run's score; see the module docstring."""
    components: dict[str, float] = {}
    if outcome.exit_code is not None:
        components["exit_code"] = float(outcome.exit_code)
    tail = outcome.output_tail.decode("utf-8", "replace").strip()
    notes = [report.note] if report.note else []
    if outcome.timed_out:
        message = f"test run killed after its {task.timeout_s:g} s timeout"
        return Score(0.0, components, ("timeout",), _message(message, notes, tail))
    if task.writes_junit and report.source != "junit":
        if report.note:
            message = "the test command's JUnit report is not one; the run is not graded"
            return Score(0.0, components, ("report_invalid",), _message(message, notes, tail))
        message = (
            f"the test command exited ({outcome.exit_code}) without writing its JUnit "
            "report: the runner did not finish its session"
        )
        return Score(0.0, components, ("early_exit",), _message(message, notes, tail))
    if not task.tests:
        return _by_exit_code(outcome, report, components, notes, tail)
    by_outcome: dict[str, list[str]] = {}
    for name in task.tests:
        status = status_of(name, report.cases)
        key = "missing" if status in (None, "unreported") else status
        by_outcome.setdefault(key, []).append(name)
    passed = by_outcome.get("passed", [])
    components["tests_passed"] = float(len(passed))
    components["tests_total"] = float(len(task.tests))
    flags = [flag for key, flag in _ZEROING.items() if key in by_outcome]
    if any(case.address == INTERNAL_ERROR for case in report.cases):
        flags.insert(0, "runner_error")
    if flags:
        value = 0.0
    elif task.scoring == "fraction":
        value = len(passed) / len(task.tests)
    else:
        value = 1.0 if len(passed) == len(task.tests) else 0.0
    if "missing" in by_outcome:
        flags.append("tests_missing")
    if len(passed) == len(task.tests):
        return Score(value, components, (), f"all {len(passed)} named tests passed")
    message = _message(_summary(by_outcome, task, report), notes, tail)
    return Score(value, components, tuple(flags), message)


def _by_exit_code(
    outcome: RunOutcome,
    report: RunReport,
    components: dict[str, float],
    notes: list[str],
    tail: str,
) -> Score:
    if report.cases:
        components["tests_passed"] = float(sum(case.passed for case in report.cases))
        components["tests_total"] = float(len(report.cases))
    if outcome.exit_code == 0:
        return Score(1.0, components, (), "the test command exited 0")
    message = f"the test command exited {outcome.exit_code}"
    return Score(0.0, components, (), _message(message, notes, tail))


def _summary(by_outcome: dict[str, list[str]], task: CodingTask, report: RunReport) -> str:
    parts = [f"{len(by_outcome.get('passed', []))} of {len(task.tests)} named tests passed"]
    for key, label in (
        ("failed", "failed"),
        ("error", "errored"),
        ("skipped", "skipped (the patch made the runner skip them)"),
        ("xfailed", "xfailed (the patch made them expected to fail)"),
        ("xpassed", "xpassed (marked expected to fail by the patch)"),
    ):
        if key in by_outcome:
            parts.append(f"{label}: {listed(by_outcome[key])}")
    if "missing" in by_outcome:
        where = "no test report found" if report.source == "none" else "not reported passed"
        parts.append(f"{where}: {listed(by_outcome['missing'])}")
    return "; ".join(parts)


def _message(summary: str, notes: list[str], tail: str) -> str:
    lines = [summary, *notes]
    if tail:
        lines.append(f"output (end):\n{tail}")
    return "\n".join(lines)


def listed(names: list[str]) -> str:
    """The names, comma-separated, at most LISTED of them."""
    shown = ", ".join(names[:LISTED])
    return shown if len(names) <= LISTED else f"{shown} and {len(names) - LISTED} more"
