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
import time
from pathlib import Path
from typing import Any

import orjson

PROMPT_IDS = list(range(1000, 2000))
COMPLETION_IDS = list(range(100, 164))
LEVELS = (1, 16, 64)
SECRET, ADMIN = "bench-secret-0123456789abcdef0123", "bench-admin-0123456789abcdef012345"
EPISODES = 500
BODY = orjson.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
)


def _canned() -> bytes:
    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": "bench",
            "prompt_token_ids": PROMPT_IDS,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x" * 200},
                    "finish_reason": "stop",
                    "stop_reason": None,
                    "token_ids": COMPLETION_IDS,
                    "logprobs": {
                        "content": [
                            {"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}
                            for _ in COMPLETION_IDS
                        ]
                    },
                }
            ],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 64, "total_tokens": 1064},
        }
    )


def run_loop(coroutine: Any) -> None:
    """Run `coroutine` to its end on uvloop when installed, else on asyncio's loop."""
    try:
        import uvloop

        uvloop.run(coroutine)
    except ImportError:
        asyncio.run(coroutine)


def _load(
    base: str, paths: list[str], concurrency: int, budget: tuple[float, int, bytes], out: Any
) -> None:
    """The load generator (a child process): latencies of `calls` calls (0: unlimited)
    or for `seconds`, whichever ends first, each sending `body`; `budget` is (seconds,
    calls, body). A streamed call is read to its end; one whose stream did not end is an
    error."""
    from harnessrl.http import HttpClient

    seconds, calls, body = budget
    streamed = b'"stream":true' in body

    async def main() -> None:
        client = HttpClient(base, max_connections=concurrency + 4)
        latencies: list[float] = []
        errors = 0
        deadline = time.monotonic() + seconds
        issued = 0

        async def worker() -> None:
            nonlocal errors, issued
            while time.monotonic() < deadline and (calls <= 0 or issued < calls):
                path = paths[issued % len(paths)]
                issued += 1
                started = time.perf_counter()
                headers = [("content-type", "application/json")]
                if not streamed:
                    response = await client.request("POST", path, headers=headers, body=body)
                    latencies.append(time.perf_counter() - started)
                    errors += response.status != 200
                    continue
                async with client.stream("POST", path, headers=headers, body=body) as stream:
                    data = await stream.read()
                latencies.append(time.perf_counter() - started)
                ended = b"[DONE]" in data[-64:] or b"response.completed" in data[-4096:]
                errors += stream.status != 200 or not ended

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
        await client.close()
        latencies.sort()
        out.put(
            {
                "rps": len(latencies) / elapsed,
                "errors": errors,
                "calls": len(latencies),
                "p50_ms": latencies[len(latencies) // 2] * 1000,
                "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000,
            }
        )

    run_loop(main())


def _measure(
    base: str,
    paths: list[str],
    concurrency: int,
    seconds: float,
    *,
    calls: int = 0,
    body: bytes = BODY,
) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    args = (base, paths, concurrency, (seconds, calls, body), queue)
    process = ctx.Process(target=_load, args=args)
    process.start()
    result: dict[str, float] = queue.get(timeout=seconds + 600)
    process.join()
    return result


def rss_mb(pid: int) -> float:
    """Resident memory of process `pid` in MiB, from /proc/<pid>/status (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wait_http(url: str, timeout: float = 60.0) -> None:
    """Return once GET `url` answers 200; raises RuntimeError after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def _tokens() -> list[str]:
    from harnessrl.episode_token import EpisodeClaims, mint

    expiry = time.time() + 86_400
    return [
        mint(EpisodeClaims(f"bench-{i}", 1, f"bench-g{i}", "train", expiry), SECRET.encode())
        for i in range(EPISODES)
    ]


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
        "HARNESSRL_LOG__LEVEL": "WARNING",
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
        assert piped.pid is not None
        pipe_at = (f"http://127.0.0.1:{pipe_port}", piped.pid)
        await asyncio.to_thread(wait_http, f"{pipe_at[0]}/v1/models")
        return await asyncio.to_thread(
            _run, args, engine_port, gateway_port, gateway.pid, log, pipe=pipe_at
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
) -> dict[str, Any]:
    direct = (f"http://127.0.0.1:{engine_port}", ["/v1/chat/completions"])
    through = (
        f"http://127.0.0.1:{gateway_port}",
        [f"/e/{token}/v1/chat/completions" for token in _tokens()],
    )
    _measure(*through, concurrency=16, seconds=3.0)  # warm-up: episodes, pools, caches
    result: dict[str, Any] = {
        "prompt_ids": len(PROMPT_IDS),
        "completion_ids": len(COMPLETION_IDS),
        "rounds": args.rounds,
        "seconds_per_run": args.seconds,
    }
    for concurrency in LEVELS:
        runs: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
        for r in range(args.rounds):
            for name in ("direct", "gateway") if r % 2 == 0 else ("gateway", "direct"):
                target = direct if name == "direct" else through
                runs[name].append(_measure(*target, concurrency=concurrency, seconds=args.seconds))
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
            _tokens(),
            pid=gateway_pid,
            pipe=pipe,
            seconds=args.seconds,
            rounds=args.rounds,
            log=log,
        )
    )
    before = rss_mb(gateway_pid)
    soak = _measure(*through, concurrency=64, seconds=3600.0, calls=args.soak_calls)
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
