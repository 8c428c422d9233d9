"""Which of a run's tests a task's named test means, and the named test's outcome.

Node ids and names are compared in pytest's JUnit address form, `classname.name`, which for
`tests/test_x.py::TestA::test_b[1]` is `tests.test_x.TestA.test_b[1]` (the path's slashes
become dots, ".py" goes). A named test is matched generously:

- its address equals the test's, or is a dotted suffix of it: "tests/test_x.py::test_a",
  "tests.test_x.test_a", "test_x.py::test_a" and "test_a" all name `tests.test_x.test_a`
  (a bare name may name several tests, one per file);
- a name without parameters ("test_b") also names every parametrised case ("test_b[1]").

A named test's outcome is the worst of the tests it names (`status_of`); when it names none
that ran, the outcome of a collector that holds it and was skipped or failed to collect (a
module skipped at import, one that failed to import); else it is missing (None).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from harnessrl.services.reward.evidence import Outcome

_PARAMS = re.compile(r"\[.*\]$")
_RANK: dict[str, int] = {
    "passed": 0,
    "xpassed": 2,
    "xfailed": 3,
    "skipped": 4,
    "failed": 5,
    "error": 6,
}
"""Which outcome a named test that names several tests takes."""
_COLLECTOR: dict[str, Outcome] = {"failed": "error", "skipped": "skipped"}


def address_of(nodeid: str) -> str:
    """The JUnit address of a pytest node id (as pytest's junitxml plugin makes it)."""
    parts = nodeid.split("::")
    parts[0] = re.sub(r"\.py$", "", parts[0].replace("/", "."))
    return ".".join(part for part in parts if part)


class NameIndex:
    """The node ids of a run, indexed so that a named test finds what it names at once
    (a task may name thousands of tests)."""

    def __init__(self, nodeids: Iterable[str]) -> None:
        self._exact: dict[str, list[str]] = {}
        """Every dotted suffix of an address -> its node ids."""
        self._bare: dict[str, list[str]] = {}
        """Every dotted suffix of an address without parameters -> its node ids."""
        for nodeid in nodeids:
            address = address_of(nodeid)
            for suffix in _suffixes(address):
                self._exact.setdefault(suffix, []).append(nodeid)
            for suffix in _suffixes(_unparam(address)):
                self._bare.setdefault(suffix, []).append(nodeid)

    def named_by(self, named: str) -> list[str]:
        """The node ids the named test names."""
        target = address_of(named)
        found = list(self._exact.get(target, ()))
        if _PARAMS.search(target) is None:
            found += self._bare.get(target, ())
        return list(dict.fromkeys(found))


def named_by(named: str, nodeids: Sequence[str]) -> list[str]:
    """The node ids the named test names."""
    return NameIndex(nodeids).named_by(named)


def status_of(
    named: str,
    outcomes: Mapping[str, Outcome],
    collectors: Mapping[str, str],
    index: NameIndex | None = None,
) -> Outcome | None:
    """The named test's outcome from the run's test outcomes (node id -> outcome) and its
    collectors that did not pass (node id -> "failed" or "skipped"); None when missing.
    `index`: of the outcomes' node ids, when the caller asks for many names."""
    hits = [outcomes[n] for n in (index or NameIndex(outcomes)).named_by(named)]
    if hits:
        return worst(hits)
    target = address_of(named)
    held = [
        _COLLECTOR[outcome]
        for nodeid, outcome in collectors.items()
        if outcome in _COLLECTOR and _holds(address_of(nodeid), target)
    ]
    return worst(held) if held else None


def worst(outcomes: Sequence[Outcome]) -> Outcome:
    return max(outcomes, key=_RANK.__getitem__)


def _suffixes(address: str) -> list[str]:
    """The address and each of its dotted suffixes ("a.b.c", "b.c", "c"); a dot inside
    parameters ("test_x[1.5]") is not a separator."""
    head, bracket, params = address.partition("[")
    parts = head.split(".")
    tail = bracket + params
    return [".".join(parts[i:]) + tail for i in range(len(parts))]


def _holds(container: str, target: str) -> bool:
    """Whether the collector `container` (a module's or directory's address) holds the test
    `target`, matched as generously as `_names`: a dotted suffix of the container opens the
    target ("tests.test_x" holds "test_x.test_a" and "tests.test_x.test_a")."""
    if not container:
        return True  # the session's own collector holds every test
    outer, inner = container.split("."), _unparam(target).split(".")
    return any(outer[-k:] == inner[:k] for k in range(1, min(len(outer), len(inner) - 1) + 1))


def _unparam(address: str) -> str:
    return _PARAMS.sub("", address)
