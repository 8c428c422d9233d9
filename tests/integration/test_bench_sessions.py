"""`harnessrl bench sessions`, at 200 sessions: the real CLI, broker, stand-in engine,
gateway, reward service and sample builder, each its own process.

Timings are not asserted (they belong to the benchmark's output, not to tests).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROCESSES = ("gateway", "reward", "sample-builder", "broker")
RATES = (
    "sessions_per_s",
    "sessions_per_s_at_gateway",
    "signals_per_s",
    "signals_per_s_accepted",
    "sessions_built_per_s",
    "episodes_per_s_at_gateway",
    "session_over_episode_gateway",
)


def test_bench_sessions_accounts_for_every_session_from_its_call_to_its_samples() -> None:
    command = [sys.executable, "-m", "harnessrl", "bench", "sessions", "--json"]
    small = ["--sessions", "200", "--concurrency", "8", "--baseline-episodes", "50"]
    done = subprocess.run(
        [*command, *small], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert result["sessions"] == 200 and result["concurrency"] == 8, result
    assert result["cpus"] >= 1 and result["baseline_episodes"] == 50, result
    assert all(result[key] > 0 for key in RATES), result
    assert result["errors"] == {}, result
    # Every session awaited feedback (both memory readings are taken with all of them
    # waiting), got its reward from its one signal, and was built exactly once.
    assert result["memory_tenth"]["waiting"] == 20 and result["memory_all"]["waiting"] == 200
    for reading in (result["memory_tenth"], result["memory_all"]):
        for name in PROCESSES:
            assert 0 < reading[name]["rss_mb"] <= reading[name]["peak_rss_mb"], reading
        assert reading["stores_on_disk_mb"] > 0, reading
    assert result["reward_sessions"]["published"] == 200, result
    assert result["reward_sessions"]["awaiting_feedback"] == 0, result
    assert result["builder_sessions"]["published"] == 200, result
    assert result["builder_sessions"]["waiting"] == 0, result
    assert "bench sessions: 200 sessions awaiting feedback" in done.stderr
