"""Which failing tests a synthesized task holds back, and how they are cut from a test file
(harnessrl.apps.swe.holdback)."""

from __future__ import annotations

import ast

from harnessrl.apps.swe.holdback import choose, cut, function_of

SOURCE = """import pytest

from calc import add


@pytest.mark.parametrize("a", [1, 2])
def test_add(a):
    assert add(a, 0) == a


def test_add_zero():
    assert add(0, 0) == 0


def helper_uses_test_neg():
    return test_neg


def test_neg():
    assert add(-1, 1) == 0


class TestK:
    def test_one(self):
        assert add(1, 1) == 2

    def test_two(self):
        assert add(2, 2) == 4


class TestAlone:
    def test_only(self):
        assert add(3, 3) == 6
"""


def test_a_node_id_belongs_to_its_function_without_parameters() -> None:
    assert function_of("t/test_x.py::test_add[1-2]") == "t/test_x.py::test_add"
    assert function_of("t/test_x.py::TestK::test_one") == "t/test_x.py::TestK::test_one"


def test_half_of_the_failing_functions_are_held_back_never_all_and_stably() -> None:
    failing = [f"t.py::test_{n}" for n in "abcde"] + ["t.py::test_a[2]"]
    held = choose(failing, "key-1")
    assert len(held) == 2 and set(held) < {function_of(t) for t in failing}
    assert choose(failing, "key-1") == held  # the same task holds back the same tests
    assert choose(["t.py::test_a[1]", "t.py::test_a[2]"], "k") == []  # one function: none


def test_cut_removes_definitions_with_their_decorators_and_keeps_a_module() -> None:
    visible, done = cut(SOURCE, ["t.py::test_add", "t.py::TestK::test_two"])
    assert done == ["t.py::test_add", "t.py::TestK::test_two"]
    tree = ast.parse(visible)
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "test_add" not in names and "test_two" not in names
    assert {"test_add_zero", "test_one", "test_neg"} <= names
    assert "parametrize" not in visible


def test_cut_keeps_what_it_cannot_remove_safely() -> None:
    visible, done = cut(
        SOURCE,
        [
            "t.py::test_neg",  # used elsewhere in the file
            "t.py::TestAlone::test_only",  # the last test of its class
            "t.py::test_missing",
            "t.py::A::B::test_deep",
        ],
    )
    assert done == [] and visible == SOURCE
