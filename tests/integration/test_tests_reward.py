"""The built-in `tests` reward against real git repositories and real pytest runs.

Each test makes a small repository (a module with a bug, tests that fail on it), a patch
against it, and scores the patch with `TestsReward` as the reward service would.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harnessrl.services.reward import config, patch_tests
from harnessrl.services.reward.episode import Score
from harnessrl.services.reward.jail import JailError
from tests.helpers import eventually
from tests.repo_helpers import PYTEST, coding_episode, git, make_repo, patch_for

pytestmark = pytest.mark.integration

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = CALC.replace("a - b", "a + b")
TESTS = """from calc import add, mul


def test_add():
    assert add(2, 3) == 5


def test_add_zero():
    assert add(0, 0) == 0


def test_mul():
    assert mul(2, 3) == 6
"""
NAMED = [
    "tests/test_calc.py::test_add",
    "tests/test_calc.py::test_add_zero",
    "tests/test_calc.py::test_mul",
]
JUNIT_COMMAND = [*PYTEST, "--junitxml={junit_xml}", "tests"]
DROP = object()
"""In metadata overrides: remove the field."""


@dataclass
class Project:
    """A task's repository, and where patches against it are made."""

    repo: Path
    base: str
    root: Path

    def patch(self, changes: dict[str, str | None]) -> str:
        work = self.root / f"work-{len(list(self.root.glob('work-*')))}"
        return patch_for(self.repo, work, changes)

    def metadata(self, **overrides: Any) -> dict[str, Any]:
        data: dict[str, Any] = {
            "repo": str(self.repo),
            "base_commit": self.base,
            "test_command": JUNIT_COMMAND,
            "tests": NAMED,
            "protected_paths": ["tests"],
        }
        data.update(overrides)
        return {k: v for k, v in data.items() if v is not DROP}


@pytest.fixture
def project(tmp_path: Path) -> Project:
    files = {"calc.py": CALC, "tests/test_calc.py": TESTS, "pytest.ini": "[pytest]\n"}
    repo = tmp_path / "source"
    return Project(repo, make_repo(repo, files), tmp_path)


@pytest.fixture
def settings(tmp_path: Path) -> config.TestsSettings:
    return config.TestsSettings(scratch_dir=tmp_path / "scratch", kill_grace_s=0.5)


async def score(settings: config.TestsSettings, metadata: dict[str, Any], **episode: Any) -> Score:
    return await patch_tests.TestsReward(settings)(coding_episode(metadata, **episode))


async def test_correct_patch_scores_one(project: Project, settings: config.TestsSettings) -> None:
    patch = project.patch({"calc.py": FIXED})
    result = await score(settings, project.metadata(), result={"patch": patch})
    assert result.value == 1.0, result.message
    assert result.flags == ()
    assert result.components == {"exit_code": 0.0, "tests_passed": 3.0, "tests_total": 3.0}


async def test_a_test_patch_brings_the_tests_the_task_scores(
    tmp_path: Path, settings: config.TestsSettings
) -> None:
    """An imported task (SWE-bench style): its tests come with `test_patch`, applied after
    the harness's patch passed the rules; a harness writing those tests itself is refused."""
    repo = tmp_path / "repo"
    base = make_repo(repo, {"calc.py": CALC, "README": "calc\n"})
    bare = Project(repo, base, tmp_path)
    test_patch = bare.patch({"tests/test_calc.py": TESTS})
    metadata = bare.metadata(test_patch=test_patch)
    gold = await score(settings, metadata, result={"patch": bare.patch({"calc.py": FIXED})})
    assert (gold.value, gold.flags) == (1.0, ()), gold.message
    wrong = await score(settings, metadata, result={"patch": bare.patch({"README": "x\n"})})
    assert wrong.value == pytest.approx(2 / 3)  # test_add fails: the tests did run
    own_tests = bare.patch({"calc.py": FIXED, "tests/test_calc.py": TESTS})
    refused = await score(settings, metadata, result={"patch": own_tests})
    assert (refused.value, refused.flags) == (0.0, ("tests_modified",))
    with pytest.raises(ValueError, match=r"metadata\.test_patch"):
        await score(
            settings,
            bare.metadata(test_patch="diff --git a/x b/x\nbad\n"),
            result={"patch": bare.patch({"calc.py": FIXED})},
        )


