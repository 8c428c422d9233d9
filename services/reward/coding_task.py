"""A coding task as the `tests` reward reads it from the task metadata.

The metadata (never shown to the harness) names the repository and the commit the harness
started from, how to run the tests, which tests count and which paths the patch must leave
alone:

    {"repo": "/srv/tasks/proj.git", "base_commit": "4f1c2e0",
     "test_command": ["python", "-m", "pytest", "-p", "no:cacheprovider",
                      "--junitxml={junit_xml}", "tests"],
     "tests": ["tests/test_x.py::test_a"], "protected_paths": ["tests"],
     "scoring": "fraction", "timeout_s": 120, "plugin_autoload": false}

`plugin_autoload` (default false) lets pytest load the plugins installed in the task's
environment by their entry points; without it the run has PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
and a task that needs a plugin names it in its command (`-p xdist.plugin`).

`runner` (default "pytest"): the command runs pytest, and the score comes from what the
test guard proves (see `grading`); "command": any other command, scored by its exit status
alone (code under test runs in the process that decides it: nothing is proved). Optional:
`environment` (the Python environment the command runs, a venv or prefix directory: where
the guard is mounted; by default found from the command's words), `known_failures` (tests
that may fail: with it, any other failing test scores 0, named or not), `hidden_cases`
(calls whose outputs the patched code must reproduce: see `hidden_cases`).

Every problem raises ValueError naming the field, e.g. "task metadata.base_commit: required".
"""

from __future__ import annotations

import math
import numbers
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal, cast

from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.hidden_cases import HiddenCases

JUNIT_PLACEHOLDER = "{junit_xml}"
"""In the test command, replaced by a path inside the jail for a JUnit XML report (which
nothing reads: the score comes from the test guard)."""

Scoring = Literal["fraction", "all_pass"]
_SCORINGS: tuple[Scoring, ...] = ("fraction", "all_pass")
Runner = Literal["pytest", "command"]
_RUNNERS: tuple[Runner, ...] = ("pytest", "command")


@dataclass(frozen=True, slots=True)
class CodingTask:
    """What the metadata says, validated, with the settings' defaults applied."""

    repo: str
    """A local git repository's path, or any URL `git clone` accepts."""
    base_commit: str
    """The commit-ish the patch applies to."""
    test_command: tuple[str, ...] | str
    """An argv, or one string run with `sh -c`."""
    tests: tuple[str, ...]
    """The named tests that score (unique, in order); () scores the command's exit code."""
    protected_paths: tuple[str, ...]
    """Repository-relative paths (files or directories) the patch must not change."""
    scoring: Scoring
    timeout_s: float
    """The settings' timeout, lowered by the metadata's."""
    plugin_autoload: bool = False
    """Whether pytest may load the environment's plugins by their entry points."""
    test_patch: str = ""
    """The tests of the fix (a unified diff, as SWE-bench's `test_patch`), applied after the
    harness's patch has passed the rules, before the run; "" when every test is already in
    the repository. Its paths belong in `protected_paths`."""
    runner: Runner = "pytest"
    environment: str | None = None
    """The Python environment the command runs (absolute); None: found from the command."""
    known_failures: tuple[str, ...] | None = None
    """Tests allowed to fail besides the named ones; None: no test outside them is judged."""
    hidden_cases: HiddenCases | None = None
    """Calls whose outputs the patched code must reproduce, judged outside its process
    (`hidden_cases`); None: the task has none."""

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], settings: TestsSettings) -> CodingTask:
        """Raises ValueError naming the field when the metadata cannot describe a task."""
        scoring = metadata.get("scoring")
        if scoring is None:
            scoring = settings.scoring
        if scoring not in _SCORINGS:
            raise ValueError(f"task metadata.scoring: must be one of {list(_SCORINGS)}")
        return cls(
            repo=_text(metadata, "repo"),
            base_commit=_commit(metadata),
            test_command=_command(metadata),
            tests=tuple(dict.fromkeys(_texts(metadata, "tests", required=False))),
            protected_paths=tuple(
                _relative(f"protected_paths[{i}]", p)
                for i, p in enumerate(_texts(metadata, "protected_paths", required=True))
            ),
            scoring=cast(Scoring, scoring),
            timeout_s=_timeout(metadata, settings.timeout_s),
            plugin_autoload=_flag(metadata, "plugin_autoload"),
            test_patch=_optional_text(metadata, "test_patch"),
            runner=_runner(metadata),
            environment=_environment(metadata),
            known_failures=(
                tuple(_texts(metadata, "known_failures", required=False))
                if metadata.get("known_failures") is not None
                else None
            ),
            hidden_cases=(
                HiddenCases.from_metadata(metadata["hidden_cases"])
                if metadata.get("hidden_cases") is not None
                else None
            ),
        )

    def command_with(self, junit_xml: str) -> tuple[str, ...]:
        """The argv to run, the report path in place of every `{junit_xml}`.

        A string command becomes `sh -c <string>`; there the path is shell-quoted (it is
        left as is when it needs no quoting, which is the usual case).
        """
        if isinstance(self.test_command, str):
            quoted = shlex.quote(junit_xml)
            return ("sh", "-c", self.test_command.replace(JUNIT_PLACEHOLDER, quoted))
        return tuple(arg.replace(JUNIT_PLACEHOLDER, junit_xml) for arg in self.test_command)

    def command_words(self) -> tuple[str, ...]:
        """The command's words: the argv, or a string command split as the shell would
        (on whitespace when it does not split)."""
        if not isinstance(self.test_command, str):
            return self.test_command
        try:
            return tuple(shlex.split(self.test_command))
        except ValueError:
            return tuple(self.test_command.split())


