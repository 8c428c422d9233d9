"""`harnessrl bench gateway`: what the gateway adds to a call, and how many it carries.

Three processes besides the embedded broker: a stand-in engine answering canned vLLM-shaped
chat completions (1,000 prompt ids, 64 completion ids with log-probs: the gateway's cost is
isolated from any model; streams paced token by token, bench/gateway_stream.py), the real
`harnessrl gateway` capturing every call to hrl.calls, and a load generator keeping C calls
in flight. For C in 1, 16, 64, runs alternate between the engine directly and the gateway
(each episode call through its own token); the figures are medians over rounds. Then the
streamed and Responses rows at C=16 with the gateway's CPU per call and per streamed token
(bench/gateway_stream.py), a soak of 100,000 calls through the gateway measuring its
resident memory before and after, and the stalled-upload attack (64 connections each
sending 8 MiB - 1 byte and stalling, twice; bench/http_memory.py) with the gateway's memory
at its start, peaks and after.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from typing import Any

import orjson

from harnessrl.bench.load_driver import (
    ADMIN,
    COMPLETION_IDS,
    PROMPT_IDS,
    SECRET,
    measure,
    rss_mb,
    tokens,
    wait_http,
)

LEVELS = (1, 16, 64)


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"bench gateway: {line}", file=sys.stderr, flush=True)

    result = asyncio.run(_main(args, log))
    if not args.json:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


async def _main(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    from harnessrl.bench.gateway_stream import standin as engine
    from harnessrl.bench.pipe import pipe
    from harnessrl.broker import EmbeddedBroker, free_port

    broker = EmbeddedBroker(port=0)
    await broker.start()
    engine_port, gateway_port = free_port(), free_port()
    standin = multiprocessing.get_context("spawn").Process(
        target=engine, args=(engine_port,), daemon=True
    )
    standin.start()
    pipe_port = free_port()
    piped = multiprocessing.get_context("spawn").Process(
        target=pipe, args=(pipe_port, engine_port), daemon=True
    )
    piped.start()
    spill = tempfile.mkdtemp(prefix="harnessrl-bench-gateway-")
    env = {
        **os.environ,
        "HARNESSRL_GATEWAY__TOKEN_SECRET": SECRET,
        "HARNESSRL_GATEWAY__ADMIN_TOKEN": ADMIN,
        "HARNESSRL_LOG__LEVEL": args.log_level,
        "HARNESSRL_PRODUCER__SPILL_DIR": spill,
    }
    gateway = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harnessrl",
        "gateway",
        "--port",
        str(gateway_port),
        "--engine",
        f"http://127.0.0.1:{engine_port}",
        "--bootstrap",
        broker.bootstrap,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    try:
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{engine_port}/v1/models")
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{gateway_port}/healthz")
        assert piped.pid is not None and standin.pid is not None
        pipe_at = (f"http://127.0.0.1:{pipe_port}", piped.pid)
        await asyncio.to_thread(wait_http, f"{pipe_at[0]}/v1/models")
        return await asyncio.to_thread(
            _run,
            args,
            engine_port,
            gateway_port,
            gateway.pid,
            log,
            pipe=pipe_at,
            engine_pid=standin.pid,
        )
    finally:
        gateway.send_signal(signal.SIGTERM)
        await asyncio.wait_for(gateway.wait(), 60)
        piped.terminate()
        standin.terminate()
        await broker.stop()


def _run(
    args: argparse.Namespace,
    engine_port: int,
    gateway_port: int,
    gateway_pid: int,
    log: Any,
    *,
    pipe: tuple[str, int],
    engine_pid: int,
) -> dict[str, Any]:
    direct = (f"http://127.0.0.1:{engine_port}", ["/v1/chat/completions"])
    through = (
        f"http://127.0.0.1:{gateway_port}",
        [f"/e/{token}/v1/chat/completions" for token in tokens()],
    )
    measure(*through, concurrency=16, seconds=3.0)  # warm-up: episodes, pools, caches
    result: dict[str, Any] = {
        "prompt_ids": len(PROMPT_IDS),
        "completion_ids": len(COMPLETION_IDS),
        "rounds": args.rounds,
        "seconds_per_run": args.seconds,
        "gateway_log_level": args.log_level,
    }
    for concurrency in LEVELS:
        runs: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
        for r in range(args.rounds):
            for name in ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct"):
                target = direct if name == "direct" else through
                runs[name].append(measure(*target, concurrency=concurrency, seconds=args.seconds))
        d = {
            k: statistics.median(x[k] for x in runs["direct"]) for k in ("p50_ms", "p99_ms", "rps")
        }
        g = {
            k: statistics.median(x[k] for x in runs["gateway"]) for k in ("p50_ms", "p99_ms", "rps")
        }
        errors = sum(x["errors"] for x in runs["gateway"] + runs["direct"])
        result[f"added_p50_ms_c{concurrency}"] = round(g["p50_ms"] - d["p50_ms"], 3)
        result[f"added_p99_ms_c{concurrency}"] = round(g["p99_ms"] - d["p99_ms"], 3)
        result[f"rps_direct_c{concurrency}"] = round(d["rps"], 1)
        result[f"rps_gateway_c{concurrency}"] = round(g["rps"], 1)
        result[f"errors_c{concurrency}"] = errors
        log(
            f"c={concurrency}: gateway {g['rps']:,.0f} calls/s p50 {g['p50_ms']:.2f} ms "
            f"p99 {g['p99_ms']:.2f} ms; direct {d['rps']:,.0f} calls/s p50 {d['p50_ms']:.2f} ms"
        )
    from harnessrl.bench import gateway_stream

    result.update(
        gateway_stream.rows(
            direct[0],
            through[0],
            tokens(),
            pid=gateway_pid,
            engine_pid=engine_pid,
            pipe=pipe,
            seconds=args.seconds,
            rounds=args.rounds,
            log=log,
        )
    )
    before = rss_mb(gateway_pid)
    soak = measure(*through, concurrency=64, seconds=3600.0, calls=args.soak_calls)
    after = rss_mb(gateway_pid)
    log(
        f"soak: {soak['calls']:,.0f} calls at {soak['rps']:,.0f}/s, RSS {before:.1f} -> "
        f"{after:.1f} MB"
    )
    from harnessrl.bench.http_memory import attack, gateway_stats

    start = rss_mb(gateway_pid)
    for n in (1, 2):  # the security review's attack: 64 stalled 8 MiB - 1 byte uploads
        figures = attack(gateway_port, gateway_pid, 64, gateway_stats)
        result.update({f"upload_attack_r{n}_{k}": v for k, v in figures.items()})
        log(
            f"upload attack {n}: RSS {start:.1f} -> peak {figures['rss_mb_peak']:.1f} -> "
            f"{figures['rss_mb_after']:.1f} MB after; answers {figures['answers']}"
        )
    result["upload_attack_rss_mb_start"] = round(start, 1)
    result["upload_attack_rss_mb_growth"] = round(
        result["upload_attack_r2_rss_mb_after"] - start, 1
    )
    result.update(
        {
            "soak_calls": int(soak["calls"]),
            "soak_errors": int(soak["errors"]),
            "rss_mb_before": round(before, 1),
            "rss_mb_after": round(after, 1),
            "rss_growth_mb": round(after - before, 1),
        }
    )
    return result
