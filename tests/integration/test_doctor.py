"""`harnessrl doctor` against a real stack (`harnessrl up`: broker, engine on the tiny
calculator model, gateway, reward, controller) running the scripted harness of
tests/harnesses/doctor_harness.py: each production habit it can switch on trips its check,
and the clean script passes every one."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from harnessrl.apps.doctor.diagnose import DoctorOptions, run_doctor
from harnessrl.tasks import TaskLine

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One stack for every script (the doctor uses it with --stack): greedy val sampling,
    so a script's episodes play out the same way every run; bodies captured."""
    workdir = tmp_path_factory.mktemp("doctor-stack")
    settings = yaml.safe_load((ROOT / "examples" / "calculator" / "demo.yaml").read_text())
    settings["controller"]["harness"] = {
        "command": ["python", "tests/harnesses/doctor_harness.py"],
        "timeout_s": 60,
        "preload": ["openai"],
    }
    settings["reward"] = {"source": "entrypoint:tests.harnesses.doctor_harness:score"}
    settings["gateway"]["val"] = {"temperature": 0.0}
    settings["gateway"]["capture_bodies"] = True
    config = workdir / "doctor.yaml"
    config.write_text(yaml.safe_dump(settings))
    argv = [sys.executable, "-m", "harnessrl", "up", "--config", str(config)]
    argv += ["--workdir", str(workdir), "--without", "trainer", "--without", "sample-builder"]
    log = (workdir / "up.log").open("wb")
    process = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "NO_COLOR": "1"})  # fmt: skip
    stack_file = workdir / "stack.json"
    try:
        deadline = time.monotonic() + 180
        while not stack_file.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail("harnessrl up did not start:\n" + (workdir / "up.log").read_text())
            time.sleep(0.2)
        yield stack_file
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def doctor(stack: Path, tmp_path: Path, script: str, episodes: int = 4) -> dict[str, Any]:
    tasks = [
        TaskLine(task_id=f"{script}-{i}", input={"script": script}, split="val", group_size=2)
        for i in range(2)
    ]
    options = DoctorOptions(
        out=tmp_path / script,
        tasks=tasks,
        tasks_file=tmp_path / "tasks.jsonl",
        episodes=episodes,
        mode="val",
        stack_file=stack,
        timeout_s=120,
    )
    report = asyncio.run(run_doctor(options, io.StringIO()))
    assert report["run"]["episodes"] == episodes
    assert report["run"]["incomplete_groups"] == 0
    return report


def verdicts(report: dict[str, Any]) -> dict[str, str]:
    return {c["id"]: c["verdict"] for c in report["checks"]}


def check(report: dict[str, Any], id_: str) -> dict[str, Any]:
    return next(c for c in report["checks"] if c["id"] == id_)


def test_a_clean_harness_passes_every_check_and_the_files_are_written(
    stack: Path, tmp_path: Path
) -> None:
    report = doctor(stack, tmp_path, "clean")
    assert set(verdicts(report).values()) == {"ok"}, json.dumps(report["checks"], indent=1)
    assert report["verdict"] == "ok"
    merging, tokens = report["merging"], report["tokens"]
    assert merging["calls_per_episode"]["min"] >= 3
    assert merging["chains_per_episode"]["max"] == 1
    assert merging["extend_share"] == 1.0
    assert tokens["captured"] == tokens["trained"] > 0
    assert tokens["sequence_tokens"] == tokens["minimum_tokens"] < tokens["per_call_tokens"]
    assert report["tools"]["parsed_calls"] > 0 and report["tools"]["unparsed_calls"] == 0
    assert report["wire"]["bodies"] and report["wire"]["dialects"] == {
        "openai_chat": merging["calls"]
    }
    assert report["wire"]["requests"]["/v1/chat/completions"] == {"200": merging["calls"]}
    assert report["outcome"]["statuses"] == {"succeeded": 4}
    saved = json.loads((tmp_path / "clean" / "doctor.json").read_text())
    assert saved["verdict"] == "ok"
    assert (tmp_path / "clean" / "doctor.html").read_text().count("data:image/png;base64,") == 3


def test_a_system_prompt_that_changes_per_call_breaks_every_chain_and_says_where(
    stack: Path, tmp_path: Path
) -> None:
    report = doctor(stack, tmp_path, "system_prompt")
    breaks = check(report, "merge.breaks")
    assert breaks["verdict"] == "fail"
    top = report["merging"]["top_break"]
    assert top["kind"] == "other" and top["role"] == "system" and top["line"] == 3
    assert "x-request-id" in top["cause"] and "system prompt" in top["cause"]
    assert "system prompt" in breaks["detail"] and breaks["fix"]
    assert (
        report["merging"]["chains_per_episode"]["min"]
        == report["merging"]["calls_per_episode"]["min"]
    )


def test_a_sub_agent_is_reported_as_side_chains(stack: Path, tmp_path: Path) -> None:
    report = doctor(stack, tmp_path, "sub_agent")
    assert verdicts(report)["merge.side_chains"] == "warn"
    assert verdicts(report)["merge.breaks"] == "ok"
    assert report["merging"]["breaks"]["side_chain"] >= 4


def test_compaction_is_reported(stack: Path, tmp_path: Path) -> None:
    report = doctor(stack, tmp_path, "compaction")
    assert verdicts(report)["merge.compaction"] == "warn"
    assert report["merging"]["breaks"]["compaction"] == 4  # one per episode


def test_an_over_long_max_tokens_is_clamped_and_reported(stack: Path, tmp_path: Path) -> None:
    report = doctor(stack, tmp_path, "max_tokens")
    clamp = check(report, "wire.max_tokens")
    assert clamp["verdict"] == "warn" and "100000" in clamp["detail"]
    assert report["wire"]["clamped"] == report["merging"]["calls"]
    assert report["wire"]["max_tokens_asked"]["max"] == 100_000


def test_a_tool_call_cut_by_a_stop_sequence_does_not_parse(stack: Path, tmp_path: Path) -> None:
    report = doctor(stack, tmp_path, "bad_tool_call")
    parse = check(report, "tools.parse")
    assert parse["verdict"] == "fail" and "stop sequence" in parse["detail"]
    tools = report["tools"]
    assert tools["unparsed_calls"] == tools["markup_calls"] > 0
    assert "<tool_call>" in tools["unparsed_examples"][0]["text"]
    assert verdicts(report)["tools.used"] == "fail"


def test_a_constant_reward_leaves_no_group_a_signal(stack: Path, tmp_path: Path) -> None:
    report = doctor(stack, tmp_path, "constant")
    signal_check = check(report, "outcome.signal")
    assert signal_check["verdict"] == "fail" and signal_check["fix"]
    assert report["outcome"]["zero_variance_groups"] == 2
    assert report["tokens"]["dropped"] == {"zero_variance": report["tokens"]["captured"]}
    assert verdicts(report)["tokens.trained"] == "n/a"  # nothing left to judge the harness by
