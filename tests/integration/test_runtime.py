"""Service lifecycle: signals, bounded teardown, exit codes, structured logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _start(*args: str, timeout_s: float = 5.0) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "HARNESSRL_LIFECYCLE__SHUTDOWN_TIMEOUT_S": str(timeout_s),
        "HARNESSRL_INSTANCE": "life-0",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.workers.lifecycle_service", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "running"
    return process


def _logs(process: subprocess.Popen[str]) -> list[dict[str, object]]:
    assert process.stderr is not None
    return [json.loads(line) for line in process.stderr.read().splitlines()]


def test_sigterm_drains_in_flight_work_and_exits_zero() -> None:
    process = _start("--drain", "0.5")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert process.stdout is not None
    assert process.stdout.read().strip() == "drained"
    logs = _logs(process)
    messages = [entry["msg"] for entry in logs]
    assert "stopping" in messages
    assert messages[-1] == "stopped"
    assert all(entry["service"] == "lifecycle" for entry in logs)


def test_work_past_the_shutdown_deadline_is_cancelled() -> None:
    process = _start("--drain", "60", timeout_s=1.0)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 1
    assert "shutdown deadline passed; cancelling" in [e["msg"] for e in _logs(process)]


@pytest.mark.parametrize("between_s", [0.0, 0.5])
def test_a_second_signal_cancels_at_once(between_s: float) -> None:
    # 0.5 s: the second signal comes while the service is draining (past the first wait).
    process = _start("--drain", "60", timeout_s=60.0)
    process.send_signal(signal.SIGTERM)
    time.sleep(between_s)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 1
    messages = [entry["msg"] for entry in _logs(process)]  # every line structured: no traceback
    assert "second signal; cancelling" in messages
    assert messages[-1] == "stopped"


def test_a_failing_service_exits_nonzero_with_its_traceback_logged() -> None:
    env = {**os.environ}
    result = subprocess.run(
        [sys.executable, "-m", "tests.integration.workers.lifecycle_service", "--fail"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1
    failure = next(
        json.loads(line) for line in result.stderr.splitlines() if '"service failed"' in line
    )
    assert "cannot reach the reward service" in str(failure["traceback"])
