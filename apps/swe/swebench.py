"""SWE-bench-format tasks, as the public datasets export them (SWE-bench, SWE-Gym, SWE-smith,
SWE-rebench, R2E-Gym): one JSON object per line with

    instance_id, repo, base_commit, patch, problem_statement, FAIL_TO_PASS   (required)
    test_patch, PASS_TO_PASS, version, environment_setup_commit, created_at, ...

FAIL_TO_PASS and PASS_TO_PASS are lists of test names; SWE-bench stores them as JSON text
of a list, the others as lists: both are read. Fields this module does not use are kept in
`extra` and written back unchanged. Every problem is a SchemaError naming the field.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import orjson

REQUIRED = ("instance_id", "repo", "base_commit", "patch", "problem_statement", "FAIL_TO_PASS")
_TEXTS = ("test_patch",)
_LISTS = ("FAIL_TO_PASS", "PASS_TO_PASS")
_DIFF_PATH = re.compile(r"^diff --git a/(\S+) b/(\S+)$|^(?:---|\+\+\+) (?:[ab]/)?(\S+)", re.M)
_TEST_NAME = re.compile(r"(^|/)(tests?|testing)(/|$)|(^|/)(test_[^/]*|[^/]*_tests?)\.py$")


class SchemaError(ValueError):
    """A record that is not a task; names the field and the reason."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(f"field '{field}': {reason}" if field else reason)
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class SweTask:
    instance_id: str
    repo: str
    """The project: "owner/name" in the public datasets, a local repository for synthesized
    tasks."""
    base_commit: str
    """The state the agent starts from (the bug present)."""
    patch: str
    """The gold patch: the fix, never shown to the agent."""
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    """Tests that fail at base_commit and pass with the gold patch."""
    pass_to_pass: tuple[str, ...] = ()
    """Tests that pass both times."""
    test_patch: str = ""
    """Tests the fix added or changed (applied before the tests run; empty when the tests
    are already in the repository, as in synthesized tasks)."""
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def project(self) -> str:
        """What splits and duplicates are per: the record's `project` (synthesized tasks,
        one repository each, name it), else its repository."""
        project = self.extra.get("project")
        return project if isinstance(project, str) and project else self.repo


def parse_task(record: Any) -> SweTask:
    """The task a decoded JSON record describes. Raises SchemaError."""
    if not isinstance(record, dict):
        raise SchemaError(None, f"a task is a JSON object, not {type(record).__name__}")
    for name in REQUIRED:
        if name not in record or record[name] is None:
            raise SchemaError(name, "required")
    texts = {}
    for name in ("instance_id", "repo", "base_commit", "patch", "problem_statement"):
        value = record[name]
        if not isinstance(value, str):
            raise SchemaError(name, f"must be a string, not {type(value).__name__}")
        texts[name] = value
    for name in ("instance_id", "repo", "base_commit"):
        if not texts[name].strip() or texts[name] != texts[name].strip():
            raise SchemaError(name, "must be non-empty, without surrounding spaces")
    test_patch = record.get("test_patch") or ""
    if not isinstance(test_patch, str):
        raise SchemaError("test_patch", f"must be a string, not {type(test_patch).__name__}")
    lists = {name: _tests(record, name) for name in _LISTS}
    known = {*REQUIRED, *_TEXTS, *_LISTS}
    return SweTask(
        instance_id=texts["instance_id"],
        repo=texts["repo"],
        base_commit=texts["base_commit"],
        patch=texts["patch"],
        problem_statement=texts["problem_statement"],
        fail_to_pass=lists["FAIL_TO_PASS"],
        pass_to_pass=lists["PASS_TO_PASS"],
        test_patch=test_patch,
        extra={k: v for k, v in record.items() if k not in known},
    )


