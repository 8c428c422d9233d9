"""Tests a synthesized task holds back from the harness.

A policy that sees every test it is scored by can learn to satisfy those inputs rather than
fix the bug (special-casing the tested values, detecting the test runner and answering from
a table). So a task whose bug breaks tests in several test functions holds some of them
back: their definitions are cut from the test files the harness's repository holds, and
come back only in the reward's copy, through the task's `test_patch` (never shown to the
harness, like SWE-bench's). The problem statement describes only the visible failures.
At least one failing function stays visible, so the harness can reproduce the bug.

    held = choose(failing_tests, key)                 # the functions to hold back
    visible, kept = cut(source, held_in_this_file)    # the file without them

What it leaves open: a task whose bug breaks a single test function holds nothing back;
the held-back tests exercise the same code as the visible ones, so special-casing that
reaches the code's general behaviour (not the tested inputs) is not caught by them.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Iterable, Sequence

_PARAMS = re.compile(r"\[.*\]$")


def function_of(nodeid: str) -> str:
    """The test function a node id belongs to: "file.py::[Class::]name", parameters off."""
    return _PARAMS.sub("", nodeid)


def choose(failing: Sequence[str], key: str) -> list[str]:
    """The test functions (`function_of`) to hold back: half of the failing ones, rounded
    down, chosen by `key` (stable for a task); none when fewer than two fail."""
    functions = sorted(dict.fromkeys(function_of(t) for t in failing))
    if len(functions) < 2:
        return []
    ranked = sorted(functions, key=lambda f: hashlib.sha256(f"{key}\0{f}".encode()).hexdigest())
    return sorted(ranked[: len(functions) // 2])


def cut(source: str, functions: Iterable[str]) -> tuple[str, list[str]]:
    """`source` (one test file) without the definitions of `functions` ("file::name" or
    "file::Class::name" of that file), and the functions actually cut. A function is kept
    (not cut) when it cannot be found, is nested deeper than one class, is used elsewhere
    in the file, or is the last definition of its class."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    drop: set[int] = set()
    cut_out: list[str] = []
    for function in functions:
        span = _span(tree, function.split("::")[1:])
        if span is not None:
            drop.update(range(span[0] - 1, span[1]))
            cut_out.append(function)
    visible = "".join(line for i, line in enumerate(lines) if i not in drop)
    ast.parse(visible)  # still a module
    return visible, cut_out


def _span(tree: ast.Module, path: list[str]) -> tuple[int, int] | None:
    """(first line, last line) of the definition `path` names ([name] or [Class, name])."""
    if len(path) == 1:
        body: list[ast.stmt] = tree.body
    elif len(path) == 2:
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == path[0]]
        if len(classes) != 1:
            return None
        body = classes[0].body
        definitions = [n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
        if len(definitions) < 2 or len(body) < 2:
            return None  # cutting it would leave the class without a body or a test
    else:
        return None
    found = [
        n
        for n in body
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == path[-1]
    ]
    if len(found) != 1 or _used(tree, path[-1], found[0]):
        return None
    node = found[0]
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return first, node.end_lineno or node.lineno


def _used(tree: ast.Module, name: str, definition: ast.AST) -> bool:
    """Whether the file refers to `name` anywhere but its own definition."""
    inside = {id(n) for n in ast.walk(definition)}
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        if isinstance(node, ast.Name) and node.id == name:
            return True
        if isinstance(node, ast.Attribute) and node.attr == name:
            return True
    return False
