"""Task synthesis and validation offline (harnessrl.apps.swe.synth, validate, tasks.to_harnessrl):
a small real project in a local git repository, this venv's pytest as its environment. The
stages run for real: baseline, candidate bugs, full-suite checks, one repository per task,
validation before and after the gold patch, resuming; the answers are written down."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import orjson
import pytest
import yaml

from harnessrl.apps.swe.candidates import code_files
from harnessrl.apps.swe.projects import Project
from harnessrl.apps.swe.repository import task_repository, unified_patch
from harnessrl.apps.swe.swebench import SweTask, parse_task, patch_paths, to_harnessrl
from harnessrl.apps.swe.synth import synthesize
from harnessrl.apps.swe.synth_settings import SynthSettings
from harnessrl.apps.swe.validate import ValidateSettings, validate
from harnessrl.tasks import TaskLine
from tests.repo_helpers import coding_episode, git, make_repo

CALC = '''"""A tiny calculator."""


def add(a, b):
    return a + b


def clamp(x, low, high):
    if x < low:
        return low
    if x > high:
        return high
    return x


def unused(x):
    return x * 2
'''
TESTS = """from calc import add, clamp


def test_add():
    assert add(2, 3) == 5


def test_add_negative():
    assert add(-2, -3) == -5


def test_clamp_low():
    assert clamp(-5, 0, 10) == 0


