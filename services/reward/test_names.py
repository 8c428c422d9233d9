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
from collections.abc import Mapping, Sequence

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


def named_by(named: str, nodeids: Sequence[str]) -> list[str]:
    """The node ids the named test names."""
    target = address_of(named)
    bare = _PARAMS.search(target) is None
    return [
        nodeid
        for nodeid in nodeids
        if _names(target, address := address_of(nodeid))
        or (bare and _names(target, _unparam(address)))
    ]


def status_of(
    named: str, outcomes: Mapping[str, Outcome], collectors: Mapping[str, str]
) -> Outcome | None:
    """The named test's outcome from the run's test outcomes (node id -> outcome) and its
    collectors that did not pass (node id -> "failed" or "skipped"); None when missing."""
    hits = [outcomes[n] for n in named_by(named, list(outcomes))]
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


def _names(target: str, address: str) -> bool:
    return address == target or address.endswith("." + target)


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
