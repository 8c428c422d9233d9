"""`harnessrl experiment` as `make demo` runs it, shortened: a real stack from `harnessrl up`,
the calculator harness, one training step, two evaluations, the report."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from harnessrl.telemetry.jsonl import read_spans
from harnessrl.telemetry.tracetree import episode_path, from_otlp

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "calculator"))

import tasks as calculator_tasks  # noqa: E402


def _write(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


async def test_experiment_measures_trains_a_step_measures_again_and_reports(
    tmp_path: Path,
) -> None:
    settings = yaml.safe_load((ROOT / "examples" / "calculator" / "demo.yaml").read_text())
    settings["controller"]["group_size"] = 4  # shortened: groups of four, a step per group
    settings["trainer"]["batch_groups"] = 1
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(settings))
    train = _write(
        tmp_path / "train.jsonl",
        [calculator_tasks.task_line(p) for p in calculator_tasks.problems("train", 40, seed=3)],
    )
    val = _write(
        tmp_path / "val.jsonl",
        [calculator_tasks.task_line(p) for p in calculator_tasks.problems("val", 6, seed=0)],
    )
    run_dir = tmp_path / "run"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harnessrl", "experiment", "--config", str(config),
        "--train", str(train), "--val", str(val), "--steps", "1", "--run-dir", str(run_dir),
        cwd=ROOT, env={**os.environ, "NO_COLOR": "1"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 400)
    assert process.returncode == 0, err.decode()[-4000:]
    summary = json.loads(out.decode().strip().splitlines()[-1])
    assert set(summary) == {
        "val_before",
        "val_after",
        "episodes",
        "steps",
        "minutes",
        "published_bytes",
    }
    assert summary["steps"] == 1
    assert summary["published_bytes"] > 0  # what the last version's weight sync moved
    assert summary["episodes"] >= 4
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["val_before"]["episodes"] == metrics["val_after"]["episodes"] == 6
    assert metrics["val_before"]["versions"] == [0]
    assert metrics["val_after"]["versions"] == [1]  # measured on the trained policy only
    assert metrics["train"]["steps"][0]["loss"] is not None
    assert metrics["train"]["merge"]["calls"] >= 4
    # The token books count every captured token, the val groups' (never trained) too.
    merge = metrics["train"]["merge"]
    dropped = {k: v for k, v in merge.items() if k.startswith("tokens_dropped_")}
    assert merge["tokens_captured"] == merge["tokens_trained"] + sum(dropped.values())
    assert dropped.get("tokens_dropped_val", 0) > 0
    assert (run_dir / "report.png").read_bytes().startswith(b"\x89PNG")
    assert "data:image/png;base64," in (run_dir / "report.html").read_text()
    # The hint names an episode whose calls lead, through its group, to the step.
    hint = metrics["trace_hint"]
    assert "harnessrl trace" in hint
    episode = hint.split("harnessrl trace ")[1].split()[0]
    spans = [from_otlp(s) for s in read_spans(run_dir / "stack" / "traces.jsonl")]
    path = episode_path(spans, episode)
    assert path is not None and path.groups and path.steps
    assert not (run_dir / "stack" / "stack.json").exists()  # the stack was stopped