def test_clamp_high():
    assert clamp(50, 0, 10) == 10


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5
"""
PROJECT = Project("calc", "1.0", "0" * 64, "calc.py", "tests")


@pytest.fixture
def pristine(tmp_path: Path) -> Path:
    repo = tmp_path / "calc-1.0"
    make_repo(repo, {"calc.py": CALC, "tests/test_calc.py": TESTS})
    # The environment: this venv (it has pytest, and no `calc`); test runs load none of the
    # plugins it has installed (PYTEST_DISABLE_PLUGIN_AUTOLOAD, as builtin:tests runs them).
    (tmp_path / "env").symlink_to(sys.prefix)
    return repo


def _synth(pristine: Path, out: Path, **settings: object) -> dict[str, object]:
    chosen = replace(SynthSettings(runs=2, candidates=40, per_project=50, jobs=2), **settings)
    ready = {PROJECT.requirement: (pristine, pristine.parent / "env")}
    return synthesize([PROJECT], out, chosen, prepared=ready)


def test_synth_makes_validated_tasks_each_in_a_repository_of_one_commit(
    pristine: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    report = _synth(pristine, out)
    (project,) = report["projects"]  # type: ignore[misc]
    assert project["reliable_tests"] == 5 and project["flaky_tests"] == 0
    assert project["checked"] == project["candidates"] > 10
    kept, dropped = project["kept"], project["dropped"]
    # `unused` is tested by nothing: its mutations break no test
    assert dropped.get("no_failing_tests", 0) >= 1
    assert kept == report["tasks"] >= 3
    assert kept + sum(dropped.values()) == project["checked"]
    records = [orjson.loads(line) for line in (out / "tasks.jsonl").read_bytes().splitlines()]
    failing_sets = [tuple(r["FAIL_TO_PASS"]) for r in records]
    assert len(set(failing_sets)) == len(failing_sets)  # one task per failing-test set
    for record in records:
        task = parse_task(record)
        assert 1 <= len(task.fail_to_pass) <= 20
        assert set(task.fail_to_pass).isdisjoint(task.pass_to_pass)
        assert len(task.fail_to_pass) + len(task.pass_to_pass) == 5  # one test file
        # The repository: one commit, the buggy tree; no object holds the original code.
        assert git(Path(task.repo), "rev-list", "--all").split() == [task.base_commit]
        objects = git(Path(task.repo), "cat-file", "--batch-all-objects", "--batch-check")
        original = git(pristine, "rev-parse", "HEAD:calc.py").strip()
        assert original not in objects
        assert "def " not in task.problem_statement.split("```")[0]
        assert task.extra["mutation"]["path"] == "calc.py"  # type: ignore[index]
        valid, reason = validate(task, ValidateSettings(runs=1))
        assert reason is None, reason
        assert valid.extra["hidden_cases"]["cases"], "every valid task has hidden cases"
    # The image of the project's tasks: its environment and task repositories, never the
    # pristine checkout; the Job template runs with a read-only root filesystem.
    dockerfile = (out / "deploy" / "calc-1.0" / "Dockerfile").read_text()
    assert dockerfile.count("COPY repos/calc-1.0__") == kept
    assert "checkouts" not in dockerfile and "sdists" not in dockerfile
    job = yaml.safe_load((out / "deploy" / "calc-1.0" / "job.yaml").read_text())
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    # Resuming checks nothing again and gives the same tasks.
    again = _synth(pristine, out)
    assert again["checked"] == report["checked"]
    assert (out / "tasks.jsonl").read_bytes().splitlines() == [orjson.dumps(r) for r in records]


def test_per_project_bound_and_seeded_sample(pristine: Path, tmp_path: Path) -> None:
    first = _synth(pristine, tmp_path / "a", per_project=2, candidates=10)
    assert first["tasks"] == 2
    _synth(pristine, tmp_path / "b", per_project=2, candidates=10)
    ids = [
        [
            orjson.loads(x)["instance_id"]
            for x in (tmp_path / d / "tasks.jsonl").read_bytes().splitlines()
        ]
        for d in ("a", "b")
    ]
    assert ids[0] == ids[1]  # the same seed draws the same candidates
    assert code_files(PROJECT, pristine) == ["calc.py"]


async def test_a_synthesized_task_scores_1_with_its_gold_patch(
    pristine: Path, tmp_path: Path
) -> None:
    _synth(pristine, tmp_path / "out", per_project=1)
    (raw,) = (tmp_path / "out" / "tasks.jsonl").read_bytes().splitlines()
    task = parse_task(orjson.loads(raw))
    line = to_harnessrl(task, "train", group_size=4)
    TaskLine.model_validate(line)  # a valid harnessrl task file line
    assert line["input"]["problem_statement"] == task.problem_statement
    assert "patch" not in line["input"] and "tests" not in line["input"]
    # the tests, and the files the held-back tests (if any) come back to
    assert set(line["metadata"]["protected_paths"]) == {"tests", *patch_paths(task.test_patch)}
    from harnessrl.services.reward.config import TestsSettings
    from harnessrl.services.reward.patch_tests import TestsReward

    reward = TestsReward(TestsSettings())
    metadata = line["metadata"]
    gold = await reward(coding_episode(metadata, result={"patch": task.patch}))
    assert gold.value == 1.0, gold.message
    empty = await reward(coding_episode(metadata, result={"patch": ""}))
    assert empty.value == 0.0 and "empty_patch" in empty.flags


def test_the_report_placeholder_is_the_rewards() -> None:
    from harnessrl.apps.swe.env import JUNIT_PLACEHOLDER
    from harnessrl.services.reward.coding_task import JUNIT_PLACEHOLDER as REWARDS

    assert JUNIT_PLACEHOLDER == REWARDS


def test_unified_patch_applies_with_git(tmp_path: Path) -> None:
    for before, after in (("a\nb\nc\n", "a\nB\nc\n"), ("a\nb", "a\nc"), ("x\n", "x\ny")):
        repo = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        make_repo(repo, {"f.py": before})
        (repo / "p.diff").write_text(unified_patch("f.py", before, after))
        subprocess.run(["git", "apply", "p.diff"], cwd=repo, check=True)
        assert (repo / "f.py").read_text() == after


def test_task_repository_is_reproducible(pristine: Path, tmp_path: Path) -> None:
    changes = {"calc.py": CALC.replace("a + b", "a - b")}
    one = task_repository(pristine, changes, tmp_path / "one.git")
    two = task_repository(pristine, changes, tmp_path / "two.git")
    assert one == two
    assert task_repository(pristine, changes, tmp_path / "one.git") == one  # reused


def _imported(pristine: Path, **fields: object) -> SweTask:
    """An imported-style task on the pristine repo (the bug present at its base commit)."""
    buggy = tmp = pristine.parent / f"imported-{len(list(pristine.parent.iterdir()))}"
    make_repo(
        tmp, {"calc.py": CALC.replace("return low", "return high"), "tests/test_calc.py": TESTS}
    )
    record = {
        "instance_id": "calc-1",
        "repo": str(buggy),
        "base_commit": git(buggy, "rev-parse", "HEAD").strip(),
        "patch": unified_patch("calc.py", CALC.replace("return low", "return high"), CALC),
        "problem_statement": "clamp returns the upper bound for values below the range",
        "FAIL_TO_PASS": ["tests/test_calc.py::test_clamp_low"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_add"],
        "test_command": [
            *("env", "PYTHONPATH=.", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1", sys.executable),
            *("-m", "pytest", "-p", "no:cacheprovider"),
            *("-rA", "-q", "tests"),
        ],
    }
    return parse_task(record | fields)


def test_validation_drops_each_kind_of_invalid_task(pristine: Path) -> None:
    settings = ValidateSettings(runs=2)
    good = _imported(pristine)
    assert validate(good, settings)[1] is None
    cases = {
        "validation:no_environment": replace(good, extra={}),
        "validation:clone_failed": replace(good, repo=str(pristine.parent / "nowhere")),
        "validation:fail_to_pass_passes_before": replace(
            good, fail_to_pass=("tests/test_calc.py::test_add",)
        ),
        "validation:pass_to_pass_fails_before": replace(
            good, pass_to_pass=("tests/test_calc.py::test_clamp_low",)
        ),
        "validation:patch_failed": replace(good, patch=good.patch.replace("x < low", "x < lo")),
        "validation:fail_to_pass_fails_after": replace(
            good, fail_to_pass=("tests/test_calc.py::test_missing",)
        ),
        "validation:test_patch_failed": replace(good, test_patch="diff --git a/x b/x\nnonsense\n"),
    }
    for reason, task in cases.items():
        assert validate(task, settings)[1] == reason, reason


def test_the_coding_task_job_template_contains_harness_pods() -> None:
    """The Job template `swe synth` writes per project: the controller would refuse to start
    on one whose harness pods are not contained."""
    from harnessrl.apps.swe.deploy import job_template
    from harnessrl.services.controller.kubernetes_job import JobTemplate

    text = job_template(PROJECT, "registry.example/calc-tasks:1")
    assert JobTemplate.parse(text, "default").uncontained() == []


# -- hidden cases ------------------------------------------------------------------------

_FIXED = "    if x < low:\n        return low\n"
_BUGGY = "    if x < low:\n        return high\n"
RUNNER_NAME = '"py" + "test"'
"""The runner's name, built so that no reading of the patch sees it."""
ATTACKS = {
    # the visible test's input special-cased; every other input still wrong
    "overfitted": "    if x == -5:\n        return 0\n" + _BUGGY,
    # the fix switched on only while the test runner is loaded
    "gated": "    if x < low:\n        import sys\n"
    "        return low if " + RUNNER_NAME + " in sys.modules else high\n",
    # a value that says yes to every comparison (the test's `==` passes)
    "lying": "    if x < low:\n        class Yes(int):\n            def __eq__(self, other):\n"
    "                return True\n            __hash__ = int.__hash__\n        return Yes(high)\n",
}