def _tests(record: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = record.get(name)
    if value is None:
        return ()
    if isinstance(value, str):  # SWE-bench: the list as JSON text
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as err:
            reason = f"a string must hold a JSON list of test names ({err})"
            raise SchemaError(name, reason) from None
    if not isinstance(value, list):
        raise SchemaError(name, f"must be a list of test names, not {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise SchemaError(f"{name}[{i}]", "must be a non-empty string")
    return tuple(value)


def to_record(task: SweTask) -> dict[str, Any]:
    """The task in the public datasets' field names (the lists as lists)."""
    return {
        "instance_id": task.instance_id,
        "repo": task.repo,
        "base_commit": task.base_commit,
        "patch": task.patch,
        "test_patch": task.test_patch,
        "problem_statement": task.problem_statement,
        "FAIL_TO_PASS": list(task.fail_to_pass),
        "PASS_TO_PASS": list(task.pass_to_pass),
        **task.extra,
    }


def to_harnessrl(task: SweTask, split: str, group_size: int | None = None) -> dict[str, Any]:
    """The task as a line of a harnessrl task file (`harnessrl submit`): the input the
    harness gets (the problem statement, where to clone the repository, its environment and
    how to run its tests) and the metadata builtin:tests scores with (never shown to the
    harness: the tests that count, those held back, those allowed to fail, the paths the
    patch must leave alone, the hidden cases)."""
    command = task.extra.get("test_command")
    environment = task.extra.get("environment")
    protected = sorted(
        {
            *([task.extra["tests_dir"]] if isinstance(task.extra.get("tests_dir"), str) else []),
            *patch_paths(task.test_patch),
        }
    )
    metadata: dict[str, Any] = {
        "repo": task.repo,
        "base_commit": task.base_commit,
        "test_command": command,
        "tests": [*task.fail_to_pass, *task.pass_to_pass],
        "protected_paths": protected,
        "scoring": "all_pass",
    }
    if task.test_patch.strip():
        metadata["test_patch"] = task.test_patch
    known = _strings(task.extra.get("known_failures"))
    if known is not None:  # the regression rule: no other test may fail
        metadata["known_failures"] = known
    if isinstance(environment, str):
        metadata["environment"] = environment
    if isinstance(task.extra.get("hidden_cases"), Mapping):  # made by `clean --validate`
        metadata["hidden_cases"] = task.extra["hidden_cases"]
    line: dict[str, Any] = {
        "task_id": task.instance_id,
        "split": split,
        "input": {
            "instance_id": task.instance_id,
            "problem_statement": task.problem_statement,
            "repo": task.repo,
            "base_commit": task.base_commit,
            "environment": environment if isinstance(environment, str) else None,
            "python_path": _strings(task.extra.get("python_path")),
            "test_command": _shell(command) if isinstance(command, list) else None,
        },
        "metadata": metadata,
    }
    if group_size is not None:
        line["group_size"] = group_size
    return line


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _shell(command: list[str]) -> str:
    """The test command as the agent would type it: without the report options."""
    words: list[str] = []
    for word in command:
        if word.startswith(("--junitxml=", "junit_")):
            if word.startswith("junit_") and words and words[-1] == "-o":
                words.pop()
            continue
        words.append(word)
    return shlex.join(words)


def read_records(path: Path) -> Iterator[tuple[int, SweTask | SchemaError]]:
    """(line number, task or why not) for each non-blank line of a JSON-lines file, or each
    element of a file holding one JSON array (numbered from 1)."""
    data = path.read_bytes()
    if data.lstrip()[:1] == b"[":
        try:
            items = orjson.loads(data)
        except orjson.JSONDecodeError as err:
            yield 1, SchemaError(None, f"not a JSON array: {err}")
            return
        for number, item in enumerate(items, 1):
            yield number, _parsed(item)
        return
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError as err:
            yield number, SchemaError(None, f"not JSON: {err}")
            continue
        yield number, _parsed(item)


def _parsed(item: Any) -> SweTask | SchemaError:
    try:
        return parse_task(item)
    except SchemaError as err:
        return err


def patch_paths(patch: str) -> list[str]:
    """The repository paths a unified diff touches (either side; /dev/null left out)."""
    paths: set[str] = set()
    for match in _DIFF_PATH.finditer(patch):
        for path in match.groups():
            if path and path != "/dev/null":
                paths.add(path)
    return sorted(paths)


def is_test_path(path: str) -> bool:
    """Whether a path is test code or changes how tests run: under tests/, test/ or
    testing/, test_*.py, *_test.py, conftest.py, or the test runners' configuration."""
    name = PurePosixPath(path).name
    if name in ("conftest.py", "pytest.ini", "tox.ini", "noxfile.py"):
        return True
    return bool(_TEST_NAME.search(path))