@pytest.mark.parametrize(
    ("changes", "touched"),
    [
        ({"tests/test_calc.py": TESTS.replace("== 5", "== -1")}, "tests/test_calc.py"),
        ({"tests/test_calc.py": None, "test_calc.py": TESTS}, "tests/test_calc.py"),
        ({"tests/conftest.py": "collect_ignore = ['test_calc.py']\n"}, "tests/conftest.py"),
    ],
    ids=["edits-a-test", "renames-a-test-away", "adds-a-file-under-tests"],
)
async def test_patch_changing_protected_tests_is_flagged_tests_modified(
    project: Project, settings: config.TestsSettings, changes: dict[str, str | None], touched: str
) -> None:
    patch = project.patch(changes)
    result = await score(settings, project.metadata(), result={"patch": patch})
    assert (result.value, result.flags) == (0.0, ("tests_modified",))
    assert touched in result.message


@pytest.mark.parametrize("result", [None, {"patch": " \n\t\n"}, {"answer": "done"}])
async def test_no_patch_is_flagged_empty_patch(
    project: Project, settings: config.TestsSettings, result: Any
) -> None:
    scored = await score(settings, project.metadata(), result=result)
    assert (scored.value, scored.flags) == (0.0, ("empty_patch",))


async def test_fraction_scores_the_share_of_named_tests_passing(
    project: Project, settings: config.TestsSettings
) -> None:
    """Without a JUnit report, pytest's -rA summary lines tell which tests passed."""
    patch = project.patch({"README.md": "a patch that fixes nothing\n"})
    metadata = project.metadata(test_command=[*PYTEST, "-rA", "tests"], scoring="fraction")
    result = await score(settings, metadata, result={"patch": patch})
    assert result.value == pytest.approx(2 / 3)
    assert result.flags == ()
    assert result.components["tests_passed"] == 2.0
    assert "failed: tests/test_calc.py::test_add" in result.message


async def test_all_pass_scores_zero_unless_every_named_test_passes(
    project: Project, settings: config.TestsSettings
) -> None:
    patch = project.patch({"README.md": "a patch that fixes nothing\n"})
    result = await score(settings, project.metadata(scoring="all_pass"), result={"patch": patch})
    assert result.value == 0.0
    assert result.components["tests_passed"] == 2.0


async def test_named_test_that_was_not_collected_scores_zero_flagged_tests_missing(
    project: Project, settings: config.TestsSettings
) -> None:
    patch = project.patch({"calc.py": FIXED})
    named = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_nonexistent"]
    result = await score(settings, project.metadata(tests=named), result={"patch": patch})
    assert (result.value, result.flags) == (0.0, ("tests_missing",))
    assert result.components["tests_passed"] == 1.0
    assert "not collected: tests/test_calc.py::test_nonexistent" in result.message


