"""A kept bug as a task (`swe synth`'s last stage): a repository of one commit holding the
buggy tree, the gold patch, a problem statement written from what fails, and its
SWE-bench-format record. When the bug breaks several test functions, half of them are held
back (`holdback`): cut from the repository's test files, restored by the task's
`test_patch` in the reward's copy only, and left out of the problem statement.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from harnessrl.apps.swe import env as envs
from harnessrl.apps.swe.candidates import Candidate
from harnessrl.apps.swe.holdback import choose, cut, function_of
from harnessrl.apps.swe.projects import Project
from harnessrl.apps.swe.repository import task_repository, unified_patch
from harnessrl.apps.swe.statement import Failure, problem_statement


@dataclass(frozen=True, slots=True)
class TaskSource:
    """What every task of one project is made from."""

    project: Project
    pristine: Path
    """The project's checkout, as fetched."""
    env: Path
    """Its test environment (a task's `environment`)."""
    out: Path
    """The run's output directory (the task repositories go under out/repos)."""
    reliable: list[str]
    """Tests that PASSED in every baseline run."""
    failing: list[str]
    """Tests that failed or errored in a baseline run (they may fail in a task's run)."""
    command: list[str]
    """The whole suite's test command."""
    full_suite: bool
    """A task runs the whole suite (else the test files of its failing tests)."""
    hold_back: bool
    """Hold back half of the failing test functions from the harness."""


def task_record(
    source: TaskSource, candidate: Candidate, broken: list[str], run: envs.TestRun
) -> dict[str, Any]:
    """The task's repository (written under source.out/repos), and its SWE-bench-format
    record. `broken` is its FAIL_TO_PASS; `run` the candidate's test run."""
    project, mutation = source.project, candidate.mutation
    instance_id = f"{project.name}-{project.version}__{mutation.kind}-{candidate.key[:10]}"
    original = (source.pristine / mutation.path).read_bytes().decode("utf-8")
    patch = unified_patch(mutation.path, mutation.source, original)
    held, visible, test_patch = _held_back(source, candidate, broken)
    changes = {mutation.path: mutation.source, **visible}
    # Named by its content too: the same bug with other tests held back is another tree.
    tree = hashlib.sha256(orjson.dumps(changes, option=orjson.OPT_SORT_KEYS)).hexdigest()
    repo = source.out / "repos" / f"{instance_id}.{tree[:8]}.git"
    commit = task_repository(source.pristine, changes, repo)
    shown = [t for t in broken if function_of(t) not in held]
    failures = [Failure(test, _reported(run, test)) for test in shown]
    return {
        "instance_id": instance_id,
        "repo": str(repo.resolve()),
        "base_commit": commit,
        "patch": patch,
        "test_patch": test_patch,
        "problem_statement": problem_statement(project.name, failures, _fix_lines(patch)),
        **_tests(source, broken),
        "held_back": held,
        "project": project.requirement,
        "environment": str(source.env.resolve()),
        "python_path": [envs.import_root(project)],
        "test_command": _command(source, broken),
        "tests_dir": project.tests,
        "mutation": {
            "path": mutation.path,
            "kind": mutation.kind,
            "line": mutation.line,
            "description": mutation.description,
        },
    }


def _fix_lines(patch: str) -> list[str]:
    """The lines the gold patch removes or adds."""
    return [
        line[1:]
        for line in patch.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def _files(broken: list[str]) -> list[str]:
    return sorted({test.split("::", 1)[0] for test in broken})


def _command(source: TaskSource, broken: list[str]) -> list[str]:
    """The whole suite, or (as SWE-bench does) the test files of the failing tests."""
    return source.command if source.full_suite else [*source.command[:-1], *_files(broken)]


def _tests(source: TaskSource, broken: list[str]) -> dict[str, list[str]]:
    """FAIL_TO_PASS, PASS_TO_PASS (every other reliable test the command runs) and
    known_failures (the tests it runs that failed in a baseline run)."""
    files = _files(broken)

    def scope(test: str) -> bool:
        return source.full_suite or test.split("::", 1)[0] in files

    broken_set = set(broken)
    return {
        "FAIL_TO_PASS": broken,
        "PASS_TO_PASS": [t for t in source.reliable if scope(t) and t not in broken_set],
        "known_failures": [t for t in source.failing if scope(t)],
    }


def _held_back(
    source: TaskSource, candidate: Candidate, broken: list[str]
) -> tuple[list[str], dict[str, str], str]:
    """(the test functions held back, the visible test files they were cut from, the
    test_patch that restores them)."""
    wanted = choose(broken, candidate.key) if source.hold_back else []
    by_file: dict[str, list[str]] = {}
    for function in wanted:
        by_file.setdefault(function.split("::", 1)[0], []).append(function)
    held: list[str] = []
    visible: dict[str, str] = {}
    patches = []
    for path, functions in sorted(by_file.items()):
        full = (source.pristine / path).read_bytes().decode("utf-8")
        text, done = cut(full, functions)
        if done:
            held += done
            visible[path] = text
            patches.append(unified_patch(path, text, full))
    if len({function_of(t) for t in broken} - set(held)) == 0:
        return [], {}, ""  # never all of them: the harness must see the bug fail
    return sorted(held), visible, "".join(patches)


def _reported(run: envs.TestRun, test: str) -> str:
    """What the run says of a test that no longer passes."""
    outcome = run.outcomes.get(test)
    if outcome is None:
        return "E   pytest no longer collects this test (it is not in the run at all)"
    return run.failures.get(test) or f"E   reported {outcome}"
