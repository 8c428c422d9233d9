"""The documented CLI flow: `harnessrl broker`, `submit`, `events tail`, as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from harnessrl.broker import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "tasks" / "sample.jsonl"


def harnessrl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harnessrl", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, int]]:
    """`harnessrl broker --port P` in the foreground, as a user runs it."""
    port, health = free_port(), free_port()
    env = {**os.environ, "HARNESSRL_BROKER__PORT": str(health), "HARNESSRL_LOG__FORMAT": "text"}
    process = subprocess.Popen(
        [sys.executable, "-m", "harnessrl", "broker", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert f"Kafka listening on 127.0.0.1:{port}" in line, line
    try:
        yield process, port, health
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_submit_then_tail_prints_one_json_line_per_task(
    broker_process: tuple[subprocess.Popen[str], int, int],
) -> None:
    _, port, _ = broker_process
    bootstrap = f"127.0.0.1:{port}"
    submitted = harnessrl("submit", str(SAMPLE), "--bootstrap", bootstrap)
    assert submitted.returncode == 0, submitted.stderr
    rows = [json.loads(line) for line in submitted.stdout.splitlines()]
    assert [r["task_id"] for r in rows] == ["add-17-25", "mul-6-7", "sub-90-48", "div-84-2"]

    tail = harnessrl(
        "events",
        "tail",
        "hrl.tasks",
        "--from-beginning",
        "--max",
        "4",
        "--bootstrap",
        bootstrap,
        "--timeout",
        "30",
    )
    assert tail.returncode == 0, tail.stderr
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    assert len(lines) == 4
    by_group = {line["key"]: line for line in lines}
    for row in rows:
        line = by_group[row["group_id"]]
        assert line["event_type"] == "task_submitted"
        assert line["event"]["task_id"] == row["task_id"]
        assert line["meta"]["event_id"] == f"task/{row['group_id']}"
    div = by_group[rows[3]["group_id"]]["event"]
    assert div["split"] == "MODE_VAL"
    assert json.loads(div["input_json"]) == {"question": "What is 84 / 2?"}


def test_a_bad_file_is_named_and_nothing_is_sent(
    broker_process: tuple[subprocess.Popen[str], int, int], tmp_path: Path
) -> None:
    _, port, _ = broker_process
    bootstrap = f"127.0.0.1:{port}"
    bad = tmp_path / "tasks.jsonl"
    good_lines = SAMPLE.read_text().splitlines()
    bad.write_text(
        "\n".join([*good_lines[:2], '{"task_id": "x", "split": "train"}', good_lines[3]]) + "\n"
    )
    result = harnessrl("submit", str(bad), "--bootstrap", bootstrap)
    assert result.returncode == 2
    assert f"{bad}:3: field 'input': Field required; nothing was submitted" in result.stderr
    tail = harnessrl(
        "events",
        "tail",
        "hrl.tasks",
        "--from-beginning",
        "--max",
        "1",
        "--bootstrap",
        bootstrap,
        "--timeout",
        "3",
    )
    assert tail.returncode == 1
    assert tail.stdout == ""


def test_broker_serves_health_and_metrics_and_stops_cleanly_on_ctrl_c(
    broker_process: tuple[subprocess.Popen[str], int, int],
) -> None:
    process, _, health = broker_process
    with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=5) as response:
        assert json.loads(response.read()) == {"status": "ok", "checks": {"broker_process": True}}
    with urllib.request.urlopen(f"http://127.0.0.1:{health}/metrics", timeout=5) as response:
        metrics = response.read().decode()
    assert 'harnessrl_service_info{instance="' in metrics
    assert 'service="broker"' in metrics
    assert "process_cpu_seconds_total" in metrics
    process.send_signal(signal.SIGINT)
    started = time.monotonic()
    assert process.wait(timeout=30) == 0
    assert time.monotonic() - started < 30
    assert process.stderr is not None
    assert "stopped code=0" in process.stderr.read()


def test_tail_of_a_missing_topic_is_a_clear_error(
    broker_process: tuple[subprocess.Popen[str], int, int],
) -> None:
    _, port, _ = broker_process
    result = harnessrl(
        "events", "tail", "hrl.nope", "--max", "1", "--bootstrap", f"127.0.0.1:{port}"
    )
    assert result.returncode == 2
    assert "topic 'hrl.nope' does not exist" in result.stderr


def test_broker_refuses_a_port_that_is_already_taken(
    broker_process: tuple[subprocess.Popen[str], int, int],
) -> None:
    _, port, _ = broker_process
    result = harnessrl("broker", "--port", str(port))
    assert result.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
