"""`harnessrl bench reward`: what builtin:tests costs per scored patch, against the bare test run.

For each task of a SWE-bench-format task file (as `harnessrl swe synth` writes it, with its
environment and test command), two patches are scored: the gold patch and a patch that
fixes nothing (it adds a notes file). Each is scored the way the reward service does it
(`TestsReward` on the task's `builtin:tests` metadata: clone, the patch's rules, the jailed
and guarded run, the grade), and, as the baseline in the same run, the bare test run: a
clone at the base commit, the patch applied with git, the task's test command run directly
as a subprocess (no rules, no jail, no guard). Rounds alternate reward and bare; medians
are reported.

The JSON line holds seconds per scored patch for both, their ratio (reward / bare), and
the scores (gold patches must score 1, the others 0).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from harnessrl.apps.swe.swebench import SweTask, read_records, to_harnessrl
from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.episode import standalone_episode
from harnessrl.services.reward.patch_tests import TestsReward

NOOP_FILE = "HARNESSRL_BENCH_NOTES.md"


def noop_patch() -> str:
    """A patch that adds a notes file: it applies to any repository and fixes nothing."""
    return (
        f"diff --git a/{NOOP_FILE} b/{NOOP_FILE}\nnew file mode 100644\n--- /dev/null\n"
        f"+++ b/{NOOP_FILE}\n@@ -0,0 +1 @@\n+notes\n"
    )


def load_tasks(path: Path, limit: int) -> list[SweTask]:
    tasks = []
    for number, item in read_records(path):
        if isinstance(item, Exception):
            raise SystemExit(f"{path}:{number}: {item}")
        if isinstance(item.extra.get("test_command"), list):
            tasks.append(item)
    if not tasks:
        raise SystemExit(f"{path}: no task with a test_command (swe synth writes them)")
    return tasks[:limit] if limit > 0 else tasks


async def _reward_round(
    reward: TestsReward, tasks: list[SweTask]
) -> tuple[float, list[tuple[str, str, float]]]:
    started = time.perf_counter()
    scores = []
    for task in tasks:
        metadata = to_harnessrl(task, "train")["metadata"]
        for kind, patch in (("gold", task.patch), ("noop", noop_patch())):
            score = await reward(standalone_episode(metadata, result={"patch": patch}))
            scores.append((task.instance_id, kind, score.value))
    return time.perf_counter() - started, scores


def _bare_round(tasks: list[SweTask], scratch: Path) -> float:
    started = time.perf_counter()
    for task in tasks:
        command = list(task.extra["test_command"])
        for patch in (task.patch, noop_patch()):
            work = Path(tempfile.mkdtemp(dir=scratch))
            copy = work / "repo"
            subprocess.run(
                ["git", "clone", "-q", "--no-checkout", task.repo, str(copy)], check=True
            )
            subprocess.run(
                ["git", "-c", "advice.detachedHead=false", "checkout", "-q", task.base_commit],
                cwd=copy,
                check=True,
            )
            (work / "patch.diff").write_text(patch if patch.endswith("\n") else patch + "\n")
            subprocess.run(["git", "apply", str(work / "patch.diff")], cwd=copy, check=True)
            argv = [a.replace("{junit_xml}", str(work / "junit.xml")) for a in command]
            subprocess.run(argv, cwd=copy, capture_output=True, timeout=600, check=False)
            subprocess.run(["rm", "-rf", str(work)], check=True)
    return time.perf_counter() - started


def measure(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    tasks = load_tasks(args.tasks, args.limit)
    patches = 2 * len(tasks)
    reward = TestsReward(TestsSettings())
    reward_s: list[float] = []
    bare_s: list[float] = []
    scores: list[tuple[str, str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-reward-") as scratch:
        for round_ in range(1, args.rounds + 1):
            seconds, scores = asyncio.run(_reward_round(reward, tasks))
            reward_s.append(seconds / patches)
            bare_s.append(_bare_round(tasks, Path(scratch)) / patches)
            log(
                f"round {round_}/{args.rounds}: reward {reward_s[-1]:.3f} s/patch, "
                f"bare run {bare_s[-1]:.3f} s/patch"
            )
    reward_median = statistics.median(reward_s)
    bare_median = statistics.median(bare_s)
    gold = [value for _, kind, value in scores if kind == "gold"]
    noop = [value for _, kind, value in scores if kind == "noop"]
    return {
        "tasks": len(tasks),
        "projects": sorted({t.project for t in tasks}),
        "patches_per_round": patches,
        "rounds": args.rounds,
        "reward_s_per_patch": round(reward_median, 4),
        "bare_run_s_per_patch": round(bare_median, 4),
        "ratio": round(reward_median / bare_median, 3),
        "gold_scored_1": sum(1 for v in gold if v == 1.0),
        "noop_scored_0": sum(1 for v in noop if v == 0.0),
    }


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"bench reward: {line}", file=sys.stderr, flush=True)

    result = measure(args, log)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0