async def test_patch_file_in_artifacts_wins_over_result_key(
    project: Project, settings: config.TestsSettings, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    (artifacts / "patch.diff").write_text(project.patch({"calc.py": FIXED}))
    wrong = project.patch({"README.md": "a patch that fixes nothing\n"})
    command = " ".join(shlex.quote(arg) for arg in PYTEST) + " --junitxml={junit_xml} tests"
    metadata = project.metadata(test_command=command)  # a string: run with sh -c
    result = await score(settings, metadata, result={"patch": wrong}, artifacts_dir=artifacts)
    assert result.value == 1.0, result.message


async def test_patch_from_result_key_without_artifacts_file(
    project: Project, settings: config.TestsSettings, tmp_path: Path
) -> None:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()  # holds no patch.diff
    patch = project.patch({"calc.py": FIXED})
    result = await score(
        settings, project.metadata(), result={"patch": patch}, artifacts_dir=artifacts
    )
    assert result.value == 1.0, result.message


async def test_patch_that_does_not_apply_is_flagged_patch_failed(
    project: Project, settings: config.TestsSettings
) -> None:
    stale = project.patch({"calc.py": FIXED}).replace("-    return a - b", "-    return a - c")
    result = await score(settings, project.metadata(), result={"patch": stale})
    assert (result.value, result.flags) == (0.0, ("patch_failed",))
    assert "git apply" in result.message


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"base_commit": DROP}, "task metadata.base_commit: required"),
        ({"repo": 42}, "task metadata.repo:"),
        ({"test_command": {"argv": "pytest"}}, "task metadata.test_command:"),
        ({"tests": "tests/test_calc.py::test_add"}, "task metadata.tests:"),
        ({"protected_paths": DROP}, "task metadata.protected_paths: required"),
        ({"protected_paths": ["../elsewhere"]}, "task metadata.protected_paths[0]:"),
        ({"scoring": "most"}, "task metadata.scoring:"),
        ({"timeout_s": -1}, "task metadata.timeout_s:"),
        ({"timeout_s": True}, "task metadata.timeout_s:"),
        ({"plugin_autoload": "yes"}, "task metadata.plugin_autoload:"),
        ({"base_commit": "0" * 40}, "task metadata.base_commit:"),
        ({"repo": "/nonexistent/harnessrl/repo"}, "task metadata.repo:"),
    ],
)
async def test_bad_metadata_raises_naming_the_field(
    project: Project, settings: config.TestsSettings, overrides: dict[str, Any], field: str
) -> None:
    patch = project.patch({"calc.py": FIXED})
    with pytest.raises(ValueError, match=re.escape(field)):
        await score(settings, project.metadata(**overrides), result={"patch": patch})


ENV_PROBE = """import json, os, sys
names = ["PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD", "PYTHONNOUSERSITE", "SECRET"]
seen = {n: os.environ.get(n) for n in names}
print(json.dumps(seen))
sys.exit(0 if seen == json.loads(sys.argv[1]) else 1)
"""


@pytest.mark.parametrize(
    ("runner", "autoload"), [("command", False), ("command", True), ("pytest", False)]
)
async def test_run_environment_pins_pytest_and_leaves_the_callers_out(
    project: Project,
    settings: config.TestsSettings,
    monkeypatch: pytest.MonkeyPatch,
    runner: str,
    autoload: bool,
) -> None:
    """The probe runs jailed and exits 0 only when it sees the expected environment."""
    monkeypatch.setenv("SECRET", "the caller's")
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p the_callers_plugin")
    expected = {
        "PYTEST_ADDOPTS": "-p harnessrl_testguard -p no:cacheprovider"
        if runner == "pytest"
        else None,
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": None if autoload else "1",
        "PYTHONNOUSERSITE": "1",
        "SECRET": None,
    }
    probe = [sys.executable, "-c", ENV_PROBE, json.dumps(expected)]
    if runner == "pytest":  # the probe as a test of the repository's, run by pytest
        test = "import subprocess, sys\n\n\ndef test_env():\n"
        test += f"    assert subprocess.run({probe!r}).returncode == 0\n"
        files = {"calc.py": FIXED, "tests/test_env.py": test}
        repo = project.root / "env-probe"
        project = Project(repo, make_repo(repo, files), project.root)
        command: list[str] = [*PYTEST, "tests"]
    else:
        command = probe
    metadata = project.metadata(
        test_command=command, tests=[], plugin_autoload=autoload, runner=runner
    )
    result = await score(settings, metadata, result={"patch": project.patch({"x.txt": "x\n"})})
    assert result.value == 1.0, result.message


