"""Making a task's hidden cases (`swe clean --validate`): calls into the code its fix changes,
with the fixed code's outputs, which builtin:tests compares outside the patched process.

1. Targets: the functions the gold patch changes (the innermost function around each line
   it adds or removes, in the fixed tree). A fix that changes no function (a module-level
   table, say) has the calls its failing tests make into the package as its ways in.
2. Recorded inputs: the task's test suite runs on the fixed tree (its held-back tests
   included) with the case runner's trace (caserunner.py, mode "record"): each call that
   reaches a target is written down with the module-level package functions still running
   on its stack (the target itself when it is one); only calls whose arguments are plain
   data (numbers, strings, bytes, lists, tuples, dicts, sets) can be replayed.
3. Derived inputs: each recorded call again with one argument nudged (a number +1, -1 or 0,
   a string shortened, emptied, doubled or upper-cased, a list without its last item or
   reversed, a flag flipped), and with an argument taken from another recorded call of the
   same function: inputs no test names.
4. Outputs: every call runs on the fixed tree twice (hash seeds 0 and 1) and on the buggy
   tree once, jailed, each call cut at `case_timeout_s`. A call is kept when the fixed
   tree's two answers agree and hold plain data only; it tells the fix when the buggy
   tree's answer differs. A task needs one that does (else a patch that fixes nothing would
   match them all).
5. Choice: the telling calls first, spread over the functions (at most `telling`), then
   others that guard what the fix must not break (at most `guarding`).

Why a task has none (`CaseMaker.make`'s reasons): not_pytest (the test command is not
`python -m pytest ...`), no_function_changed (the fix changes no function and no failing
test is known), no_call_recorded (no call reaching the changed code had plain inputs),
none_tell_the_fix (no kept call's answer differs on the buggy tree), recording_failed (the
suite did not run on the fixed tree).
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from harnessrl.services.reward.coding_task import JUNIT_PLACEHOLDER, CodingTask
from harnessrl.services.reward.group_run import clean_env
from harnessrl.services.reward.hidden_cases import (
    HiddenCases,
    interpreter,
    outcome_of,
    parse,
    plain,
)
from harnessrl.services.reward.jail import JAIL_TMP
from harnessrl.services.reward.patch_tests import JUNIT_IN_JAIL, Copy, TestsReward
from harnessrl.services.reward.repo_copy import apply_patch

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")
_TEST_FILES = ["test_*.py", "*_test.py", "tests.py", "conftest.py"]
_TEST_DIRS = ["tests", "test", "testing"]


@dataclass(frozen=True, slots=True)
class CaseSettings:
    per_function: int = 100
    """Distinct recorded calls kept per function."""
    arg_bytes: int = 4096
    """Largest recorded input (its tagged JSON)."""
    derived: int = 400
    """Most calls run (recorded and derived together)."""
    case_timeout_s: float = 2.0
    """A call of the fixed code that runs longer is not a case."""
    telling: int = 32
    guarding: int = 16


@dataclass(frozen=True, slots=True)
class Target:
    path: str
    """Repository-relative file."""
    qualname: str
    line: int
    """The first line of its code object: its first decorator's, or its `def`'s."""


def changed_functions(patch: str, fixed: Mapping[str, str]) -> list[Target]:
    """The innermost functions of the fixed tree (`fixed`: path -> source) around each line
    the patch adds, or next to each line it removes; in order, without repeats."""
    found: dict[tuple[str, int], Target] = {}
    for path, lines in _touched(patch).items():
        source = fixed.get(path)
        if source is None or not path.endswith(".py"):
            continue
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        spans = function_spans(tree)
        for line in lines:
            inner = [s for s in spans if s[0] <= line <= s[1]]
            if inner:
                _, _, qualname, first = max(inner, key=lambda s: s[0])
                found.setdefault((path, first), Target(path, qualname, first))
    return list(found.values())


def _touched(patch: str) -> dict[str, list[int]]:
    """path -> the new-side lines the patch adds (for a removal: the line after it)."""
    touched: dict[str, list[int]] = {}
    path, line = None, 0
    for text in patch.splitlines():
        if text.startswith("+++ "):
            name = text[4:].strip()
            path = None if name == "/dev/null" else name.removeprefix("b/")
        elif (hunk := _HUNK.match(text)) is not None:
            line = int(hunk.group(1))
        elif path is None or text.startswith(("---", "diff ", "index ")):
            continue
        elif text.startswith("+"):
            touched.setdefault(path, []).append(line)
            line += 1
        elif text.startswith("-"):
            touched.setdefault(path, []).append(line)
        elif text.startswith(" "):
            line += 1
    return touched


def function_spans(tree: ast.AST) -> list[tuple[int, int, str, int]]:
    """(first line, last line, qualname, code object's first line) of every function."""
    return list(_functions(tree, ""))


def _functions(node: ast.AST, prefix: str) -> Iterator[tuple[int, int, str, int]]:
    """(first line, last line, qualname, code object's first line) of every function."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{child.name}"
            first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
            yield child.lineno, child.end_lineno or child.lineno, name, first
            yield from _functions(child, f"{name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def pytest_invocation(command: Sequence[str]) -> tuple[str, list[str]] | None:
    """(import root, pytest's arguments) of a `[env PYTHONPATH=ROOT] python -m pytest ...`
    command; None for any other command."""
    words = list(command)
    for at in range(len(words) - 1):
        if words[at] == "-m" and words[at + 1] == "pytest":
            roots = [w.split("=", 1)[1] for w in words[:at] if w.startswith("PYTHONPATH=")]
            args = [w.replace(JUNIT_PLACEHOLDER, JUNIT_IN_JAIL) for w in words[at + 2 :]]
            return (roots[0] if roots else "."), args
    return None


def package_roots(targets: Sequence[Target]) -> list[str]:
    """Where the package code is: the top folder (or module) of each changed file, one
    level deeper under src/ or lib/."""
    roots = []
    for target in targets:
        parts = target.path.split("/")
        depth = 2 if len(parts) > 2 and parts[0] in ("src", "lib") else 1
        roots.append("/".join(parts[:depth]))
    return list(dict.fromkeys(roots))


@dataclass(frozen=True, slots=True)
class RecordedCall:
    module: str
    function: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    def key(self) -> bytes:
        return orjson.dumps([self.module, self.function, self.args, self.kwargs])

    def as_input(self, case_id: str) -> dict[str, Any]:
        return {
            "id": case_id,
            "module": self.module,
            "function": self.function,
            "args": list(self.args),
            "kwargs": [list(pair) for pair in self.kwargs],
        }


def derived(calls: Sequence[RecordedCall], limit: int) -> list[RecordedCall]:
    """The recorded calls, then the calls derived from them (see the module docstring), in
    a fixed order, without repeats, at most `limit`."""
    out: dict[bytes, RecordedCall] = {}
    for call in itertools.chain(calls, _nudged(calls), _crossed(calls)):
        if len(out) >= limit:
            break
        out.setdefault(call.key(), call)
    return list(out.values())


def _nudged(calls: Sequence[RecordedCall]) -> Iterator[RecordedCall]:
    for call in calls:
        for at, value in enumerate(call.args):
            for other in _nudges(value):
                yield RecordedCall(
                    call.module, call.function, (*call.args[:at], other, *call.args[at + 1 :]),
                    call.kwargs,
                )  # fmt: skip


def _nudges(value: Any) -> list[Any]:
    """Values near a tagged input value."""
    if isinstance(value, bool):
        return [not value]
    if not isinstance(value, dict) or len(value) != 1:
        return []
    ((tag, raw),) = value.items()
    if tag == "i":
        number = int(raw)
        return [{"i": str(number + 1)}, {"i": str(number - 1)}, {"i": "0"}]
    if tag == "s":
        return [{"s": raw[:-1]}, {"s": ""}, {"s": raw + raw[:1]}, {"s": raw.upper()}]
    if tag in ("l", "t"):
        return [{tag: raw[:-1]}, {tag: raw[::-1]}] if raw else []
    return []


def _crossed(calls: Sequence[RecordedCall]) -> Iterator[RecordedCall]:
    """Calls of one function with one argument from another call of it."""
    by_function: dict[tuple[str, str], list[RecordedCall]] = {}
    for call in calls:
        by_function.setdefault((call.module, call.function), []).append(call)
    for group in by_function.values():
        for first, second in itertools.permutations(group[:12], 2):
            if len(first.args) != len(second.args):
                continue
            for at in range(len(first.args)):
                args = (*first.args[:at], second.args[at], *first.args[at + 1 :])
                yield RecordedCall(first.module, first.function, args, first.kwargs)


class CaseMaker:
    """Runs the steps of the module docstring for one task with `reward`'s jail."""

    def __init__(self, reward: TestsReward, settings: CaseSettings | None = None) -> None:
        self._reward = reward
        self._settings = settings or CaseSettings()

    async def make(
        self, coding: CodingTask, gold_patch: str, failing: Sequence[str] = ()
    ) -> HiddenCases | str:
        """The task's hidden cases, or the reason (see the module docstring) it has none.
        `failing`: the tests the fix makes pass (FAIL_TO_PASS)."""
        invocation = pytest_invocation(coding.command_words())
        if invocation is None:
            return "not_pytest"
        import_root, pytest_args = invocation
        async with self._reward.copy(coding) as fixed, self._reward.copy(coding) as buggy:
            await _apply(fixed, coding.test_patch, "task metadata.test_patch")
            await _apply(fixed, gold_patch, "the gold patch")
            sources = {
                path: (fixed.repo / path).read_text(errors="replace")
                for path in fixed.base
                if path.endswith(".py") and (fixed.repo / path).is_file()
            }
            sources |= _added_files(fixed.repo, gold_patch)
            targets = changed_functions(gold_patch, sources)
            roots = package_roots([*targets, *(Target(p, "", 0) for p in _touched(gold_patch))])
            if not targets and not failing:
                return "no_function_changed"
            recorded = await self._record(
                coding,
                fixed,
                invocation=(import_root, pytest_args),
                targets=targets,
                roots=roots,
                failing=failing,
            )
            if recorded is None:
                return "recording_failed"
            if not recorded:
                return "no_call_recorded"
            calls = derived(recorded, self._settings.derived)
            first = await self._answers(coding, fixed, import_root, calls, "0")
            second = await self._answers(coding, fixed, import_root, calls, "1")
            before = await self._answers(coding, buggy, import_root, calls, "0")
        return self._choose(import_root, calls, first, second, before)

    async def _record(
        self,
        coding: CodingTask,
        fixed: Copy,
        *,
        invocation: tuple[str, list[str]],
        targets: Sequence[Target],
        roots: Sequence[str],
        failing: Sequence[str],
    ) -> list[RecordedCall] | None:
        import_root, pytest_args = invocation
        config = {
            "mode": "record",
            "import_root": import_root,
            "targets": [[str(fixed.repo / t.path), t.line] for t in targets],
            "focus": list(failing),
            "package": [str(fixed.repo / root) for root in roots],
            "exclude": _TEST_FILES,
            "exclude_dirs": _TEST_DIRS,
            "pytest": ["-p", "no:cacheprovider", *pytest_args],
            "per_function": self._settings.per_function,
            "arg_bytes": self._settings.arg_bytes,
        }
        env = clean_env(Path(JAIL_TMP), Path(JAIL_TMP)) | {"PYTHONHASHSEED": "0"}
        if not coding.plugin_autoload:
            env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        jailed = await self._reward.run_in_jail(
            coding, fixed, _python(coding, env), orjson.dumps(config), env
        )
        lines = [orjson.loads(line) for line in jailed.channel.splitlines()]
        if jailed.outcome.timed_out or not any("end" in line for line in lines):
            return None
        return [
            RecordedCall(
                c["module"], c["function"], tuple(c["args"]), tuple(map(tuple, c["kwargs"]))
            )
            for line in lines
            if (c := line.get("call")) is not None
        ]

    async def _answers(
        self,
        coding: CodingTask,
        copy: Copy,
        import_root: str,
        calls: Sequence[RecordedCall],
        seed: str,
    ) -> dict[str, dict[str, Any]]:
        """Each call's answer (its outcome) by case id ("c<n>", the call's index)."""
        config = {
            "mode": "run",
            "import_root": import_root,
            "case_timeout_s": self._settings.case_timeout_s,
            "cases": [call.as_input(f"c{n}") for n, call in enumerate(calls)],
        }
        env = clean_env(Path(JAIL_TMP), Path(JAIL_TMP)) | {"PYTHONHASHSEED": seed}
        jailed = await self._reward.run_in_jail(
            coding, copy, _python(coding, env), orjson.dumps(config), env
        )
        answers = parse(jailed.channel)
        return {
            case_id: outcome_of(given[0])
            for case_id, given in answers.by_id.items()
            if len(given) == 1 and "t" not in given[0]
        }

    def _choose(
        self,
        import_root: str,
        calls: Sequence[RecordedCall],
        first: Mapping[str, dict[str, Any]],
        second: Mapping[str, dict[str, Any]],
        before: Mapping[str, dict[str, Any]],
    ) -> HiddenCases | str:
        telling: dict[tuple[str, str], list[int]] = {}
        guarding: list[int] = []
        for n, call in enumerate(calls):
            answer = first.get(f"c{n}")
            if answer is None or answer != second.get(f"c{n}") or "e" in answer:
                continue
            if not plain(answer):
                continue
            if before.get(f"c{n}") != answer:
                telling.setdefault((call.module, call.function), []).append(n)
            else:
                guarding.append(n)
        if not telling:
            return "none_tell_the_fix"
        chosen = _round_robin(list(telling.values()), self._settings.telling)
        chosen += guarding[: self._settings.guarding]
        cases = []
        for number, n in enumerate(chosen):
            data = calls[n].as_input(f"c{number}") | {"expect": first[f"c{n}"]}
            cases.append(data)
        return HiddenCases.from_metadata({"import_root": import_root, "cases": cases})


def _round_robin(groups: list[list[int]], limit: int) -> list[int]:
    """Items taken from each group in turn, at most `limit`, in their order."""
    out: list[int] = []
    for row in itertools.zip_longest(*groups):
        out += [n for n in row if n is not None]
    return sorted(out[:limit])


def _python(coding: CodingTask, env: Mapping[str, str]) -> str:
    return interpreter(coding.command_words(), coding.environment, env["PATH"])


async def _apply(copy: Copy, patch: str, what: str) -> None:
    """Apply `patch` to the copy; ValueError "<what>: does not apply: ..." when it fails."""
    if not patch.strip():
        return
    diff = copy.workdir / f"case-{len(list(copy.workdir.glob('case-*.diff')))}.diff"
    diff.write_text(patch if patch.endswith("\n") else patch + "\n")
    error = await apply_patch(copy.repo, diff)
    if error is not None:
        raise ValueError(f"{what}: does not apply: {error}")


def _added_files(repo: Path, patch: str) -> dict[str, str]:
    """Python files the patch adds (not in the commit's file list)."""
    added = {}
    for path in _touched(patch):
        if path.endswith(".py") and (repo / path).is_file():
            added[path] = (repo / path).read_text(errors="replace")
    return added
