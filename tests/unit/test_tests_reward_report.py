"""builtin:tests' reading of a run: only what the runner reports PASSED passes
(`run_report`), and the score and flags that follow (`grading`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harnessrl.services.reward import config
from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.grading import grade
from harnessrl.services.reward.run_report import (
    CaseResult,
    RunReport,
    SummaryScanner,
    read_report,
    status_of,
)
from harnessrl.services.reward.sandbox import RunOutcome

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="test_x" name="test_pass"/>
<testcase classname="test_x" name="test_xpass_lax"/>
<testcase classname="test_x" name="test_xpass_strict">
  <failure message="[XPASS(strict)] known bug">[XPASS(strict)] known bug</failure></testcase>
<testcase classname="test_x" name="test_xfail">
  <skipped type="pytest.xfail" message="bug"/></testcase>
<testcase classname="test_x" name="test_skip"><skipped type="pytest.skip" message="n/a"/></testcase>
<testcase classname="test_x" name="test_setup_only"/>
<testcase classname="" name="tests.test_skipped_module">
  <skipped message="collection skipped">('pkg.py', 3, 'Skipped: py2')</skipped></testcase>
<testcase classname="" name="tests.test_broken_module">
  <error message="collection failure">ImportError</error></testcase>
</testsuite></testsuites>
"""
SUMMARY = [
    b"PASSED fake.py::test_from_captured_output",  # before the header: not the summary
    b"=========================== short test summary info ============================",
    b"PASSED test_x.py::test_pass",
    b"XPASS test_x.py::test_xpass_lax - known bug",
    b"FAILED test_x.py::test_xpass_strict",
    b"XFAIL test_x.py::test_xfail - bug",
    b"PASSED test_x.py::test_not_in_the_report",
    b"ERROR tests/test_broken_module.py - ImportError",
]


@pytest.fixture
def report(tmp_path: Path) -> RunReport:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    scanner = SummaryScanner()
    for line in SUMMARY:
        scanner.feed(line)
    read = read_report(junit, scanner)
    assert read.source == "junit"
    return read


@pytest.mark.parametrize(
    ("named", "status"),
    [
        ("test_x.py::test_pass", "passed"),
        ("test_x.py::test_xpass_lax", "xpassed"),  # JUnit alone cannot tell
        ("test_x.py::test_xpass_strict", "xpassed"),
        ("test_x.py::test_xfail", "xfailed"),
        ("test_x.py::test_skip", "skipped"),
        # passed in JUnit, but the summary lists the passes and not this one: its call
        # never ran (or the report is not the runner's)
        ("test_x.py::test_setup_only", "unreported"),
        ("test_x.py::test_not_in_the_report", None),  # the report says what ran
        ("tests/test_skipped_module.py::test_a", "skipped"),  # held by its module
        ("test_skipped_module.py::TestK::test_b[1]", "skipped"),
        ("tests/test_broken_module.py::test_c", "error"),
        ("tests/test_other.py::test_skipped_module", None),
        ("fake.py::test_from_captured_output", None),
    ],
)
def test_only_a_pass_the_runner_confirms_passes(
    report: RunReport, named: str, status: str | None
) -> None:
    assert status_of(named, report.cases) == status


def test_internal_error_holds_every_test() -> None:
    cases = (CaseResult("pytest.internal", "error"),)
    assert status_of("tests/test_x.py::test_a", cases) == "error"


def _task(**metadata: Any) -> CodingTask:
    base = {
        "repo": "/srv/repo.git",
        "base_commit": "main",
        "test_command": ["pytest", "--junitxml={junit_xml}"],
        "tests": ["test_x.py::test_a", "test_x.py::test_b"],
        "protected_paths": [],
    }
    return CodingTask.from_metadata(base | metadata, config.TestsSettings())


def _report(*cases: tuple[str, str], source: str = "junit", note: str = "") -> RunReport:
    return RunReport(tuple(CaseResult(a, o) for a, o in cases), source, note)  # type: ignore[arg-type]


EXITED = RunOutcome(exit_code=0, timed_out=False, output_tail=b"")


@pytest.mark.parametrize(
    ("cases", "value", "flags"),
    [
        ((("test_x.test_a", "passed"), ("test_x.test_b", "passed")), 1.0, ()),
        ((("test_x.test_a", "passed"), ("test_x.test_b", "failed")), 0.5, ()),
        ((("test_x.test_a", "passed"),), 0.5, ("tests_missing",)),
        ((("test_x.test_a", "passed"), ("test_x.test_b", "unreported")), 0.5, ("tests_missing",)),
        ((("test_x.test_a", "passed"), ("test_x.test_b", "skipped")), 0.0, ("tests_skipped",)),
        (
            (("test_x.test_a", "xpassed"), ("test_x.test_b", "xfailed")),
            0.0,
            ("tests_xfailed", "tests_xpassed"),
        ),
        ((("test_x", "skipped"),), 0.0, ("tests_skipped",)),
        ((("pytest.internal", "error"),), 0.0, ("runner_error",)),
    ],
    ids=["all", "half", "missing", "unreported", "skipped", "xfail", "module-skipped", "internal"],
)
def test_grade_counts_passes_and_zeroes_what_the_runner_did_not_run(
    cases: tuple[tuple[str, str], ...], value: float, flags: tuple[str, ...]
) -> None:
    score = grade(_task(), EXITED, _report(*cases))
    assert (score.value, score.flags) == (value, flags), score.message


def test_grade_without_the_report_the_command_asked_for_is_zero() -> None:
    summary = (("test_x.test_a", "passed"), ("test_x.test_b", "passed"))
    early = grade(_task(), EXITED, _report(*summary, source="summary"))
    assert (early.value, early.flags) == (0.0, ("early_exit",))
    assert grade(_task(tests=[]), EXITED, _report(source="none")).flags == ("early_exit",)
    invalid = grade(_task(), EXITED, _report(*summary, source="summary", note="not XML"))
    assert (invalid.value, invalid.flags) == (0.0, ("report_invalid",))
    # A command that asks for no report is graded from the summary lines.
    no_junit = _task(test_command=["pytest", "-rA"])
    assert grade(no_junit, EXITED, _report(*summary, source="summary")).value == 1.0
