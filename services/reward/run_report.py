"""Which tests passed in a test run: from its JUnit XML report, else from pytest's summary.

Every test case becomes an address in pytest's JUnit form, `classname.name`, which for a
pytest node id `tests/test_x.py::TestA::test_b[1]` is `tests.test_x.TestA.test_b[1]` (the
path's slashes become dots, ".py" goes). A named test is matched the same way, generously:

- its address equals the case's, or is a dotted suffix of it: "tests/test_x.py::test_a",
  "tests.test_x.test_a", "test_x.py::test_a" and "test_a" all name the case
  `tests.test_x.test_a` (a bare name may name several cases, one per file);
- a name without parameters ("test_b") also matches every parametrised case ("test_b[1]",
  "test_b[2]").

A named test's outcome is the worst of the cases it matches (`status_of`); when it
matches none, the outcome of a skipped or errored collection case that holds it (a module
skipped at import, one that failed to import, or pytest's INTERNALERROR case
`pytest.internal`, which holds every test); else it is missing. Only "passed" passes:

- JUnit: a case with an <error> child errored; <failure> failed, unless its message marks
  a strict xfail that passed ("[XPASS(strict)]": xpassed); <skipped type="pytest.xfail">
  xfailed, any other <skipped> skipped; a case without any of them passed, which includes
  a non-strict xfail that passed: JUnit cannot tell that one apart.
- pytest's short summary (`-rA`, which builtin:tests asks for): PASSED, FAILED, ERROR,
  XFAIL, XPASS (SKIPPED lines carry a location, not a node id). Only the lines after the
  last "short test summary info" header count, when there is one: captured output printed
  before it (a test's, or the package's) cannot add outcomes.
- With both, the summary confirms the report: a case that JUnit passed is xpassed, failed
  or errored when the summary says so, and "unreported" when the summary lists passes but
  not this one (its call never ran, or the report is not the runner's). Summary lines for
  cases the report does not hold are ignored: the report says what ran.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Outcome = Literal["passed", "failed", "error", "skipped", "xfailed", "xpassed", "unreported"]
"""What a run says of a test case; only "passed" passes (see the module docstring)."""

_REPORT_LIMIT = 64 * 1024 * 1024
"""A larger JUnit report is not read (the summary lines are used instead)."""
_SUMMARY = re.compile(r"^(PASSED|XPASS|FAILED|ERROR|XFAIL) (\S.*)$")
_SUMMARY_HEADER = re.compile(r"^=+ short test summary info =+$")
_SUMMARY_OUTCOMES: dict[str, Outcome] = {
    "PASSED": "passed",
    "FAILED": "failed",
    "ERROR": "error",
    "XFAIL": "xfailed",
    "XPASS": "xpassed",
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PARAMS = re.compile(r"\[.*\]$")
_RANK: dict[str, int] = {
    "passed": 0,
    "unreported": 1,
    "xpassed": 2,
    "xfailed": 3,
    "skipped": 4,
    "failed": 5,
    "error": 6,
}
"""Which outcome a test with several cases (parametrised, or setup and call) takes."""
_HOLDING = ("skipped", "error")
"""Outcomes of a collection case (a module) that its tests share when they never ran."""
INTERNAL_ERROR = "pytest.internal"
"""The address of the case pytest's JUnit report holds when the runner itself failed (an
INTERNALERROR: a SystemExit while collecting, a plugin that raised)."""


@dataclass(frozen=True, slots=True)
class CaseResult:
    """One test case of a run."""

    address: str
    """`classname.name`, pytest's JUnit form of the node id."""
    outcome: Outcome

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