async def test_patch_changing_a_file_the_test_command_runs_is_flagged_tests_modified(
    tmp_path: Path, settings: config.TestsSettings
) -> None:
    script = "set -e\n" + " ".join(shlex.quote(a) for a in PYTEST) + ' "$@" tests\n'
    files = {"calc.py": CALC, "tests/test_calc.py": TESTS, "ci/run_tests.sh": script}
    repo = tmp_path / "scripted"
    project = Project(repo, make_repo(repo, files), tmp_path)
    metadata = project.metadata(
        test_command=["sh", "ci/run_tests.sh", "--junitxml={junit_xml}"],
        protected_paths=[],
        environment=sys.prefix,  # the script's pytest: not a word of the command
    )
    fixed = await score(settings, metadata, result={"patch": project.patch({"calc.py": FIXED})})
    assert fixed.value == 1.0, fixed.message
    gamed = project.patch({"ci/run_tests.sh": "exit 0\n"})
    result = await score(settings, metadata, result={"patch": gamed})
    assert (result.value, result.flags) == (0.0, ("tests_modified",))
    assert "ci/run_tests.sh" in result.message


PASSING_PLUGIN = """import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    return (yield)
"""


@pytest.mark.parametrize(
    "config_files",
    [
        {"conftest.py": "pytest_plugins = ['helpers.plugin']\n", "pytest.ini": "[pytest]\n"},
        {"pytest.ini": "[pytest]\naddopts = -p helpers.plugin\n"},
    ],
    ids=["conftest-pytest-plugins", "ini-addopts"],
)
async def test_patch_changing_a_plugin_the_tests_load_is_flagged_runner_patched(
    tmp_path: Path, settings: config.TestsSettings, config_files: dict[str, str]
) -> None:
    files = {
        "calc.py": CALC,
        "tests/test_calc.py": TESTS,
        "helpers/__init__.py": "",
        "helpers/plugin.py": PASSING_PLUGIN,
        **config_files,
    }
    repo = tmp_path / "with-plugin"
    project = Project(repo, make_repo(repo, files), tmp_path)
    command = ["env", "PYTHONPATH=.", *PYTEST, "--junitxml={junit_xml}", "tests"]
    metadata = project.metadata(test_command=command)
    fixed = await score(settings, metadata, result={"patch": project.patch({"calc.py": FIXED})})
    assert fixed.value == 1.0, fixed.message
    forcing = PASSING_PLUGIN.replace(
        "return (yield)", "report = yield\n    report.outcome = 'passed'\n    return report"
    )
    gamed = project.patch({"helpers/plugin.py": forcing})
    result = await score(settings, metadata, result={"patch": gamed})
    assert (result.value, result.flags) == (0.0, ("runner_patched",)), result.message
    assert "helpers/plugin.py: a module the tests' configuration loads" in result.message


def _hanging_project(root: Path, marker: str) -> Project:
    """A repository whose test starts a child in its own session (as a process escaping its
    group would) and never ends; both ignore SIGTERM, so only the jail's end ends them.
    `marker` is in both command lines, for `_jailed_alive`."""
    test = f"""import os, signal, subprocess, sys, time

CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def test_hangs():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    subprocess.Popen([sys.executable, "-c", CHILD, {marker!r}], start_new_session=True)
    time.sleep(600)
"""
    repo = root / "hanging"
    base = make_repo(repo, {"tests/test_hang.py": test, "pytest.ini": "[pytest]\n"})
    return Project(repo, base, root)


def _jailed_alive(marker: str) -> int:
    """How many live processes (not zombies) carry the marker in their command line."""
    alive = 0
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
        if marker.encode() in cmdline and state not in ("Z", "X"):
            alive += 1
    return alive


async def test_hanging_run_is_cut_at_its_timeout_with_everything_it_started(
    tmp_path: Path, settings: config.TestsSettings
) -> None:
    marker = f"harnessrl-hang-{uuid.uuid4().hex}"
    project = _hanging_project(tmp_path, marker)
    patch = project.patch({"README.md": "anything\n"})
    command = [*PYTEST, "tests"]
    metadata = project.metadata(tests=[], timeout_s=3, test_command=command)
    result = await score(settings, metadata, result={"patch": patch})
    assert (result.value, result.flags) == (0.0, ("timeout",))
    await eventually(lambda: _jailed_alive(marker) == 0, timeout=5)


