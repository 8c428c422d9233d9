"""A project's test environment, and what its test suite does in it: `swe synth`'s second
step (which tests pass reliably, before any bug is injected).

    env = environment(project, envs_dir)              # a venv: pytest and the test deps
    run = run_tests(project, repo, env)               # one run: node id -> outcome
    passing = reliable_passes(project, repo, env, 3)  # PASSED in every one of 3 runs

The environment holds the test runner and the project's test dependencies but never the
project itself: the tests import the code from the working copy (its import root on
PYTHONPATH), so no pristine copy of the code is in the agent's reach. pip and setuptools
are removed once the install is done (they vendor six, packaging, idna, more_itertools),
and a build that still holds a module named like the project anywhere fails. Every run is
made as builtin:tests makes it: in the test jail, under the test guard (`reward.jail`), and
its outcomes (and failure texts) are the guard's, so a task's baseline, its checks and its
validation see what its scoring will see. A test counts as passing only when pytest says
passed: not skipped, not xfailed, not deselected.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from harnessrl.apps.swe.projects import Project

JUNIT_PLACEHOLDER = "{junit_xml}"
"""Where a test command's JUnit report goes: builtin:tests' placeholder (coding_task), the
same text, not imported, so the CLI's help stays light."""
PYTEST = "pytest==9.2.0"
"""The test runner every environment gets (pinned, so outcomes do not drift with it)."""
_RECIPE = "recipe 2: pip and setuptools removed after the install"
"""In the stamp: an environment built by an older recipe is built again."""
T = TypeVar("T")
_WORDS = {
    "passed": "PASSED",
    "failed": "FAILED",
    "error": "ERROR",
    "skipped": "SKIPPED",
    "xfailed": "XFAIL",
    "xpassed": "XPASS",
}


class EnvError(RuntimeError):
    """The environment could not be built, or the test runner could not start."""


@dataclass(frozen=True, slots=True)
class TestRun:
    outcomes: dict[str, str]
    """Node id -> PASSED, FAILED, ERROR, SKIPPED, XFAIL or XPASS."""
    failures: dict[str, str] = field(default_factory=dict)
    """Node id -> what the runner reported for it (failures and errors)."""
    seconds: float = 0.0
    timed_out: bool = False
    problems: tuple[str, ...] = ()
    """How the run does not add up (builtin:tests' flags: runner_tampered, exit_mismatch,
    ...); () for a run the reward would grade."""

    @property
    def passed(self) -> set[str]:
        return {test for test, outcome in self.outcomes.items() if outcome == "PASSED"}


