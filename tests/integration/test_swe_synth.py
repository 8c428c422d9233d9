"""`harnessrl swe synth` then `swe clean --validate --tasks-out` on a real pinned project
(six, from PyPI): the small version of the pipeline `make test` runs (the full run over every
pinned project is `make swe-tasks`). Tasks come out validated, in a task file `harnessrl
submit` takes, and the gold patch of each scores 1 with builtin:tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from harnessrl.apps.swe.env import project_copies
from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.patch_tests import TestsReward
from harnessrl.tasks import parse_task_file
from tests.repo_helpers import coding_episode, git
from tests.six import SixReady

pytestmark = pytest.mark.integration


def _harnessrl(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "harnessrl", *args],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report: dict[str, object] = orjson.loads(done.stdout.strip().splitlines()[-1])
    return report


async def test_synth_and_clean_make_tasks_the_reward_scores(
    tmp_path: Path, six_ready: SixReady
) -> None:
    out = six_ready.root  # the session's six: fetched and its environment built once
    synth = ["swe", "synth", "--out", str(out), "--projects", "six", "--runs", "2"]
    report = _harnessrl(*synth, "--candidates", "40", "--per-project", "2")
    assert report["tasks"] == 2 and report["errors"] == 0
    stages = orjson.loads((out / "report.json").read_bytes())["projects"][0]
    assert set(stages["stage_seconds"]) >= {"fetch", "environment", "baseline", "check"}
    assert stages["reliable_tests"] > 100 and stages["checked"] >= 3
    assert stages["kept"] + sum(stages["dropped"].values()) == stages["checked"]
    # Resumed: nothing is checked again.
    again = _harnessrl(*synth, "--candidates", "40", "--per-project", "2")
    assert again["checked"] == report["checked"] and again["tasks"] == 2

    clean = _harnessrl(
        *("swe", "clean", str(out / "tasks.jsonl"), "--out", str(tmp_path / "clean.jsonl")),
        *("--validate", "--validate-runs", "1", "--tasks-out", str(tmp_path / "tasks.jsonl")),
        *("--group-size", "2"),  # (two rounds of validation: tests/unit/test_swe_synth.py)
    )
    assert clean["kept"] == 2 and clean["validated"] is True, clean
    # Each task has its hidden cases, or is counted by the reason none could be made (a fix
    # in a module-level table, or reachable only through a method of a test case).
    cases = clean["hidden_cases"]
    assert cases["tasks"] + sum(cases["without"].values()) == 2, clean
    assert all(r in ("no_call_recorded", "none_tell_the_fix") for r in cases["without"]), clean
    tasks = parse_task_file(tmp_path / "tasks.jsonl")
    train = parse_task_file(tmp_path / "tasks.train.jsonl")  # one project: all in train
    assert [t.task_id for t in train] == [t.task_id for t in tasks]
    assert (tmp_path / "tasks.val.jsonl").read_bytes() == b""
    six = six_ready.project
    assert len(tasks) == 2 and all(t.group_size == 2 for t in tasks)
    with_cases = [t for t in tasks if t.metadata and "hidden_cases" in t.metadata]
    assert len(with_cases) == cases["tasks"]
    reward = TestsReward(TestsSettings())
    records = [orjson.loads(x) for x in (tmp_path / "clean.jsonl").read_bytes().splitlines()]
    for task, record in zip(tasks, records, strict=True):
        assert task.metadata is not None
        repo = Path(task.metadata["repo"])
        assert git(repo, "rev-list", "--all").split() == [task.metadata["base_commit"]]
        # Nothing of the fix in the agent's reach: not in the repository, not installed.
        env = Path(task.input["environment"])
        assert project_copies(six, env) == []  # no six.py, not even vendored
        gold = await reward(coding_episode(task.metadata, result={"patch": record["patch"]}))
        assert gold.value == 1.0, gold.message
        empty = await reward(coding_episode(task.metadata, result={"patch": ""}))
        assert empty.value == 0.0
