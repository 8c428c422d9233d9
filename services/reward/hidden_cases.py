"""Hidden cases: builtin:tests' verdict on what the patched code computes, decided outside
the process that runs it.

A task's metadata (never shown to the harness) may hold `hidden_cases`: calls into the
functions its fix changes (or their callers), with the inputs `swe clean --validate`
recorded from the test suite on the fixed tree and derived from them, and what the fixed
code returned, raised and left in its arguments (tagged plain data, see caserunner.py):

    "hidden_cases": {"import_root": ".", "cases": [
        {"id": "c0", "module": "six", "function": "ensure_str", "args": [{"s": "x"}],
         "kwargs": [], "expect": {"r": {"s": "x"}, "a": [{"s": "x"}], "k": []}}]}

The patched copy runs them in a fresh interpreter in the test jail (caserunner.py, mode
"run"), which receives the inputs only and writes bytes to the jail's capped channel. Here
those bytes are parsed with orjson, which builds dicts, lists, strings, numbers and nothing
else (no class of the package is ever made in the reward), and compared with the expected
outputs. A case matches when exactly one answer names it and that answer equals its
expectation; the run matches when every case does and the runner reached its end. A patch
whose code does not compute the fixed code's outputs cannot know what to write: the
expectations never enter the jail.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

RUNNER = Path(__file__).with_name("caserunner.py")
MAX_CASES = 256
"""Most cases a task may hold (a run's answers must fit its channel)."""


@dataclass(frozen=True, slots=True)
class HiddenCase:
    id: str
    module: str
    function: str
    args: tuple[Any, ...]
    """Tagged plain data, one per positional argument."""
    kwargs: tuple[tuple[str, Any], ...]
    expect: Mapping[str, Any]
    """{"r": returned} or {"x": exception type}, with "a" and "k" (the arguments after)."""

    def as_input(self) -> dict[str, Any]:
        """What the runner is given: the call, never its expectation."""
        return {
            "id": self.id,
            "module": self.module,
            "function": self.function,
            "args": list(self.args),
            "kwargs": [list(pair) for pair in self.kwargs],
        }

    def as_metadata(self) -> dict[str, Any]:
        return self.as_input() | {"expect": dict(self.expect)}


@dataclass(frozen=True, slots=True)
class HiddenCases:
    import_root: str
    """Where the runner imports the project from, relative to the repository."""
    cases: tuple[HiddenCase, ...]

    @classmethod
    def from_metadata(cls, value: Any) -> HiddenCases:
        """Raises ValueError naming the field, "task metadata.hidden_cases...: why"."""
        where = "task metadata.hidden_cases"
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: must be an object")
        root = value.get("import_root", ".")
        if not isinstance(root, str) or root.startswith("/") or ".." in root.split("/"):
            raise ValueError(f"{where}.import_root: must be a path inside the repository")
        cases = value.get("cases")
        if not isinstance(cases, list) or not cases:
            raise ValueError(f"{where}.cases: must be a non-empty list")
        if len(cases) > MAX_CASES:
            raise ValueError(f"{where}.cases: at most {MAX_CASES}")
        parsed = tuple(_case(f"{where}.cases[{i}]", case) for i, case in enumerate(cases))
        if len({case.id for case in parsed}) != len(parsed):
            raise ValueError(f"{where}.cases: ids must be unique")
        return cls(root, parsed)

    def as_metadata(self) -> dict[str, Any]:
        return {"import_root": self.import_root, "cases": [c.as_metadata() for c in self.cases]}

    def runner_input(self) -> bytes:
        """The runner's standard input: the calls, never their expectations."""
        cases = [case.as_input() for case in self.cases]
        return orjson.dumps({"mode": "run", "import_root": self.import_root, "cases": cases})


def _case(where: str, value: Any) -> HiddenCase:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: must be an object")
    for name in ("id", "module", "function"):
        if not isinstance(value.get(name), str) or not value[name]:
            raise ValueError(f"{where}.{name}: must be a non-empty string")
    args, kwargs, expect = value.get("args"), value.get("kwargs"), value.get("expect")
    if not isinstance(args, list):
        raise ValueError(f"{where}.args: must be a list")
    if not isinstance(kwargs, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in kwargs
    ):
        raise ValueError(f"{where}.kwargs: must be a list of [name, value] pairs")
    if not isinstance(expect, Mapping) or ("r" in expect) == ("x" in expect):
        raise ValueError(f"{where}.expect: must hold either r (returned) or x (raised)")
    return HiddenCase(
        value["id"],
        value["module"],
        value["function"],
        tuple(args),
        tuple((k, v) for k, v in kwargs),
        dict(expect),
    )


@dataclass(frozen=True, slots=True)
class Answers:
    """What a runner wrote, parsed into plain data: its answer per case id."""

    by_id: dict[str, list[dict[str, Any]]]
    ended: bool
    """The runner wrote its end line (it ran every case)."""
    malformed: int
    """Lines that are not an answer (package code writing to the channel, say)."""


def parse(channel: bytes) -> Answers:
    """The runner's lines, decoded to plain data only (orjson builds no other type)."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    ended, malformed = False, 0
    for line in channel.splitlines():
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError:
            malformed += 1
            continue
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            by_id.setdefault(item["id"], []).append(item)
        elif isinstance(item, dict) and set(item) == {"end"}:
            ended = True
        else:
            malformed += 1
    return Answers(by_id, ended, malformed)


def outcome_of(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an answer that is compared: returned or raised, arguments after."""
    return {key: answer[key] for key in ("r", "x", "e", "a", "k") if key in answer}


def plain(data: Any) -> bool:
    """Whether tagged data holds plain values only, no object known by its type alone (the
    runner's `replayable`, which cannot import this module from inside the jail)."""
    if isinstance(data, list):
        return all(plain(item) for item in data)
    if isinstance(data, dict):
        return "o" not in data and "big" not in data and all(map(plain, data.values()))
    return True


def mismatch(case: HiddenCase, answers: Answers) -> str | None:
    """Why the answers do not match `case`; None when they do."""
    given = answers.by_id.get(case.id, [])
    if len(given) != 1:
        return f"{case.id}: {len(given)} answers"
    if outcome_of(given[0]) != dict(case.expect):
        return f"{case.id}: {case.module}.{case.function} computed something else"
    return None


def mismatches(cases: HiddenCases, answers: Answers) -> list[str]:
    """Why the answers do not match, one line per case that does not, and one when the
    runner stopped before its end (empty: the run matches)."""
    found = [why for case in cases.cases if (why := mismatch(case, answers)) is not None]
    if not answers.ended:
        found.append("the runner did not reach its end")
    return found


def interpreter(command_words: Sequence[str], environment: str | None, path: str) -> str:
    """The task's Python: its environment's, else the first word of its test command that
    names a Python interpreter (by path, or by name on `path`). Raises ValueError."""
    if environment is not None:
        for name in ("python3", "python"):
            candidate = os.path.join(environment, "bin", name)
            if os.access(candidate, os.X_OK):
                return candidate
    for word in command_words:
        if os.path.basename(word).startswith("python"):
            found = word if os.path.isabs(word) else shutil.which(word, path=path)
            if found is not None:
                return found
    raise ValueError(
        "task metadata.hidden_cases: no Python interpreter in the test command or the "
        "environment to run them with"
    )


def runner_argv(python: str) -> list[str]:
    """The runner as a command: isolated mode (no PYTHON* variable, no user site, no script
    directory on the path), its text given on the command line."""
    return [python, "-I", "-c", RUNNER.read_text()]
