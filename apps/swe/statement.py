"""Problem statements for synthesized tasks, written from what fails.

A synthesized bug has no issue report, so one is written the way a user reports a failing
build: which tests fail, their assertion messages, and the part of each traceback that is
in the test code. Frames in the project's own code are left out (they would point at the
changed line), and so is anything of the gold patch: no line the fix adds or removes may
appear (checked again by `clean`'s leak check).

    problem_statement("six", failures)     # failures: [Failure(test, text), ...]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from harnessrl.apps.swe.swebench import is_test_path

_PYTEST_AT = re.compile(r"^(\S+\.py):\d+:(?: \w*)?$")
_PYTHON_AT = re.compile(r'^\s*File "([^"]+)", line \d+')
_SEPARATOR = re.compile(r"^(?:_ )+_?$")
_ERROR_LINE = re.compile(r"^E\s+(.*)$")
SHOWN = 5
"""Failing tests described in full; the rest are listed by name."""
EXCERPT_LINES = 12
"""Most lines of one failure's excerpt."""


@dataclass(frozen=True, slots=True)
class Failure:
    test: str
    """The test's id (pytest node id)."""
    text: str
    """What the runner reported: the failure's message and traceback."""


def problem_statement(project: str, failures: Sequence[Failure], fix_lines: Sequence[str]) -> str:
    """An issue report for `failures` in `project`; `fix_lines` (the lines the gold patch
    adds and removes) never appear in it. Raises ValueError when there is no failure."""
    if not failures:
        raise ValueError("a problem statement needs at least one failing test")
    forbidden = [" ".join(line.split()) for line in fix_lines if len(line.strip()) >= 4]
    names = [f.test for f in failures]
    lines = [
        f"Some of {project}'s tests fail: {len(names)} test{'s' if len(names) > 1 else ''} "
        "that passed before no longer do.",
        "",
    ]
    for failure in failures[:SHOWN]:
        lines.append(f"`{failure.test}` fails:")
        lines.append("```")
        lines += _excerpt(failure.text, forbidden) or ["(no output)"]
        lines.append("```")
        lines.append("")
    if len(names) > SHOWN:
        lines.append("Also failing: " + ", ".join(f"`{n}`" for n in names[SHOWN:]) + ".")
        lines.append("")
    lines.append("The tests are right; the code they test needs fixing.")
    return "\n".join(lines).strip() + "\n"


def _excerpt(text: str, forbidden: Sequence[str]) -> list[str]:
    """The test-code part of a traceback and the error lines, without the project's frames
    and without any line that quotes the fix.

    Both traceback styles are read: pytest's (each frame's code, then its `path:line:`
    location), Python's (`File "path", line N` before each frame's code)."""
    out: list[str] = []
    block: list[str] = []  # the current frame's lines, until its location says whose it is
    python_frame: bool | None = None  # in a Python-style traceback: is this a test frame

    def flush(is_test: bool) -> None:
        out.extend(line for line in block if is_test or _ERROR_LINE.match(line))
        block.clear()

    for raw in text.splitlines():
        line = raw.rstrip()
        normal = " ".join(line.split())
        if not normal or any(f in normal for f in forbidden):
            continue
        if _SEPARATOR.match(line):
            flush(False)
            continue
        located = _PYTEST_AT.match(line)
        if located:
            block.append(line)
            flush(_is_test(located.group(1)))
            continue
        header = _PYTHON_AT.match(line)
        if header:
            flush(bool(python_frame))
            python_frame = _is_test(header.group(1))
            block.append(line)
            continue
        if python_frame is not None and not line.startswith(" "):
            flush(bool(python_frame))  # the exception line after the last frame
            python_frame = None
            out.append(line)
            continue
        block.append(line)
    flush(bool(python_frame) if python_frame is not None else not out)
    if len(out) > EXCERPT_LINES:
        errors = [line for line in out if _ERROR_LINE.match(line)]
        out = [*out[: EXCERPT_LINES - min(len(errors), 4)], "...", *errors[-4:]]
    return out


def _is_test(path: str) -> bool:
    return is_test_path(path.replace("\\", "/").removeprefix("./"))
