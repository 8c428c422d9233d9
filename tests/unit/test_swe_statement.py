"""Problem statements from what fails (harnessrl.apps.swe.statement): from a real pytest run's
JUnit report, the failing tests, their assertion messages and test-code frames, never the
project's code nor the fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harnessrl.apps.swe.statement import Failure, problem_statement

BUGGY = textwrap.dedent(
    """\
    def clamp(x, low, high):
        if x <= low:
            return low
        return min(x, high)


    def scale(values, factor):
        return [clamp(v * factor, 0, 100) for v in values]
    """
)
TESTS = textwrap.dedent(
    """\
    from pkg.core import clamp, scale


    def test_clamp_keeps_the_low_bound_itself():
        assert clamp(0, 0, 10) == 0
        assert clamp(1, 0, 10) == 1


    def test_scale_keeps_values_in_range():
        result = scale([1, 2], 1)
        assert result == [1, 2], "scaled values changed"


    def test_high():
        assert clamp(20, 0, 10) == 10
    """
)


def _failures(tmp_path: Path) -> list[Failure]:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "core.py").write_text(BUGGY.replace("if x <= low", "if x <= low + 1"))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_core.py").write_text(TESTS)
    report = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", "tests"],
        cwd=tmp_path,
        capture_output=True,
        check=False,
    )
    failures = []
    for case in ET.parse(report).getroot().iter("testcase"):
        failure = case.find("failure")
        if failure is not None:
            node = f"tests/test_core.py::{case.get('name')}"
            failures.append(Failure(node, failure.text or ""))
    return failures


def test_a_statement_from_a_real_pytest_report(tmp_path: Path) -> None:
    failures = _failures(tmp_path)
    assert [f.test.rsplit("::", 1)[1] for f in failures] == [
        "test_clamp_keeps_the_low_bound_itself",
        "test_scale_keeps_values_in_range",
    ]
    fix = ["if x <= low + 1:", "if x <= low:"]  # the lines the gold patch removes and adds
    text = problem_statement("pkg", failures, fix)
    assert "2 tests that passed before no longer do" in text
    for failure in failures:
        assert f"`{failure.test}` fails:" in text
    assert "assert clamp(1, 0, 10) == 1" in text  # the test's own line
    assert "scaled values changed" in text  # the assertion message
    assert "x <= low" not in text  # neither the bug nor the fix
    assert "pkg/core.py" not in text and "return min(x, high)" not in text  # no project frame
    assert "The tests are right" in text


def test_a_python_style_traceback_keeps_test_frames_and_the_exception() -> None:
    report = textwrap.dedent(
        """\
        Traceback (most recent call last):
          File "tests/test_core.py", line 5, in test_clamp
            self.assertEqual(clamp(1, 1, 10), 1)
          File "pkg/core.py", line 2, in clamp
            if x <= low + 1:
        AssertionError: 2 != 1
        """
    )
    text = problem_statement("pkg", [Failure("tests/test_core.py::T::test_clamp", report)], [])
    assert 'File "tests/test_core.py", line 5' in text
    assert "self.assertEqual(clamp(1, 1, 10), 1)" in text
    assert "AssertionError: 2 != 1" in text
    assert "pkg/core.py" not in text and "low + 1" not in text


def test_many_failures_are_listed_and_none_is_refused() -> None:
    failures = [Failure(f"t.py::test_{i}", "E   assert False") for i in range(8)]
    text = problem_statement("p", failures, [])
    assert text.count("fails:") == 5
    assert "Also failing: `t.py::test_5`, `t.py::test_6`, `t.py::test_7`." in text
    with pytest.raises(ValueError, match="at least one failing test"):
        problem_statement("p", [], [])
