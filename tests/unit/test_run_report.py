"""Which tests passed, read from a JUnit XML report or pytest's summary lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.services.reward.run_report import (
    CaseResult,
    SummaryScanner,
    address_of,
    outcome_of,
    read_report,
)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="6">
<testcase classname="tests.test_x" name="test_a" time="0.001"/>
<testcase classname="tests.test_x" name="test_b"><failure message="boom">...</failure></testcase>
<testcase classname="tests.test_x.TestK" name="test_c" time="0.001"/>
<testcase classname="tests.test_x" name="test_p[1]" time="0.001"/>
<testcase classname="tests.test_x" name="test_p[2]"><error message="teardown"/></testcase>
<testcase classname="tests.test_y" name="test_s"><skipped message="later"/></testcase>
</testsuite></testsuites>
"""


@pytest.fixture
def cases(tmp_path: Path) -> tuple[CaseResult, ...]:
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)
    read = read_report(report, SummaryScanner())
    assert read.source == "junit"
    return read.cases


@pytest.mark.parametrize(
    ("named", "passed"),
    [
        ("tests/test_x.py::test_a", True),
        ("tests.test_x.test_a", True),
        ("test_x.py::test_a", True),
        ("test_a", True),
        ("tests/test_x.py::test_b", False),
        ("tests/test_x.py::TestK::test_c", True),
        ("tests/test_x.py::test_p[1]", True),
        ("tests/test_x.py::test_p[2]", False),
        ("tests/test_x.py::test_p", False),  # every parametrised case must pass
        ("tests/test_y.py::test_s", False),  # skipped is not passed
        ("tests/test_x.py::test_zz", None),
        ("st_a", None),  # a suffix counts only at a dot
    ],
)
def test_named_tests_match_junit_cases_generously(
    cases: tuple[CaseResult, ...], named: str, passed: bool | None
) -> None:
    assert outcome_of(named, cases) is passed


def test_summary_lines_give_outcomes_when_there_is_no_junit_report(tmp_path: Path) -> None:
    scanner = SummaryScanner()
    for line in [
        b"=========================== short test summary info ============================",
        b"PASSED tests/test_x.py::test_a",
        b"\x1b[31mFAILED\x1b[0m tests/test_x.py::test_b - AssertionError: assert 1 == 2",
        b"ERROR tests/test_x.py::test_c - RuntimeError: fixture broke",
        b"tests/test_x.py::test_d PASSED",  # verbose progress, not a summary line
    ]:
        scanner.feed(line)
    report = read_report(tmp_path / "absent.xml", scanner)
    assert report.source == "summary"
    assert [outcome_of(f"tests/test_x.py::test_{n}", report.cases) for n in "abcd"] == [
        True,
        False,
        False,
        None,
    ]


def test_unparseable_junit_report_falls_back_to_summary_lines(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text("<testsuites><testcase")
    scanner = SummaryScanner()
    scanner.feed(b"PASSED tests/test_x.py::test_a")
    read = read_report(report, scanner)
    assert read.source == "summary"
    assert "not XML" in read.note


def test_address_is_pytest_junit_form_of_node_id() -> None:
    assert address_of("a/b/test_x.py::TestK::test_c[x/y]") == "a.b.test_x.TestK.test_c[x/y]"