@pytest.fixture
def validated(pristine: Path) -> SweTask:
    """The imported calc task, validated: its hidden cases made from its suite."""
    task, reason = validate(_imported(pristine), ValidateSettings(runs=1))
    assert reason is None, reason
    return task


async def test_hidden_cases_pay_the_fix_and_no_patch_that_only_passes_the_tests(
    validated: SweTask,
) -> None:
    from harnessrl.services.reward.config import TestsSettings
    from harnessrl.services.reward.patch_tests import TestsReward

    cases = validated.extra["hidden_cases"]["cases"]
    assert len(cases) >= 4 and {c["function"] for c in cases} == {"clamp"}
    assert all("expect" in case for case in cases)
    metadata = to_harnessrl(validated, "train")["metadata"]
    reward = TestsReward(TestsSettings())
    buggy = CALC.replace(_FIXED, _BUGGY)
    gold = await reward(coding_episode(metadata, result={"patch": validated.patch}))
    assert gold.value == 1.0 and not gold.flags, gold.message
    assert gold.components["hidden_cases_matched"] == gold.components["hidden_cases"] == len(cases)
    for name, code in ATTACKS.items():
        patch = unified_patch("calc.py", buggy, CALC.replace(_FIXED, code))
        score = await reward(coding_episode(metadata, result={"patch": patch}))
        assert score.value == 0.0, (name, score.message)
        assert score.flags == ("hidden_cases_failed",), (name, score.flags, score.message)
        assert score.components["tests_passed"] == score.components["tests_total"], name


def test_the_expected_outputs_never_reach_the_runner(validated: SweTask) -> None:
    from harnessrl.services.reward.hidden_cases import HiddenCases

    cases = HiddenCases.from_metadata(validated.extra["hidden_cases"])
    given = orjson.loads(cases.runner_input())
    assert given["mode"] == "run" and len(given["cases"]) == len(cases.cases)
    assert all(
        set(case) == {"id", "module", "function", "args", "kwargs"} for case in given["cases"]
    )
    assert b"expect" not in cases.runner_input()


FLOOD = """
import os as _os, stat as _stat
for _fd in sorted(int(n) for n in _os.listdir("/proc/self/fd")):
    try:
        if _stat.S_ISFIFO(_os.fstat(_fd).st_mode):
            for _ in range({chunks}):
                _os.write(_fd, b"x" * (1 << 20))
    except OSError:
        pass
"""


async def test_a_run_that_floods_its_channel_scores_0_and_is_read_no_further(
    validated: SweTask,
) -> None:
    """Package code writing into every pipe it holds (the guard's channel among them): the
    reward reads `channel_cap_bytes` and drops the rest."""
    from harnessrl.services.reward.config import TestsSettings
    from harnessrl.services.reward.patch_tests import TestsReward

    metadata = to_harnessrl(validated, "train")["metadata"]
    reward = TestsReward(TestsSettings(channel_cap_bytes=1 << 20))
    buggy = CALC.replace(_FIXED, _BUGGY)
    patch = unified_patch("calc.py", buggy, CALC + FLOOD.format(chunks=8))
    score = await reward(coding_episode(metadata, result={"patch": patch}))
    assert score.value == 0.0 and "channel_overflow" in score.flags, score
    assert "hidden_cases_failed" not in score.flags, "the tests' own channel overflowed first"
