"""The score of a jailed test run: the task's named tests, as the test guard proved them.

With the task's runner "pytest" (the default), the score comes from the guard's evidence
(`evidence`), never from anything the run wrote (no JUnit file, no output line). A run
that does not add up scores 0 with a flag for each way it does not:

- timeout: the run was cut at its timeout;
- guard_missing: the guard never reported (pytest did not load it);
- channel_overflow: the run wrote more into its channel than the reward reads
  (`reward.tests.channel_cap_bytes`): a run that floods the reward scores nothing;
- report_forged: a frame that does not verify, is out of sequence, reports a test that was
  not collected or a phase twice, or reports passed a call the guard saw raise;
- report_after_finish: frames written after the session's end;
- runner_tampered: the guard found the runner, a hook, the import of a test module or a
  test function changed (its findings are in the message); or code the patch changed was
  imported before the guard;
- exit_mismatch: the process's exit status is not the one pytest ended with, or does not
  agree with the outcomes (0 with failing tests, 1 with none);
- early_exit: the process ended before pytest ended its session;
- runner_error: pytest stopped with an internal error (exit status 3);
- tests_missing: a named test was not collected;
- tests_skipped / tests_xfailed / tests_xpassed: a named test was skipped, xfailed, or
  marked xfail and passed (the task's tests pass plainly on the fixed code);
- tests_regressed: a test the task does not name failed or errored, and the task lists the
  tests allowed to fail (`known_failures`, which `swe synth` records): a patch that breaks
  what worked scores 0, named or not.

Otherwise the score is the share of named tests that passed ("fraction") or 1 when all did
("all_pass"); without named tests, 1 when pytest ended with status 0. With the runner
"command" (a task whose command is not pytest), only the exit status speaks: 1 when it is 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.episode import Score
from harnessrl.services.reward.evidence import Evidence, Outcome, all_outcomes, inconsistencies
from harnessrl.services.reward.group_run import RunOutcome
from harnessrl.services.reward.test_names import NameIndex, status_of

LISTED = 10
"""Most test names a message lists."""
_ZEROING = {"skipped": "tests_skipped", "xfailed": "tests_xfailed", "xpassed": "tests_xpassed"}
"""Outcomes of a named test that score the whole run 0, and their flags."""
INTERNAL_ERROR = 3


def grade(
    task: CodingTask, outcome: RunOutcome, evidence: Evidence | None, changed: Sequence[str]
) -> Score:
    """The run's score; see the module docstring. `evidence`: None for the runner "command";
    `changed`: the repository paths the patch changed."""
    components: dict[str, float] = {}
    if outcome.exit_code is not None:
        components["exit_code"] = float(outcome.exit_code)
    tail = outcome.output_tail.decode("utf-8", "replace").strip()
    if outcome.timed_out:
        message = f"test run killed after its {task.timeout_s:g} s timeout"
        return Score(0.0, components, ("timeout",), _message(message, tail))
    if evidence is None:
        return _by_exit_code(outcome.exit_code == 0, components, outcome, tail)
    problems = inconsistencies(evidence, outcome.exit_code)
    problems += _preloaded(evidence, changed)
    if not problems and not evidence.ended:
        why = f"the process exited ({outcome.exit_code}) before pytest ended its session"
        problems.append(("early_exit", why))
    if problems:
        flags = tuple(dict.fromkeys(flag for flag, _ in problems))
        whys = "\n".join(f"{flag}: {why}" for flag, why in problems)
        return Score(0.0, components, flags, _message(f"the run does not add up\n{whys}", tail))
    if evidence.exitstatus == INTERNAL_ERROR:
        message = "pytest stopped with an internal error"
        return Score(0.0, components, ("runner_error",), _message(message, tail))
    outcomes = all_outcomes(evidence)
    if not task.tests:
        return _by_exit_code(evidence.exitstatus == 0, components, outcome, tail)
    return _named(task, evidence, outcomes, components, tail)


def _named(
    task: CodingTask,
    evidence: Evidence,
    outcomes: dict[str, Outcome],
    components: dict[str, float],
    tail: str,
) -> Score:
    index = NameIndex(outcomes)
    by_outcome: dict[str, list[str]] = {}
    for name in task.tests:
        status = status_of(name, outcomes, evidence.collect_problems, index)
        by_outcome.setdefault(status or "missing", []).append(name)
    passed = by_outcome.get("passed", [])
    components["tests_passed"] = float(len(passed))
    components["tests_total"] = float(len(task.tests))
    flags = [flag for key, flag in _ZEROING.items() if key in by_outcome]
    if "missing" in by_outcome:
        flags.append("tests_missing")
    regressed = _regressions(task, evidence, outcomes, index)
    if regressed:
        flags.append("tests_regressed")
        components["tests_regressed"] = float(len(regressed))
    if flags:
        value = 0.0
    elif task.scoring == "fraction":
        value = len(passed) / len(task.tests)
    else:
        value = 1.0 if len(passed) == len(task.tests) else 0.0
    if value == 1.0:
        return Score(value, components, (), f"all {len(passed)} named tests passed")
    summary = _summary(by_outcome, task, regressed)
    failed = [
        n for key in ("failed", "error") for m in by_outcome.get(key, []) for n in index.named_by(m)
    ]
    texts = [evidence.texts[n] for n in failed if n in evidence.texts]
    return Score(value, components, tuple(flags), _message(summary, tail, texts[:2]))


def _regressions(
    task: CodingTask, evidence: Evidence, outcomes: dict[str, Outcome], index: NameIndex
) -> list[str]:
    """Tests (and collectors) outside the named tests and the known failures that failed,
    when the task lists its known failures."""
    if task.known_failures is None:
        return []
    named = {n for name in task.tests for n in index.named_by(name)}
    known = {n for name in task.known_failures for n in index.named_by(name)}
    known_collectors = set(task.known_failures)
    found = [
        nodeid
        for nodeid, outcome in outcomes.items()
        if outcome in ("failed", "error") and nodeid not in named and nodeid not in known
    ]
    found += [
        nodeid
        for nodeid, outcome in evidence.collect_problems.items()
        if outcome == "failed" and nodeid not in known_collectors
    ]
    return found


def _preloaded(evidence: Evidence, changed: Sequence[str]) -> list[tuple[str, str]]:
    """Code the patch changed that was imported before the guard (by a plugin module the
    task's configuration loads): it could have prepared the runner unseen."""
    preloaded = evidence.hello.get("preloaded") if evidence.hello is not None else None
    early = sorted(set(preloaded if isinstance(preloaded, list) else []) & set(changed))
    if early:
        return [("runner_tampered", f"imported before the guard: {listed(early)}")]
    return []


def _by_exit_code(ok: bool, components: dict[str, float], outcome: RunOutcome, tail: str) -> Score:
    if ok:
        return Score(1.0, components, (), "the test command exited 0")
    message = f"the test command exited {outcome.exit_code}"
    return Score(0.0, components, (), _message(message, tail))


def _summary(by_outcome: dict[str, list[str]], task: CodingTask, regressed: list[str]) -> str:
    parts = [f"{len(by_outcome.get('passed', []))} of {len(task.tests)} named tests passed"]
    for key, label in (
        ("failed", "failed"),
        ("error", "errored"),
        ("skipped", "skipped (the patch made the runner skip them)"),
        ("xfailed", "xfailed (the patch made them expected to fail)"),
        ("xpassed", "xpassed (marked expected to fail by the patch)"),
        ("missing", "not collected"),
    ):
        if key in by_outcome:
            parts.append(f"{label}: {listed(by_outcome[key])}")
    if regressed:
        parts.append(f"tests that failed and are not allowed to: {listed(regressed)}")
    return "; ".join(parts)


def _message(summary: str, tail: str, texts: Sequence[str] = ()) -> str:
    lines = [summary, *(f"pytest reported:\n{t}" for t in texts if t)]
    if tail:
        lines.append(f"output (end):\n{tail}")
    return "\n".join(lines)


def listed(names: Sequence[str]) -> str:
    """The names, comma-separated, at most LISTED of them."""
    shown = ", ".join(names[:LISTED])
    return shown if len(names) <= LISTED else f"{shown} and {len(names) - LISTED} more"
