"""What a proxy adds, per HTTP stack: the gateway's own (harnessrl.http server + client)
against uvicorn + httpx, FastAPI on uvicorn + httpx, and aiohttp (server + client), same run.

    harnessrl bench http [--seconds 3] [--rounds 1]

Processes besides this one, all on this machine: an upstream stand-in engine (HttpServer
answering every POST with a fixed ~1 kB JSON completion) and one proxy per stack, each
forwarding every call to it (body, content-type, authorization) and returning the engine's
status, content-type and body: the gateway's proxy workload without the capture. `harnessrl`
is this package's server and client (what the gateway runs); `uvicorn` a raw ASGI app on
uvicorn (httptools, uvloop) with httpx; `fastapi` the same behind a FastAPI route (what the
dev engine runs); `aiohttp` aiohttp's web server with its ClientSession. This process is the
load generator: C workers (C = 1, 16, 64) send POSTs of a ~1 kB chat body back to back for a
fixed time, directly to the engine (`direct`) or through a proxy.

Per path and concurrency: p50/p99 latency, requests/s, and CPU microseconds per request of
the proxy, the engine and the load generator (from /proc, over the timed window only).
`added_p50_ms` is the proxy's p50 minus the direct p50 at the same concurrency. Each
measurement prints a JSON line (stderr); the last line (stdout) is one JSON object with
medians over rounds and, per concurrency, harnessrl's requests/s and proxy CPU per request
as ratios of each other stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import orjson

CONCURRENCY = (1, 16, 64)
STACKS = ("harnessrl", "uvicorn", "fastapi", "aiohttp")
PATHS = ("direct", *STACKS)
WARMUP_S = 0.5
PROMPT = orjson.dumps(
    {
        "model": "policy",
        "messages": [{"role": "user", "content": "Question: what is 17 + 25? " * 30}],
        "max_tokens": 64,
    }
)
COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "17 + 25 = 42. " * 50},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 300, "completion_tokens": 64, "total_tokens": 364},
    }
)
_JSON = [("content-type", "application/json")]
_FORWARDED = ("content-type", "authorization")


def _listen() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def _until_terminated() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


async def _engine() -> None:
    from harnessrl.http import HttpServer, Request, Response

    async def handle(request: Request) -> Response:
        return Response(200, _JSON, COMPLETION)

    server = HttpServer(handle, host="127.0.0.1", port=0)
    await server.start()
    print(server.port, flush=True)
    await _until_terminated()
    await server.stop(grace_s=1)


async def _harnessrl_proxy(upstream: str) -> None:
    from harnessrl.http import HttpClient, HttpServer, Request, Response

    client = HttpClient(upstream, max_connections=256)

    async def handle(request: Request) -> Response:
        headers = [(k, v) for k in _FORWARDED if (v := request.headers.get(k)) is not None]
        answer = await client.request(
            request.method, request.path, headers=headers, body=request.body
        )
        kind = answer.headers.get("content-type", "application/json")
        return Response(answer.status, [("content-type", kind)], answer.body)

    server = HttpServer(handle, host="127.0.0.1", port=0)
    await server.start()
    print(server.port, flush=True)
    await _until_terminated()
    await server.stop(grace_s=1)
    await client.close()


def _httpx_client(upstream: str) -> Any:
    import httpx

    return httpx.AsyncClient(
        base_url=upstream,
        timeout=600,
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=256),
    )


async def _serve_uvicorn(app: Any) -> None:
    import uvicorn

    sock = _listen()
    config = uvicorn.Config(
        app, loop="none", http="httptools", lifespan="off", access_log=False, log_level="warning"
    )
    server = uvicorn.Server(config)
    print(sock.getsockname()[1], flush=True)
    await server.serve(sockets=[sock])  # uvicorn handles SIGTERM itself


async def _uvicorn_proxy(upstream: str) -> None:
    client = _httpx_client(upstream)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        wanted = {k.encode() for k in _FORWARDED}
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k in wanted]
        answer = await client.request(scope["method"], scope["path"], headers=headers, content=body)
        kind = answer.headers.get("content-type", "application/json").encode()
        await send(
            {
                "type": "http.response.start",
                "status": answer.status_code,
                "headers": [(b"content-type", kind)],
            }
        )
        await send({"type": "http.response.body", "body": answer.content})

    await _serve_uvicorn(app)
    await client.aclose()


async def _fastapi_proxy(upstream: str) -> None:
    from fastapi import FastAPI, Request
    from fastapi.responses import Response as FastResponse

    client = _httpx_client(upstream)
    app = FastAPI()

    async def forward(path: str, request: Request) -> FastResponse:
        headers = [(k, v) for k in _FORWARDED if (v := request.headers.get(k)) is not None]
        answer = await client.request(
            "POST", "/" + path, headers=headers, content=await request.body()
        )
        kind = answer.headers.get("content-type", "application/json")
        return FastResponse(answer.content, status_code=answer.status_code, media_type=kind)

    # This module's annotations are strings; FastAPI reads the route's from its globals,
    # which do not hold these lazily imported names: hand it the objects.
    forward.__annotations__ = {"path": str, "request": Request, "return": FastResponse}
    app.post("/{path:path}")(forward)
    await _serve_uvicorn(app)
    await client.aclose()


async def _aiohttp_proxy(upstream: str) -> None:
    import aiohttp
    from aiohttp import web

    connector = aiohttp.TCPConnector(limit=256)
    session = aiohttp.ClientSession(upstream, connector=connector, auto_decompress=False)

    async def forward(request: web.Request) -> web.Response:
        headers = {k: v for k in _FORWARDED if (v := request.headers.get(k)) is not None}
        body = await request.read()
        async with session.request(request.method, request.path, headers=headers, data=body) as r:
            content = await r.read()
            kind = r.headers.get("content-type", "application/json")
            return web.Response(status=r.status, body=content, headers={"content-type": kind})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    sock = _listen()
    site = web.SockSite(runner, sock)
    await site.start()
    print(sock.getsockname()[1], flush=True)
    await _until_terminated()
    await runner.cleanup()
    await session.close()


_PROXIES = {
    "harnessrl": _harnessrl_proxy,
    "uvicorn": _uvicorn_proxy,
    "fastapi": _fastapi_proxy,
    "aiohttp": _aiohttp_proxy,
}


def _spawn(*role: str) -> tuple[subprocess.Popen[bytes], int]:
    command = [sys.executable, "-m", "harnessrl.bench.http", "--role", *role]
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"{role[0]} exited before listening")
    return process, int(line)


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(client: Any, concurrency: int, seconds: float, latencies: list[float]) -> None:
    """C workers sending POSTs back to back for `seconds`; appends each latency (s)."""
    headers = [("content-type", "application/json"), ("authorization", "Bearer bench")]

    async def worker(until: float) -> None:
        while (now := time.perf_counter()) < until:
            answer = await client.request(
                "POST", "/v1/chat/completions", headers=headers, body=PROMPT
            )
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}")
            latencies.append(time.perf_counter() - now)

    until = time.perf_counter() + seconds
    await asyncio.gather(*(worker(until) for _ in range(concurrency)))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _measure(
    port: int, concurrency: int, seconds: float, pids: dict[str, int]
) -> dict[str, float]:
    """Figures of one path at one concurrency; CPU is counted over the timed window only."""
    from harnessrl.http import HttpClient

    client = HttpClient(f"http://127.0.0.1:{port}", max_connections=concurrency)
    await _drive(client, concurrency, WARMUP_S, [])
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    own_before = time.process_time()
    started = time.perf_counter()
    latencies: list[float] = []
    await _drive(client, concurrency, seconds, latencies)
    elapsed = time.perf_counter() - started
    own = time.process_time() - own_before
    cpu = {name: _cpu_s(pid) - before[name] for name, pid in pids.items()}
    await client.close()
    n = len(latencies)
    figures = {
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(_percentile(latencies, 0.99) * 1000, 3),
        "rps": round(n / elapsed, 1),
        "loadgen_cpu_us": round(own / n * 1e6, 1),
    }
    figures.update({f"{name}_cpu_us": round(value / n * 1e6, 1) for name, value in cpu.items()})
    return figures


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    engine, engine_port = _spawn("engine")
    upstream = f"http://127.0.0.1:{engine_port}"
    proxies = {stack: _spawn("proxy", "--stack", stack, "--upstream", upstream) for stack in STACKS}
    runs: dict[str, dict[int, list[dict[str, float]]]] = {p: {} for p in PATHS}
    try:
        for round_ in range(args.rounds):
            for concurrency in CONCURRENCY:
                shift = round_ % len(PATHS)
                order = PATHS[shift:] + PATHS[:shift]
                for path in order:
                    pids = {"engine": engine.pid}
                    port = engine_port
                    if path != "direct":
                        process, port = proxies[path]
                        pids["proxy"] = process.pid
                    figures = await _measure(port, concurrency, args.seconds, pids)
                    runs[path].setdefault(concurrency, []).append(figures)
                    line = {"path": path, "concurrency": concurrency, **figures}
                    print("bench http:", orjson.dumps(line).decode(), file=sys.stderr, flush=True)
    finally:
        for process in [engine, *(p for p, _ in proxies.values())]:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=10)
    return _summary(runs, args)


def _summary(
    runs: dict[str, dict[int, list[dict[str, float]]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Medians over rounds, and each proxy's added latency against the direct path."""
    result: dict[str, Any] = {"bench": "http", "seconds": args.seconds, "rounds": args.rounds}
    for path, by_concurrency in runs.items():
        for concurrency, figures in by_concurrency.items():
            merged = {k: statistics.median(f[k] for f in figures) for k in figures[0]}
            if path != "direct":
                direct = statistics.median(f["p50_ms"] for f in runs["direct"][concurrency])
                merged["added_p50_ms"] = round(merged["p50_ms"] - direct, 3)
            result[f"{path}_c{concurrency}"] = merged
    for concurrency in CONCURRENCY:
        ours = result[f"harnessrl_c{concurrency}"]
        for stack in STACKS[1:]:
            theirs = result[f"{stack}_c{concurrency}"]
            result[f"rps_ratio_vs_{stack}_c{concurrency}"] = round(ours["rps"] / theirs["rps"], 2)
            result[f"proxy_cpu_ratio_vs_{stack}_c{concurrency}"] = round(
                ours["proxy_cpu_us"] / theirs["proxy_cpu_us"], 2
            )
    return result


def _role(role: str, stack: str | None, upstream: str | None) -> None:
    if role == "engine":
        _loop_run(_engine())
    else:
        assert stack is not None and upstream is not None
        _loop_run(_PROXIES[stack](upstream))


def _loop_run(coroutine: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (for `harnessrl bench http`)."""
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--seconds", type=float, default=3.0, help="per measurement (default 3)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="medians are taken over rounds (default 1)"
    )


def main(args: argparse.Namespace) -> int:
    result = _loop_run(_run(args))
    if not args.json:
        for key, value in result.items():
            print(f"{key:>32}: {value}")
    print(orjson.dumps(result).decode(), flush=True)
    return 0


if __name__ == "__main__":  # a stand-in engine or a proxy, started by the benchmark
    roles = argparse.ArgumentParser(prog="python -m harnessrl.bench.http")
    roles.add_argument("--role", choices=["engine", "proxy"], required=True)
    roles.add_argument("--stack", choices=STACKS)
    roles.add_argument("--upstream")
    chosen = roles.parse_args()
    _role(chosen.role, chosen.stack, chosen.upstream)
