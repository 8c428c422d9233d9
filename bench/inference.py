"""`harnessrl bench inference`: generation throughput of the engine at concurrency 1 and 16.

Starts `harnessrl inference` on the model in its own process, then, through its HTTP API,
keeps C requests in flight for a fixed time (C = 1, then 16) and counts the completion
tokens the engine reports. Continuous batching should make 16 several times faster than 1.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

PROMPT = "Question: What is 17 + 25? Think step by step, then answer."


async def _wait_healthy(client: Any, base: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"engine exited with code {process.returncode}")
        try:
            if (await client.get(f"{base}/healthz")).status_code == 200:
                return
        except Exception:  # not listening yet
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("engine did not become healthy within 120 s")


async def _load(
    client: Any, base: str, model: str, *, concurrency: int, seconds: float, max_tokens: int
) -> dict[str, float]:
    tokens = 0
    latencies: list[float] = []
    deadline = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal tokens
        while time.monotonic() < deadline:
            started = time.perf_counter()
            response = await client.post(
                f"{base}/v1/completions",
                json={
                    "model": model,
                    "prompt": PROMPT,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                },
            )
            response.raise_for_status()
            latencies.append(time.perf_counter() - started)
            tokens += response.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "tok_s": tokens / elapsed,
        "requests": len(latencies),
        "p50_ms": statistics.median(latencies) * 1000,
    }


def _start_engine(model: Path, port: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "harnessrl",
        "inference",
        "--model",
        str(model),
        "--port",
        str(port),
        "--no-follow-policy",
        "--max-batch",
        "32",
    ]
    env = {**os.environ, "HARNESSRL_LOG__LEVEL": "WARNING"}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _measure(
    args: argparse.Namespace, port: int, process: subprocess.Popen[bytes], log: Any
) -> dict[str, Any]:
    import httpx

    base = f"http://127.0.0.1:{port}"
    name = args.model.resolve().name
    result: dict[str, Any] = {"model": name, "max_tokens": args.max_tokens, "seconds": args.seconds}
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as c:
        await _wait_healthy(c, base, process)
        await _load(c, base, name, concurrency=2, seconds=2.0, max_tokens=args.max_tokens)
        for concurrency in (1, 16):
            figures = await _load(
                c,
                base,
                name,
                concurrency=concurrency,
                seconds=args.seconds,
                max_tokens=args.max_tokens,
            )
            log(
                f"concurrency {concurrency}: {figures['tok_s']:,.0f} tokens/s, "
                f"{figures['requests']:.0f} requests, p50 {figures['p50_ms']:,.0f} ms"
            )
            result[f"tok_s_c{concurrency}"] = round(figures["tok_s"], 1)
            result[f"requests_c{concurrency}"] = figures["requests"]
            result[f"p50_ms_c{concurrency}"] = round(figures["p50_ms"], 1)
    result["speedup"] = round(result["tok_s_c16"] / result["tok_s_c1"], 2)
    return result


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"bench inference: {line}", file=sys.stderr, flush=True)

    from harnessrl.broker import free_port

    port = free_port()
    process = _start_engine(Path(args.model), port)
    try:
        result = asyncio.run(_measure(args, port, process, log))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0
