"""`harnessrl bench http` runs every stack it compares on the proxy workload, in one run, and
prints one JSON object with harnessrl's ratios against each (figures: docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys

from harnessrl.bench.http import CONCURRENCY, PATHS, STACKS


def test_bench_http_measures_every_stack_in_one_run() -> None:
    argv = [sys.executable, "-m", "harnessrl", "bench", "http", "--seconds", "0.1", "--json"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for path in PATHS:
        for concurrency in CONCURRENCY:
            figures = result[f"{path}_c{concurrency}"]
            assert figures["rps"] > 0 and "engine_cpu_us" in figures  # CPU: 10 ms ticks
            assert (path == "direct") != ("proxy_cpu_us" in figures)
    for stack in STACKS[1:]:
        assert result[f"rps_ratio_vs_{stack}_c16"] > 0
    assert done.stderr.count("bench http:") == len(PATHS) * len(CONCURRENCY)  # progress