def environment(project: Project, envs_dir: Path, timeout_s: float = 600.0) -> Path:
    """envs_dir/<name>-<version>: a venv with PYTEST and the project's test requirements
    (built once; a venv whose build did not finish is built again)."""
    target = (envs_dir / f"{project.name}-{project.version}").resolve()
    stamp = target / ".harnessrl-built"
    wanted = "\n".join([_RECIPE, PYTEST, *project.test_requires]) + "\n"
    if stamp.is_file() and stamp.read_text() == wanted:
        return target
    if target.exists():
        shutil.rmtree(target)
    envs_dir.mkdir(parents=True, exist_ok=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(target)
    done = subprocess.run(
        [
            *(str(_python(target)), "-m", "pip", "install", "--quiet"),
            *("--disable-pip-version-check", PYTEST, *project.test_requires),
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise EnvError(
            f"{project.requirement}: installing test requirements: {done.stderr[-2000:]}"
        )
    # pip and setuptools vendor copies of projects tasks are made from (six, packaging,
    # idna, more_itertools): they go, and nothing of the project may be left anywhere in it.
    _run_pip(target, ["uninstall", "--yes", "pip", "setuptools"], project, timeout_s)
    copies = project_copies(project, target)
    if copies:
        raise EnvError(f"{project.requirement}: the environment holds the project: {copies}")
    stamp.write_text(wanted)
    return target


def project_copies(project: Project, env: Path) -> list[str]:
    """Paths in the environment that hold a copy of the project's code (at any depth: a
    vendored copy counts): for a single-module project, a module of its name; for a
    package, a package of its name (a module that merely shares the name, such as
    hypothesis's `attrs.py` support module, is not a copy of the attrs package); [] for a
    clean environment."""
    wanted = {project.name.replace("-", "_").lower()}
    if not project.code.endswith(".py") and project.code != "src":
        wanted.add(Path(project.code).name.lower())
    single = project.code.endswith(".py")
    if single:
        wanted.add(Path(project.code).stem.lower())
    found = []
    for path in env.rglob("*"):
        stem = path.name[:-3] if path.name.endswith(".py") else path.name
        copy = path.suffix == ".py" if single else (path / "__init__.py").is_file()
        if stem.lower() in wanted and copy:
            found.append(str(path.relative_to(env)))
    return sorted(found)


def _run_pip(env: Path, args: list[str], project: Project, timeout_s: float) -> None:
    done = subprocess.run(
        [str(_python(env)), "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise EnvError(f"{project.requirement}: pip {args[0]}: {done.stderr[-2000:]}")


def import_root(project: Project) -> str:
    """Where the tests import the project from, relative to the repository: "src" for a
    src layout, else the repository itself."""
    return "src" if project.code == "src" else "."


def pytest_command(project: Project, env: Path, junit_xml: str = JUNIT_PLACEHOLDER) -> list[str]:
    """The argv that runs the project's tests from a working copy (run in its root): the
    environment's pytest, the copy's import root on PYTHONPATH, outcomes as `-rA` summary
    lines and a JUnit report at `junit_xml` (by default the `{junit_xml}` placeholder that
    builtin:tests fills in). The same command validates a task and scores it."""
    return [
        *("env", f"PYTHONPATH={import_root(project)}", str(_python(env)), "-m", "pytest"),
        *("-p", "no:cacheprovider", "-rA", "-q", "--color=no", f"--junitxml={junit_xml}"),
        # the project's own addopts (coverage, reporters) need plugins it does not ship
        *("-o", "junit_family=xunit1", "-o", "addopts=", "--continue-on-collection-errors"),
        *(f"--deselect={t}" if "::" in t else f"--ignore={t}" for t in project.deselect),
        project.tests,
    ]


def run_tests(
    project: Project,
    repo: Path,
    env: Path,
    timeout_s: float = 600.0,
    tests: list[str] | None = None,
) -> TestRun:
    """One run of the project's tests (or of `tests`, node ids) in `repo` with `env`."""
    command = pytest_command(project, env)
    if tests:
        command = [*command[:-1], *tests]
    return run_command(command, repo, timeout_s, what=project.requirement, tests=[project.tests])


def run_command(
    command: list[str],
    repo: Path,
    timeout_s: float,
    what: str = "",
    tests: Sequence[str] = (),
) -> TestRun:
    """One run of a pytest `command` (as `pytest_command` makes it: `{junit_xml}` is filled
    in) in `repo`, jailed and guarded as builtin:tests runs it; `tests`: the repository's
    test paths (the guard's test side, besides test_*.py and test/ directories). Raises
    EnvError when the guard never reported (pytest did not start, or did not load it)."""
    return blocking(lambda: _run_jailed(command, repo, timeout_s, what, tuple(tests)))


def blocking(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run the coroutine `make()` returns to its end, from synchronous code: in a new event
    loop, in a thread of its own when this thread already runs one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with ThreadPoolExecutor(1, thread_name_prefix="swe-run") as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


async def _run_jailed(
    command: list[str], repo: Path, timeout_s: float, what: str, tests: tuple[str, ...]
) -> TestRun:
    from harnessrl.services.reward import evidence as proof
    from harnessrl.services.reward.config import TestsSettings
    from harnessrl.services.reward.group_run import clean_env
    from harnessrl.services.reward.jail import GuardView, Jail, python_prefixes
    from harnessrl.services.reward.patch_tests import JUNIT_IN_JAIL, PYTEST_ADDOPTS

    env = clean_env(Path("/tmp"), Path("/tmp")) | {
        "PYTEST_ADDOPTS": PYTEST_ADDOPTS,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    argv = [arg.replace(JUNIT_PLACEHOLDER, JUNIT_IN_JAIL) for arg in command]
    started = time.monotonic()
    jailed = await Jail(TestsSettings(timeout_s=max(timeout_s, 1.0))).run(
        argv,
        repo=repo,
        prefixes=python_prefixes(argv, env["PATH"]),
        env=env,
        guard=GuardView(tests, ()),
        timeout_s=timeout_s,
    )
    seconds = time.monotonic() - started
    if jailed.outcome.timed_out:
        return TestRun({}, {}, seconds, timed_out=True)
    evidence = proof.read(jailed.channel, jailed.key, jailed.overflowed)
    if evidence.hello is None or (evidence.exitstatus not in (0, 1) and not evidence.phases):
        tail = jailed.outcome.output_tail.decode("utf-8", "replace")[-2000:]
        code = jailed.outcome.exit_code
        raise EnvError(f"{what or argv[0]}: pytest exited {code} and reported no test: {tail}")
    problems = tuple(
        dict.fromkeys(f for f, _ in proof.inconsistencies(evidence, jailed.outcome.exit_code))
    )
    outcomes = {n: _WORDS[o] for n, o in proof.all_outcomes(evidence).items()}
    failures = {n: evidence.texts[n] for n in outcomes if n in evidence.texts}
    return TestRun(outcomes, failures, seconds, problems=problems)


def reliable_passes(
    project: Project, repo: Path, env: Path, runs: int = 3, timeout_s: float = 600.0
) -> tuple[set[str], list[TestRun]]:
    """The tests PASSED in every one of `runs` runs (flaky ones left out), and the runs."""
    done = [run_tests(project, repo, env, timeout_s) for _ in range(runs)]
    passing = set.intersection(*(run.passed for run in done)) if done else set()
    return passing, done


def _python(env: Path) -> Path:
    return env / ("Scripts" if sys.platform == "win32" else "bin") / "python"
