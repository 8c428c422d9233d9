"""A project's test environment, and what its test suite does in it: `swe synth`'s second
step (which tests pass reliably, before any bug is injected).

    env = environment(project, envs_dir)              # a venv: pytest and the test deps
    run = run_tests(project, repo, env)               # one run: node id -> outcome
    passing = reliable_passes(project, repo, env, 3)  # PASSED in every one of 3 runs

The environment holds the test runner and the project's test dependencies but never the
project itself: the tests import the code from the working copy (its import root on
PYTHONPATH), so no pristine copy of the code is in the agent's reach. pip and setuptools
are removed once the install is done (they vendor six, packaging, idna, more_itertools),
and a build that still holds a module named like the project anywhere fails. Outcomes are read
from pytest's `-rA` summary lines (node ids as pytest prints them); failure texts from its
JUnit report. A test counts as passing only when pytest says PASSED: not skipped, not
xfailed, not deselected.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import venv
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from harnessrl.services.reward.test_names import address_of
from harnessrl.swe.projects import Project

JUNIT_PLACEHOLDER = "{junit_xml}"
"""Where a test command's JUnit report goes: builtin:tests' placeholder (coding_task), the
same text, not imported, so the CLI's help stays light."""
PYTEST = "pytest==9.2.0"
"""The test runner every environment gets (pinned, so outcomes do not drift with it)."""
_RECIPE = "recipe 2: pip and setuptools removed after the install"
"""In the stamp: an environment built by an older recipe is built again."""
_SUMMARY = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


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
    """Paths in the environment that hold a module or package named like the project's
    (at any depth: a vendored copy counts); [] for a clean environment."""
    wanted = {project.name.replace("-", "_").lower()}
    if not project.code.endswith(".py") and project.code != "src":
        wanted.add(Path(project.code).name.lower())
    if project.code.endswith(".py"):
        wanted.add(Path(project.code).stem.lower())
    found = []
    for path in env.rglob("*"):
        stem = path.name[:-3] if path.name.endswith(".py") else path.name
        if stem.lower() in wanted and (path.suffix == ".py" or (path / "__init__.py").is_file()):
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
    return run_command(command, repo, timeout_s, what=project.requirement)


def run_command(command: list[str], repo: Path, timeout_s: float, what: str = "") -> TestRun:
    """One run of a pytest `command` (as `pytest_command` makes it: `{junit_xml}` is filled
    in) in `repo`, with none of the caller's Python settings."""
    env_vars = {
        **{
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PYTEST"))
        },
        "PYTHONDONTWRITEBYTECODE": "1",
        # as builtin:tests runs them: no user site, no plugins loaded by entry point
        "PYTHONNOUSERSITE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    with tempfile.TemporaryDirectory(prefix="swe-run-") as scratch:
        junit = Path(scratch) / "junit.xml"
        argv = [arg.replace(JUNIT_PLACEHOLDER, str(junit)) for arg in command]
        started = time.monotonic()
        try:
            done = subprocess.run(
                argv,
                cwd=repo,
                env=env_vars,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return TestRun({}, {}, time.monotonic() - started, timed_out=True)
        seconds = time.monotonic() - started
        if done.returncode not in (0, 1) and "PASSED" not in done.stdout:
            tail = (done.stdout + done.stderr)[-2000:]
            raise EnvError(f"{what or argv[0]}: pytest exited {done.returncode}: {tail}")
        outcomes = _outcomes(done.stdout)
        failures = _failure_texts(junit, outcomes)
    return TestRun(outcomes, failures, seconds)


def reliable_passes(
    project: Project, repo: Path, env: Path, runs: int = 3, timeout_s: float = 600.0
) -> tuple[set[str], list[TestRun]]:
    """The tests PASSED in every one of `runs` runs (flaky ones left out), and the runs."""
    done = [run_tests(project, repo, env, timeout_s) for _ in range(runs)]
    passing = set.intersection(*(run.passed for run in done)) if done else set()
    return passing, done


def _python(env: Path) -> Path:
    return env / ("Scripts" if sys.platform == "win32" else "bin") / "python"


def _outcomes(stdout: str) -> dict[str, str]:
    """Node id -> outcome from pytest's `-rA` short summary (the last word wins)."""
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word not in _SUMMARY or not rest:
            continue
        node = rest.split(" - ", 1)[0].strip()
        if word in ("SKIPPED", "XFAIL", "XPASS") and node.startswith("["):
            continue  # "SKIPPED [1] file.py:3: reason": a location, not a node id
        out[node] = word
    return out


def _failure_texts(junit: Path, outcomes: dict[str, str]) -> dict[str, str]:
    """Node id -> the JUnit report's text for each failed or errored test."""
    if not junit.is_file():
        return {}
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError:
        return {}
    by_address = {address_of(node): node for node in outcomes}
    texts: dict[str, str] = {}
    for case in root.iter("testcase"):
        address = ".".join(p for p in (case.get("classname"), case.get("name")) if p)
        node = by_address.get(address)
        for tag in ("failure", "error"):
            element = case.find(tag)
            if node is not None and element is not None:
                texts[node] = (element.get("message") or "") + "\n" + (element.text or "")
    return texts
