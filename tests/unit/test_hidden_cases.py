"""Hidden cases without a jail: the runner's plain encoding (exact types only), the reward's
parse and comparison (plain data only), the metadata's checks, and how cases are made from a
fix (its changed functions, the derived inputs, the test command)."""

from __future__ import annotations

import math

import orjson
import pytest

from harnessrl.apps.swe.case_synthesis import (
    RecordedCall,
    Target,
    changed_functions,
    derived,
    package_roots,
    pytest_invocation,
)
from harnessrl.services.reward.caserunner import decode, encode, replayable
from harnessrl.services.reward.hidden_cases import HiddenCases, mismatches, parse, plain

CASE = {
    "id": "c0",
    "module": "calc",
    "function": "clamp",
    "args": [{"i": "-5"}, {"i": "0"}, {"i": "10"}],
    "kwargs": [],
    "expect": {"r": {"i": "0"}, "a": [{"i": "-5"}, {"i": "0"}, {"i": "10"}], "k": []},
}


def test_plain_values_round_trip_through_their_tags() -> None:
    for value in (
        None,
        True,
        0,
        -(10**40),
        1.5,
        -0.0,
        "tëxt",
        "\ud800lone",
        b"\x00\xff",
        bytearray(b"ab"),
        1 + 2j,
        [1, (2, "x")],
        {"k": [1, {2}], 3: frozenset({"a", "b"})},
    ):
        data = encode(value)
        again = decode(orjson.loads(orjson.dumps(data)))
        assert again == value and type(again) is type(value), value
    assert math.isnan(decode(encode(float("nan"))))


def test_a_subclass_is_never_its_base() -> None:
    """A value whose `__eq__` says yes to everything is written as what it is."""

    class Yes(int):
        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = int.__hash__

    assert encode(Yes(3)) == {"o": f"{__name__}.test_a_subclass_is_never_its_base.<locals>.Yes"}
    assert encode([True, 1]) == {"l": [True, {"i": "1"}]}  # a bool is not an int
    assert not replayable(encode([object()])) and replayable(encode([1, "a"]))
    assert not plain({"r": {"l": [{"o": "x.Y"}]}}) and plain(CASE["expect"])


def test_sets_are_written_in_one_order_and_huge_values_cut() -> None:
    assert encode({"b", "a"}) == encode({"a", "b"}) == {"set": [{"s": "a"}, {"s": "b"}]}
    assert encode(list(range(30000))) == {"big": True}
    deep: list[object] = []
    for _ in range(50):
        deep = [deep]
    assert encode(deep) == {"big": True}


def test_answers_match_only_once_each_and_only_when_equal() -> None:
    cases = HiddenCases.from_metadata({"cases": [CASE]})
    right = orjson.dumps({"id": "c0", **CASE["expect"]})
    end = b'{"end": 1}'
    assert mismatches(cases, parse(right + b"\n" + end)) == []
    assert mismatches(cases, parse(right)) == ["the runner did not reach its end"]
    twice = parse(right + b"\n" + right + b"\n" + end)
    assert mismatches(cases, twice) == ["c0: 2 answers"]
    wrong = orjson.dumps({"id": "c0", "r": {"i": "10"}, "a": [], "k": []})
    assert mismatches(cases, parse(wrong + b"\n" + end)) == [
        "c0: calc.clamp computed something else"
    ]
    junk = parse(b"\x00garbage\n[1, 2]\n" + right + b"\n" + end)
    assert junk.malformed == 2 and mismatches(cases, junk) == []


def test_bad_hidden_cases_name_the_field() -> None:
    for value, field in (
        ([], "task metadata.hidden_cases: must be an object"),
        ({"cases": []}, "task metadata.hidden_cases.cases: must be a non-empty list"),
        ({"cases": [CASE], "import_root": "../up"}, "hidden_cases.import_root"),
        ({"cases": [CASE | {"id": ""}]}, "hidden_cases.cases[0].id"),
        ({"cases": [CASE | {"expect": {}}]}, "hidden_cases.cases[0].expect"),
        ({"cases": [CASE | {"kwargs": [["a"]]}]}, "hidden_cases.cases[0].kwargs"),
        ({"cases": [CASE, CASE]}, "ids must be unique"),
    ):
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace(".", r"\.")):
            HiddenCases.from_metadata(value)


FIXED = """import functools


def outer(a):
    def inner(b):
        return b + 1
    return inner(a)


class K:
    @functools.cache
    def method(self, x):
        return x * 2


def plain(y):
    return y
"""


def test_the_changed_functions_are_the_innermost_around_each_changed_line() -> None:
    patch = (
        "--- a/m.py\n+++ b/m.py\n@@ -6,1 +6,1 @@\n-        return b - 1\n+        return b + 1\n"
        "@@ -13,1 +13,1 @@\n-        return x * 3\n+        return x * 2\n"
    )
    targets = changed_functions(patch, {"m.py": FIXED})
    assert targets == [
        Target("m.py", "outer.<locals>.inner", 5),
        Target("m.py", "K.method", 11),  # the decorator's line: the code object's first
    ]
    outside = "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-import os\n+import functools\n"
    assert changed_functions(outside, {"m.py": FIXED}) == []
    assert package_roots([Target("src/pkg/a.py", "f", 1), Target("six.py", "g", 1)]) == [
        "src/pkg",
        "six.py",
    ]


def test_derived_inputs_nudge_each_argument_and_cross_calls() -> None:
    one = RecordedCall("m", "f", ({"i": "3"}, {"s": "ab"}), ())
    two = RecordedCall("m", "f", ({"i": "7"}, {"s": "xy"}), ())
    calls = derived([one, two], 100)
    assert calls[:2] == [one, two]
    args = {orjson.dumps(c.args) for c in calls}
    assert orjson.dumps(({"i": "4"}, {"s": "ab"})) in args  # nudged
    assert orjson.dumps(({"i": "3"}, {"s": "a"})) in args
    assert orjson.dumps(({"i": "7"}, {"s": "ab"})) in args  # crossed
    assert len(calls) == len(args)
    assert len(derived([one, two], 5)) == 5


def test_the_pytest_invocation_of_a_task_command() -> None:
    command = [
        "env",
        "PYTHONPATH=src",
        "/e/bin/python",
        "-m",
        "pytest",
        "-q",
        "--junitxml={junit_xml}",
        "t",
    ]
    root, args = pytest_invocation(command) or ("", [])
    assert root == "src" and args[0] == "-q" and args[-1] == "t" and "{junit_xml}" not in args[1]
    assert pytest_invocation(["make", "test"]) is None