async def test_cancelled_scoring_kills_the_run_and_removes_the_copy(
    tmp_path: Path, settings: config.TestsSettings
) -> None:
    marker = f"harnessrl-hang-{uuid.uuid4().hex}"
    project = _hanging_project(tmp_path, marker)
    patch = project.patch({"README.md": "anything\n"})
    metadata = project.metadata(tests=[], test_command=[*PYTEST, "tests"])
    scoring = asyncio.create_task(score(settings, metadata, result={"patch": patch}))
    await eventually(lambda: _jailed_alive(marker) == 1, timeout=15)
    scoring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await scoring
    await eventually(lambda: _jailed_alive(marker) == 0, timeout=5)
    assert settings.scratch_dir is not None
    assert list(settings.scratch_dir.iterdir()) == []


async def test_a_run_cannot_reach_a_server_on_the_hosts_loopback(
    tmp_path: Path, settings: config.TestsSettings
) -> None:
    connections = 0

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3).close()"
    repo = tmp_path / "plain"
    project = Project(repo, make_repo(repo, {"README.md": "plain\n"}), tmp_path)
    patch = project.patch({"README.md": "patched\n"})
    command = [sys.executable, "-c", connect]
    metadata = project.metadata(test_command=command, tests=[], runner="command")
    async with server:
        # Control: outside the jail the same command reaches the server.
        control = await asyncio.create_subprocess_exec(*command)
        assert await control.wait() == 0
        await eventually(lambda: connections == 1, timeout=5)
        cut_off = await score(settings, metadata, result={"patch": patch})
    assert cut_off.value == 0.0
    assert cut_off.components["exit_code"] != 0.0
    assert "Connection refused" in cut_off.message, cut_off.message  # not the host's port
    assert connections == 1
    # Loopback inside the jail is up: a suite may serve and connect on localhost.
    serve_and_connect = (
        "import socket; s = socket.create_server(('127.0.0.1', 0)); "
        "socket.create_connection(s.getsockname(), timeout=3).close()"
    )
    local = await score(
        settings,
        project.metadata(
            test_command=[sys.executable, "-c", serve_and_connect], tests=[], runner="command"
        ),
        result={"patch": patch},
    )
    assert local.value == 1.0, local.message


async def test_a_jail_that_cannot_be_set_up_is_an_error_never_an_unjailed_run(
    project: Project, settings: config.TestsSettings
) -> None:
    patch = project.patch({"calc.py": FIXED})
    missing = settings.model_copy(update={"bwrap": "no-such-bwrap"})
    with pytest.raises(JailError, match=re.escape("reward.tests.bwrap: 'no-such-bwrap'")):
        await score(missing, project.metadata(), result={"patch": patch})
    # bwrap that fails before it starts the command (an option it refuses)
    broken = settings.model_copy(update={"read_only": [Path("/nonexistent/harnessrl")]})
    with pytest.raises(JailError, match="could not be set up"):
        await score(broken, project.metadata(), result={"patch": patch})


async def test_copy_is_removed_and_source_untouched(
    project: Project, settings: config.TestsSettings
) -> None:
    def snapshot() -> tuple[str, ...]:
        return (
            git(project.repo, "status", "--porcelain", "--ignored", "--untracked-files=all"),
            git(project.repo, "for-each-ref"),
            git(project.repo, "worktree", "list", "--porcelain"),
            git(project.repo, "rev-parse", "HEAD"),
        )

    before = snapshot()
    patch = project.patch({"calc.py": FIXED})
    assert (await score(settings, project.metadata(), result={"patch": patch})).value == 1.0
    with pytest.raises(ValueError, match=re.escape("task metadata.base_commit")):
        await score(settings, project.metadata(base_commit="v9"), result={"patch": patch})
    assert settings.scratch_dir is not None
    assert list(settings.scratch_dir.iterdir()) == []
    assert snapshot() == before