def _text(metadata: Mapping[str, Any], name: str) -> str:
    value = metadata.get(name)
    if value is None:
        raise ValueError(f"task metadata.{name}: required")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"task metadata.{name}: must be a non-empty string")
    return value


def _optional_text(metadata: Mapping[str, Any], name: str) -> str:
    value = metadata.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"task metadata.{name}: must be a string")
    return value


def _commit(metadata: Mapping[str, Any]) -> str:
    value = _text(metadata, "base_commit")
    if value.startswith("-") or any(c.isspace() for c in value):
        raise ValueError("task metadata.base_commit: not a commit-ish")
    return value


def _texts(metadata: Mapping[str, Any], name: str, *, required: bool) -> list[str]:
    value = metadata.get(name)
    if value is None:
        if required:
            raise ValueError(f"task metadata.{name}: required (it may be an empty list)")
        return []
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ValueError(f"task metadata.{name}: must be a list of strings")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"task metadata.{name}[{i}]: must be a non-empty string")
    return list(value)


def _command(metadata: Mapping[str, Any]) -> tuple[str, ...] | str:
    value = metadata.get("test_command")
    if value is None:
        raise ValueError("task metadata.test_command: required")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("task metadata.test_command: must not be empty")
        return value
    if not isinstance(value, Sequence) or not value:
        raise ValueError("task metadata.test_command: must be a list of strings or a string")
    for i, arg in enumerate(value):
        if not isinstance(arg, str):
            raise ValueError(f"task metadata.test_command[{i}]: must be a string")
    if not value[0]:
        raise ValueError("task metadata.test_command[0]: must not be empty")
    return tuple(value)


def _relative(where: str, path: str) -> str:
    """The path normalised ("./tests/" is "tests"); refuses what leaves the repository."""
    pure = PurePosixPath(path)
    parts = [part for part in pure.parts if part != "."]
    if pure.is_absolute() or ".." in parts:
        raise ValueError(f"task metadata.{where}: must be relative, inside the repository")
    if not parts:
        raise ValueError(f"task metadata.{where}: names the whole repository")
    return "/".join(parts)


def _runner(metadata: Mapping[str, Any]) -> Runner:
    value = metadata.get("runner", "pytest")
    if value not in _RUNNERS:
        raise ValueError(f"task metadata.runner: must be one of {list(_RUNNERS)}")
    return cast(Runner, value)


def _environment(metadata: Mapping[str, Any]) -> str | None:
    value = _optional_text(metadata, "environment")
    if value and not value.startswith("/"):
        raise ValueError("task metadata.environment: must be an absolute path")
    return value or None


def _flag(metadata: Mapping[str, Any], name: str) -> bool:
    value = metadata.get(name, False)
    if not isinstance(value, bool):
        raise ValueError(f"task metadata.{name}: must be true or false")
    return value


def _timeout(metadata: Mapping[str, Any], ceiling: float) -> float:
    value = metadata.get("timeout_s")
    if value is None:
        return ceiling
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError("task metadata.timeout_s: must be a number of seconds")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError("task metadata.timeout_s: must be a positive number of seconds")
    return min(seconds, ceiling)
