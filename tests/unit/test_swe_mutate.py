"""Candidate bugs by AST mutation (harnessrl.apps.swe.mutate): each a one-point edit of the
original text that compiles, with the answers for a small module written down."""

from __future__ import annotations

import difflib
import inspect
import json
import textwrap

from harnessrl.apps.swe.mutate import KINDS, mutations

SOURCE = textwrap.dedent(
    '''\
    """A module: its docstring is never mutated."""
    from typing import Literal

    LIMIT = 10


    def clamp(x: int, low: int = 0, mode: Literal[3] = 3) -> int:
        """Clamp x to [low, LIMIT]."""
        if x < low:
            return low
        if x >= LIMIT and not mode:
            return LIMIT
        total = x + 1
        total -= 2
        return max(total, low)


    if __name__ == "__main__":
        print(clamp(3, 1))
    '''
)


def _changes(before: str, after: str) -> list[str]:
    """The removed and added lines of a diff."""
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and line[:3] not in ("+++", "---")
    ]


def test_each_kind_of_bug_is_one_edit_of_the_original_text() -> None:
    found = {
        (m.kind, m.line, m.description): _changes(SOURCE, m.source)
        for m in mutations("m.py", SOURCE)
    }
    expected = {
        ("compare", 9, "`<` -> `<=`"): ["-    if x < low:", "+    if x <= low:"],
        ("compare", 11, "`>=` -> `>`"): [
            "-    if x >= LIMIT and not mode:",
            "+    if x > LIMIT and not mode:",
        ],
        ("boolean", 11, "`and` -> `or`"): [
            "-    if x >= LIMIT and not mode:",
            "+    if x >= LIMIT or not mode:",
        ],
        ("boolean", 11, "`not` dropped"): [
            "-    if x >= LIMIT and not mode:",
            "+    if x >= LIMIT and mode:",
        ],
        ("operator", 13, "`+` -> `-`"): ["-    total = x + 1", "+    total = x - 1"],
        ("constant", 13, "`1` -> `2`"): ["-    total = x + 1", "+    total = x + 2"],
        ("constant", 13, "`1` -> `0`"): ["-    total = x + 1", "+    total = x + 0"],
        ("constant", 4, "`10` -> `11`"): ["-LIMIT = 10", "+LIMIT = 11"],
        ("constant", 7, "`0` -> `1`"): [
            "-def clamp(x: int, low: int = 0, mode: Literal[3] = 3) -> int:",
            "+def clamp(x: int, low: int = 1, mode: Literal[3] = 3) -> int:",
        ],
        ("arguments", 15, "arguments `total` and `low` swapped"): [
            "-    return max(total, low)",
            "+    return max(low, total)",
        ],
        ("statement", 14, "`total -= 2` removed"): ["-    total -= 2"],
        ("return", 10, "returns None instead of its value"): [
            "-        return low",
            "+        return",
        ],
    }
    for key, diff in expected.items():
        assert found.get(key) == diff, (key, found.get(key))
    assert {kind for kind, _, _ in found} == set(KINDS)
    # Never the docstrings, the annotations (Literal[3]) or the __main__ block.
    touched = {line for diff in found.values() for line in diff}
    assert not any("docstring" in line or "Clamp x" in line for line in touched)
    assert not any("Literal[2]" in line or "Literal[4]" in line for line in touched)
    assert not any("print(" in line for line in touched)


def test_mutations_are_deterministic_distinct_and_compile() -> None:
    first = list(mutations("m.py", SOURCE))
    assert first == list(mutations("m.py", SOURCE))
    sources = [m.source for m in first]
    assert len(set(sources)) == len(sources) and SOURCE not in sources
    for m in first:
        compile(m.source, "m.py", "exec")


def test_the_operator_is_found_whatever_the_spacing_parentheses_and_comments() -> None:
    source = "def f(a, b):\n    return ((a) <(b  # why\n       ))\n"
    (compare,) = [m for m in mutations("f.py", source) if m.kind == "compare"]
    assert compare.source == "def f(a, b):\n    return ((a) <=(b  # why\n       ))\n"


def test_positions_are_right_after_multibyte_text_and_odd_line_ends() -> None:
    # AST columns are UTF-8 byte offsets; \f is not a line end for Python.
    source = 'LABEL = "héllo ✓"; N = 1 if 2 < 3 else 4\n\x0cM = 5\r\nK = 6 - 7\n'
    got = {m.description: m.source for m in mutations("u.py", source)}
    assert (
        got["`<` -> `<=`"] == 'LABEL = "héllo ✓"; N = 1 if 2 <= 3 else 4\n\x0cM = 5\r\nK = 6 - 7\n'
    )
    assert got["`5` -> `6`"] == 'LABEL = "héllo ✓"; N = 1 if 2 < 3 else 4\n\x0cM = 6\r\nK = 6 - 7\n'
    assert got["`-` -> `+`"] == 'LABEL = "héllo ✓"; N = 1 if 2 < 3 else 4\n\x0cM = 5\r\nK = 6 + 7\n'
    # A statement sharing its line with another is not removed (that would take both).
    assert not any(d.startswith("`N = ") or d.startswith("`LABEL") for d in got)


def test_a_real_module_gives_many_small_candidates() -> None:
    source = inspect.getsource(json.decoder)
    found = list(mutations("json/decoder.py", source))
    assert len(found) > 100
    assert {m.kind for m in found} == set(KINDS)
    bound = {"statement": 8, "arguments": 4}  # a statement's lines; arguments on two lines
    for m in found:
        changed = _changes(source, m.source)
        assert 1 <= len(changed) <= bound.get(m.kind, 2), (m.description, changed)