@pytest.fixture(scope="module")
def older_pytest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with pytest 7 (from the package index): tasks bring their own environments."""
    env = tmp_path_factory.mktemp("pytest7") / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--disable-pip-version-check", "pytest==7.4.4"], check=True)
    return env


async def test_the_guard_serves_an_older_pytest_in_the_tasks_own_environment(
    project: Project, settings: config.TestsSettings, older_pytest: Path
) -> None:
    python = str(older_pytest / "bin" / "python")
    command = ["env", "PYTHONPATH=.", python, "-m", "pytest", "-q", "--junitxml={junit_xml}"]
    metadata = project.metadata(test_command=[*command, "tests"])
    fixed = await score(settings, metadata, result={"patch": project.patch({"calc.py": FIXED})})
    assert (fixed.value, fixed.flags) == (1.0, ()), fixed.message
    broken = await score(settings, metadata, result={"patch": project.patch({"x.txt": "x\n"})})
    assert broken.value == pytest.approx(2 / 3), broken.message


SUBTESTS = """import unittest

from calc import add


class AddTests(unittest.TestCase):
    def test_add_many(self):
        for a, b, total in [(1, 2, 3), (2, 2, 4), (0, 5, 5)]:
            with self.subTest(a=a, b=b):
                self.assertEqual(add(a, b), total)
"""


async def test_subtests_count_and_a_failing_one_fails_its_test(
    tmp_path: Path, settings: config.TestsSettings
) -> None:
    """unittest's subTest: each subtest is reported; the test passes only when all do."""
    repo = tmp_path / "subtests"
    project = Project(
        repo, make_repo(repo, {"calc.py": CALC, "tests/test_sub.py": SUBTESTS}), tmp_path
    )
    metadata = project.metadata(tests=["tests/test_sub.py::AddTests::test_add_many"])
    fixed = await score(settings, metadata, result={"patch": project.patch({"calc.py": FIXED})})
    assert (fixed.value, fixed.flags) == (1.0, ()), fixed.message
    broken = await score(settings, metadata, result={"patch": project.patch({"x.txt": "x\n"})})
    assert (broken.value, broken.flags) == (0.0, ()), broken.message
    assert "failed: tests/test_sub.py::AddTests::test_add_many" in broken.message


DECORATED = """from functools import wraps
from unittest import mock

from hypothesis import given, settings, strategies as st

from calc import add


def twice(test):
    @wraps(test)
    def run(*args, **kwargs):
        test(*args, **kwargs)
        test(*args, **kwargs)

    return run


@settings(max_examples=25, database=None)
@given(st.integers(), st.integers())
def test_add_commutes(a, b):
    assert add(a, b) == add(b, a)


@twice
def test_add_twice():
    assert add(2, 3) == 5


@mock.patch("os.getcwd", return_value="/elsewhere")
def test_add_patched(getcwd):
    assert add(1, 1) == 2
"""


async def test_tests_behind_decorators_are_judged_by_their_own_code(
    tmp_path: Path, settings: config.TestsSettings
) -> None:
    """hypothesis's given, functools.wraps and mock.patch wrap the test pytest calls: the
    guard watches the file's own test code run to its end through them, and flags none."""
    repo = tmp_path / "decorated"
    files = {"calc.py": CALC, "tests/test_deco.py": DECORATED}
    project = Project(repo, make_repo(repo, files), tmp_path)
    named = [
        f"tests/test_deco.py::{n}"
        for n in ("test_add_commutes", "test_add_twice", "test_add_patched")
    ]
    metadata = project.metadata(tests=named)
    fixed = await score(settings, metadata, result={"patch": project.patch({"calc.py": FIXED})})
    assert (fixed.value, fixed.flags) == (1.0, ()), fixed.message
    broken = await score(settings, metadata, result={"patch": project.patch({"x.txt": "x\n"})})
    assert (broken.value, broken.flags) == (0.0, ()), broken.message  # each fails: no flag
