"""`harnessrl bench load`, shortened: the real CLI, broker, gateway, stand-in engine and SDK,
with a few hundred episodes at once (1,000 once stopped closing, issue 39; this catches a
close lost or refused at that scale by count: every close answered, each with its
EpisodeClosed, every answered call captured).

Timings are not asserted (they belong to the benchmark's output, not to tests).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

EPISODES = 300
KEYS = ("episodes", "calls", "errors", "p50_ms", "p99_ms", "max_ms", "captured", "closed")
RATIOS = ("p50_ratio", "p99_ratio", "throughput_ratio")


@pytest.mark.parametrize("gateways", [1, 2])
def test_bench_load_runs_without_errors_and_captures_every_answered_call(gateways: int) -> None:
    command = [sys.executable, "-m", "harnessrl", "bench", "load", "--json"]
    short = ["--episodes", str(EPISODES), "--seconds", "8", "--baseline-seconds", "1"]
    short += ["--gateways", str(gateways)]
    done = subprocess.run(
        [*command, *short], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert all(key in result for key in KEYS + RATIOS), result
    assert result["errors"] == 0 and result["error_kinds"] == {}, result
    assert result["baseline_errors"] == 0 and result["baseline_calls"] > 0, result
    assert result["concurrency"] == EPISODES
    # more episodes than slots: each slot ran one after another, every one closed
    assert result["episodes"] > EPISODES and result["closed"] == result["episodes"]
    # the stand-in plays 2 to 4 calls an episode, and the gateway captured each answered one
    assert 2 * result["episodes"] <= result["calls"] <= 4 * result["episodes"]
    assert result["captured"] == result["calls"]
    assert "bench load: gateway" in done.stderr and "0 errors" in done.stderr
    # each replica carried its own episodes' calls (rendezvous hashing spreads them)
    replicas = result["replicas"]
    assert result["gateways"] == gateways and len(replicas) == gateways, result
    assert sum(r["calls"] for r in replicas.values()) == result["calls"]
    assert all(r["calls"] > 0 for r in replicas.values()), replicas
