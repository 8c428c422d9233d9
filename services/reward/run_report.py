"""Which tests passed in a test run: from its JUnit XML report, else from pytest's summary.

Every test case becomes an address in pytest's JUnit form, `classname.name`, which for a
pytest node id `tests/test_x.py::TestA::test_b[1]` is `tests.test_x.TestA.test_b[1]` (the
path's slashes become dots, ".py" goes). A named test is matched the same way, generously:

- its address equals the case's, or is a dotted suffix of it: "tests/test_x.py::test_a",
  "tests.test_x.test_a", "test_x.py::test_a" and "test_a" all name the case
  `tests.test_x.test_a` (a bare name may name several cases, one per file);
- a name without parameters ("test_b") also matches every parametrised case ("test_b[1]",
  "test_b[2]").

A named test passes when it matches at least one case and every case it matches passed;
it is missing when it matches none. A case passed when it has no failure, error or
skipped child (JUnit) or its summary line says PASSED or XPASS (pytest `-rA`).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_REPORT_LIMIT = 64 * 1024 * 1024
"""A larger JUnit report is not read (the summary lines are used instead)."""
_NOT_PASSED = ("failure", "error", "skipped")
_SUMMARY = re.compile(r"^(PASSED|XPASS|FAILED|ERROR|XFAIL) (\S.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PARAMS = re.compile(r"\[.*\]$")


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One test case of a run."""

    address: str
    """`classname.name`, pytest's JUnit form of the node id."""
    passed: bool


@dataclass(frozen=True, slots=True)
class RunReport:
    """The test cases of a run, and where they were read from."""

    cases: tuple[CaseResult, ...]
    source: str
    """"junit", "summary" (pytest's short summary lines) or "none"."""
    note: str = ""
    """Why the JUnit report was not used although one was written; "" otherwise."""


def address_of(nodeid: str) -> str:
    """The JUnit address of a pytest node id (as pytest's junitxml plugin makes it)."""
    parts = nodeid.split("::")
    parts[0] = re.sub(r"\.py$", "", parts[0].replace("/", "."))
    return ".".join(part for part in parts if part)


class SummaryScanner:
    """Collects the outcomes of pytest's short summary lines (`-rA`) from output lines."""

    def __init__(self) -> None:
        self._cases: list[CaseResult] = []

    def feed(self, line: bytes) -> None:
        text = _ANSI.sub("", line.decode("utf-8", "replace")).rstrip("\r")
        match = _SUMMARY.match(text)
        if match is None:
            return
        outcome, rest = match.groups()
        nodeid = rest.split(" - ", 1)[0].strip()
        if outcome == "XPASS":  # "XPASS <nodeid> <reason>" in some pytest versions
            nodeid = nodeid.split(" ", 1)[0]
        self._cases.append(CaseResult(address_of(nodeid), outcome in ("PASSED", "XPASS")))

    @property
    def cases(self) -> tuple[CaseResult, ...]:
        return tuple(self._cases)


def read_report(junit_xml: Path, summary: SummaryScanner) -> RunReport:
    """The run's cases: from the JUnit report when it was written and parses, else from
    the summary lines seen in the output, else none."""
    note = ""
    if junit_xml.is_file():
        try:
            return RunReport(_parse_junit(junit_xml), "junit")
        except ValueError as err:
            note = f"JUnit report not used: {err}"
    if summary.cases:
        return RunReport(summary.cases, "summary", note)
    return RunReport((), "none", note)


def _parse_junit(path: Path) -> tuple[CaseResult, ...]:
    """Raises ValueError when the report is too large or not JUnit XML."""
    if path.stat().st_size > _REPORT_LIMIT:
        raise ValueError(f"larger than {_REPORT_LIMIT} bytes")
    try:
        # The report is written by code the policy wrote; expat refuses entity expansion
        # bombs, and the size is capped above.
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        raise ValueError(f"not XML ({err})") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ValueError(f"root element is <{root.tag}>, not <testsuites> or <testsuite>")
    cases = []
    for case in root.iter("testcase"):
        address = ".".join(p for p in (case.get("classname"), case.get("name")) if p)
        passed = not any(case.find(tag) is not None for tag in _NOT_PASSED)
        cases.append(CaseResult(address, passed))
    return tuple(cases)


def outcome_of(named: str, cases: Sequence[CaseResult]) -> bool | None:
    """Whether the named test passed (see the module docstring); None when it is missing."""
    target = address_of(named)
    bare = _PARAMS.search(target) is None
    hits = [
        case.passed
        for case in cases
        if _names(target, case.address) or (bare and _names(target, _unparam(case.address)))
    ]
    if not hits:
        return None
    return all(hits)


def _names(target: str, address: str) -> bool:
    return address == target or address.endswith("." + target)


def _unparam(address: str) -> str:
    return _PARAMS.sub("", address)
