"""The gateway benchmarks' shared parts: the canned engine answer, the event loop, the load
generator (a child process keeping C calls in flight), the episode tokens, and the process
probes (resident memory, an HTTP endpoint answering)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from pathlib import Path
from typing import Any

import orjson

PROMPT_IDS = list(range(1000, 2000))
COMPLETION_IDS = list(range(100, 164))
SECRET, ADMIN = "bench-secret-0123456789abcdef0123", "bench-admin-0123456789abcdef012345"
EPISODES = 500
BODY = orjson.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
)


def canned() -> bytes:
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


def load(
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


def measure(
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
    process = ctx.Process(target=load, args=args)
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


def tokens() -> list[str]:
    from harnessrl.episode_token import EpisodeClaims, mint

    expiry = time.time() + 86_400
    return [
        mint(EpisodeClaims(f"bench-{i}", 1, f"bench-g{i}", "train", expiry), SECRET.encode())
        for i in range(EPISODES)
    ]