@dataclass(frozen=True, slots=True)
class RunReport:
    """The test cases of a run, and where they were read from."""

    cases: tuple[CaseResult, ...]
    source: str
    """"junit" (confirmed by the summary lines where there are any), "summary" (pytest's
    short summary lines only) or "none"."""
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
        if _SUMMARY_HEADER.match(text):
            self._cases.clear()  # what came before the real summary is not the summary
            return
        match = _SUMMARY.match(text)
        if match is None:
            return
        word, rest = match.groups()
        # A pass is "PASSED <nodeid>" (whose parameters may hold " - "); the others may
        # add " - <message>".
        nodeid = rest.strip() if word == "PASSED" else rest.split(" - ", 1)[0].strip()
        if word == "XPASS":  # "XPASS <nodeid> <reason>" in some pytest versions
            nodeid = nodeid.split(" ", 1)[0]
        self._cases.append(CaseResult(address_of(nodeid), _SUMMARY_OUTCOMES[word]))

    @property
    def cases(self) -> tuple[CaseResult, ...]:
        return tuple(self._cases)


def read_report(junit_xml: Path, summary: SummaryScanner) -> RunReport:
    """The run's cases: from the JUnit report when it was written and parses (confirmed by
    the summary lines), else from the summary lines seen in the output, else none."""
    note = ""
    if junit_xml.is_file():
        try:
            junit = _parse_junit(junit_xml)
        except ValueError as err:
            note = f"JUnit report not used: {err}"
        else:
            return RunReport(_confirmed(junit, summary.cases), "junit")
    if summary.cases:
        return RunReport(summary.cases, "summary", note)
    return RunReport((), "none", note)


def _confirmed(
    junit: tuple[CaseResult, ...], summary: tuple[CaseResult, ...]
) -> tuple[CaseResult, ...]:
    said: dict[str, list[Outcome]] = {}
    for case in summary:
        said.setdefault(case.address, []).append(case.outcome)
    lists_passes = any(case.passed for case in summary)
    confirmed = []
    for case in junit:
        outcome = case.outcome
        if outcome == "passed":
            worse = [o for o in said.get(case.address, []) if o != "passed"]
            if worse:
                outcome = _worst(worse)
            elif lists_passes and case.address not in said:
                outcome = "unreported"
        confirmed.append(CaseResult(case.address, outcome))
    return tuple(confirmed)


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
        cases.append(CaseResult(address, _junit_outcome(case)))
    return tuple(cases)


def _junit_outcome(case: ET.Element) -> Outcome:
    if case.find("error") is not None:
        return "error"
    failure = case.find("failure")
    if failure is not None:
        strict_xpass = (failure.get("message") or "").startswith("[XPASS(strict)]")
        return "xpassed" if strict_xpass else "failed"
    skipped = case.find("skipped")
    if skipped is None:
        return "passed"
    if skipped.get("type") == "pytest.xfail":
        return "xfailed"
    if skipped.get("message") == "xfail-marked test passes unexpectedly":
        return "xpassed"
    return "skipped"


def status_of(named: str, cases: Sequence[CaseResult]) -> Outcome | None:
    """The named test's outcome (see the module docstring); None when it is missing."""
    target = address_of(named)
    bare = _PARAMS.search(target) is None
    hits = [
        case.outcome
        for case in cases
        if _names(target, case.address) or (bare and _names(target, _unparam(case.address)))
    ]
    if hits:
        return _worst(hits)
    held = [c.outcome for c in cases if c.outcome in _HOLDING and _holds(c.address, target)]
    return _worst(held) if held else None


def outcome_of(named: str, cases: Sequence[CaseResult]) -> bool | None:
    """Whether the named test passed; None when it is missing."""
    status = status_of(named, cases)
    return None if status is None else status == "passed"


def _worst(outcomes: Sequence[Outcome]) -> Outcome:
    return max(outcomes, key=_RANK.__getitem__)


def _names(target: str, address: str) -> bool:
    return address == target or address.endswith("." + target)


def _holds(container: str, target: str) -> bool:
    """Whether the collection case `container` (a module's address) holds the test
    `target`, matched as generously as `_names`: a dotted suffix of the container opens
    the target ("tests.test_x" holds "test_x.test_a" and "tests.test_x.test_a")."""
    if container == INTERNAL_ERROR:
        return True
    outer, inner = container.split("."), _unparam(target).split(".")
    return any(outer[-k:] == inner[:k] for k in range(1, min(len(outer), len(inner) - 1) + 1))


def _unparam(address: str) -> str:
    return _PARAMS.sub("", address)
