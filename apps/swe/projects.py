"""The real open-source projects coding tasks are synthesized from, pinned.

Each is a pure-Python project whose sdist on PyPI ships its test suite. The sdist is pinned
by name, version and the sha256 of the archive (checked before anything of it is used), as
the project pins every artifact it fetches; `code` is where its importable code lives in
the unpacked tree (mutations go there only), `tests` where its tests are.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Project:
    name: str
    version: str
    sha256: str
    """Of the sdist archive."""
    code: str
    """The directory of the importable code, relative to the unpacked tree."""
    tests: str
    """The directory (or file) of the test suite, relative to the unpacked tree."""
    test_requires: tuple[str, ...] = ()
    """What its tests import besides pytest and the project (pinned requirements)."""
    deselect: tuple[str, ...] = ()
    """Tests never run: files or directories (`--ignore`) and node ids (`--deselect`): those
    needing what is not installed (a benchmark plugin) or too slow to run per candidate."""

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


PINNED: tuple[Project, ...] = (
    Project(
        "attrs",
        "26.1.0",
        "d03ceb89cb322a8fd706d4fb91940737b6642aa36998fe130a9bc96c985eff32",
        "src",
        "tests",
        test_requires=("hypothesis==6.170.17", "cloudpickle==3.1.3", "pympler==1.1"),
        deselect=(
            "tests/test_funcs.py",  # hypothesis-heavy: 9 s of the suite
            "tests/test_3rd_party.py",
        ),
    ),
    Project(
        "boltons",
        "26.2.0",
        "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c",
        "boltons",
        "tests",
    ),
    Project(
        "cachetools",
        "8.0.2",
        "30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0",
        "src",
        "tests",
    ),
    Project(
        "humanize",
        "4.17.0",
        "1d6a36c453dbfbb3f0b34601d2e0b4ce5d48d780305cd45714843f0068fde6ac",
        "src",
        "tests",
        test_requires=("freezegun==1.5.5",),
        deselect=("tests/test_benchmarks.py",),
    ),
    Project(
        "idna",
        "3.20",
        "a7db850025b95ded1eae8a46181a1a6c56c92c96f0e2b005d9ff8dc0210cab44",
        "idna",
        "tests",
        deselect=(
            "tests/test_idna_uts46.py",  # 6,329 generated cases, 17 s
            "tests/test_idna_properties.py",  # needs hypothesis
        ),
    ),
    Project(
        "more-itertools",
        "11.2.1",
        "cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63",
        "more_itertools",
        "tests",
        deselect=(
            "tests/test_recipes.py::PrimeFunctionTests::test_primes",  # 22 s of a 43 s suite
            "tests/test_recipes.py::PrimeFunctionTests::test_nth_prime_approximate",
            "tests/test_more.py::TestSerialize::test_concurrent_calls",
            "tests/test_more.py::TestConcurrentTee::test_concurrent_consumers",
            "tests/test_more.py::DiscreteFourierTransformTests::test_roundtrip",
        ),
    ),
    Project(
        "parse",
        "1.22.4",
        "706d458feed5a81b02768d3156e8070baf6cee7d150a3a3c0cd43101a875c3b5",
        "parse",
        "tests",
    ),
    Project(
        "semver",
        "3.1.2",
        "bea193552413194252d33ff26ce0962b76669bd1c6fb17e8e203ac37f072feaf",
        "src",
        "tests",
    ),
    Project(
        "six",
        "1.17.0",
        "ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81",
        "six.py",
        "test_six.py",
    ),
    Project(
        "tabulate",
        "0.8.10",
        "6c57f3f3dd7ac2782770155f3adb2db0b1a269637e42f27599925e64b114f519",
        "tabulate.py",
        "test",
    ),
)
"""Ten projects (the pipeline needs at least 8); six, tabulate, parse and idna have the
quickest suites."""


NOT_PINNED = {
    "packaging": "pytest depends on it: every environment holds a pristine copy",
    "pluggy": "pytest depends on it",
    "iniconfig": "pytest depends on it",
    "jmespath": "its sdist ships tests that import a `tests` package it leaves out",
}
"""Projects that cannot be task sources, and why (the environment check refuses the first
three: the test runner's own dependencies would put the unmutated code in reach)."""


def pinned(names: list[str] | None = None) -> list[Project]:
    """The pinned projects, or those named (by name or name==version). Raises ValueError
    naming an unknown one."""
    if not names:
        return list(PINNED)
    by_name = {p.name: p for p in PINNED} | {p.requirement: p for p in PINNED}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        why = "".join(f" ({n}: {NOT_PINNED[n]})" for n in unknown if n in NOT_PINNED)
        known = ", ".join(p.requirement for p in PINNED)
        raise ValueError(f"unknown project(s) {', '.join(unknown)}{why}; pinned: {known}")
    return [by_name[n] for n in names]
