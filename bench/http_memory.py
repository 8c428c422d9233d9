"""What stalled request bodies cost the HTTP server's memory, and whether it gets it back.

    .venv/bin/python -m harnessrl.bench.http_memory [--connections 64] [--rounds 2]

Two processes. The server (a child process) is an HttpServer with the gateway's defaults (8
MiB body limit, 30 s body timeout) and `--max-buffered-mb` as its budget for buffered
request bodies, on asyncio's own loop as `harnessrl gateway` runs; it answers GET /stats
with its buffered bytes and refusals. This process is the attacker: each round opens
`--connections` connections at once, each sends a head declaring an 8 MiB body and then 8
MiB - 1 byte of it and stalls; then it closes them all and waits until the server reports
nothing buffered. The server's resident memory (VmRSS) is read before the first round, as
its peak during each attack, and a second after each attack ended; no gc.collect() is asked
of the server. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

MiB = 1024 * 1024
BODY_LIMIT = 8 * MiB
SETTLE_S = 1.0  # after the server reports nothing buffered: let the allocator return pages
SAMPLE_S = 0.02  # RSS sampling period during an attack


def _rss_mb(pid: int) -> float:
    from harnessrl.bench.load_driver import rss_mb

    return rss_mb(pid)


async def _server(max_buffered_mb: int) -> None:
    """The server process: prints its port, serves until SIGTERM."""
    from harnessrl.http import HttpServer, Request, Response

    server: HttpServer

    async def handle(request: Request) -> Response:
        stats = {"buffered_bytes": server.buffered_bytes, "refused": server.budget_refusals}
        return Response(200, [("content-type", "application/json")], orjson.dumps(stats))

    server = HttpServer(
        handle,
        host="127.0.0.1",
        port=0,
        max_body_bytes=BODY_LIMIT,
        max_buffered_bytes=max_buffered_mb * MiB,
    )
    await server.start()
    print(server.port, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.stop(grace_s=1)


def _stats(port: int) -> dict[str, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /stats HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    stats: dict[str, int] = orjson.loads(received.partition(b"\r\n\r\n")[2])
    return stats


def _attack(port: int, body: memoryview) -> socket.socket:
    """One attacking connection, left open once it sent all it would."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-length: %d\r\n\r\n"
    try:
        sock.sendall(head % BODY_LIMIT)
        sock.sendall(body)
    except OSError:
        pass  # refused mid-send: its answer is still readable
    return sock


Stats = Callable[[int], dict[str, int]]
"""(port) -> {"buffered_bytes", "refused"} of the server under attack."""


def gateway_stats(port: int) -> dict[str, int]:
    """The stats of a real `harnessrl gateway`, from its /metrics (the harness port's)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    stats = {"buffered_bytes": 0, "refused": 0}
    names = {
        b'harnessrl_gateway_http_buffered_body_bytes{port="harness"}': "buffered_bytes",
        b'harnessrl_gateway_http_body_budget_refusals_total{port="harness"}': "refused",
    }
    for line in received.splitlines():
        name, _, value = line.rpartition(b" ")
        if name in names:
            stats[names[name]] = int(float(value))
    return stats


def _settled(port: int, stats: Stats) -> dict[str, int]:
    """The server's stats once they stopped changing (it has read all that was sent)."""
    last = stats(port)
    while True:
        time.sleep(SETTLE_S / 4)
        if (now := stats(port)) == last:
            return now
        last = now


def _answer(sock: socket.socket) -> str:
    """The status the server answered on `sock`, or what became of the connection."""
    sock.setblocking(False)
    try:
        answer = sock.recv(4096)
    except BlockingIOError:
        return "stalled"  # accepted: the server holds what it sent
    except OSError:
        return "reset"
    return answer.split(b" ", 2)[1].decode() if answer else "closed"


def attack(port: int, pid: int, connections: int, stats: Stats = _stats) -> dict[str, Any]:
    """One round: `connections` stalled near-maximal uploads at once, then all closed; the
    server's RSS at the peak and once it let go of them."""
    body = memoryview(bytes(BODY_LIMIT - 1))
    peak = 0.0
    attacking = threading.Event()
    attacking.set()

    def sample() -> None:
        nonlocal peak
        while attacking.is_set():
            peak = max(peak, _rss_mb(pid))
            time.sleep(SAMPLE_S)

    sampler = threading.Thread(target=sample)
    sampler.start()
    with ThreadPoolExecutor(connections) as pool:
        socks = list(pool.map(lambda _: _attack(port, body), range(connections)))
    buffered = _settled(port, stats)["buffered_bytes"]
    attacking.clear()
    sampler.join()
    answers: dict[str, int] = {}
    for sock in socks:
        answer = _answer(sock)
        answers[answer] = answers.get(answer, 0) + 1
        sock.close()
    deadline = time.monotonic() + 30
    while (now := stats(port))["buffered_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(SETTLE_S)
    return {
        "rss_mb_peak": round(peak, 1),
        "rss_mb_after": round(_rss_mb(pid), 1),
        "buffered_mb_at_peak": round(buffered / MiB, 1),
        "buffered_bytes_after": now["buffered_bytes"],
        "answers": answers,
        "refused_total": now["refused"],
    }


def _run(args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "harnessrl.bench.http_memory", "--role", "server"]
    command += ["--max-buffered-mb", str(args.max_buffered_mb)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    assert process.stdout is not None
    try:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("the server exited before listening")
        port = int(line)
        _stats(port)  # warm: the first request's imports and caches are not the attack's
        time.sleep(SETTLE_S)
        start = _rss_mb(process.pid)
        result: dict[str, Any] = {
            "bench": "http_memory",
            "connections": args.connections,
            "body_bytes_sent": BODY_LIMIT - 1,
            "max_buffered_mb": args.max_buffered_mb,
            "rss_mb_start": round(start, 1),
        }
        for n in range(1, args.rounds + 1):
            figures = attack(port, process.pid, args.connections)
            result.update({f"r{n}_{key}": value for key, value in figures.items()})
            print(orjson.dumps({"round": n, **figures}).decode(), flush=True)
        result["rss_mb_growth"] = round(result[f"r{args.rounds}_rss_mb_after"] - start, 1)
        return result
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (for `harnessrl bench http-memory` and `python -m`)."""
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--connections", type=int, default=64, help="stalled connections per round (default 64)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="attack rounds (default 2)")
    parser.add_argument(
        "--max-buffered-mb",
        type=int,
        default=256,
        help="the server's budget for buffered request bodies, MiB (default 256: its default)",
    )


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; prints JSON lines, the last one the summary. Returns 0."""
    result = _run(args)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>28}: {value}", file=sys.stderr)
    print(orjson.dumps(result).decode(), flush=True)
    return 0


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m harnessrl.bench.http_memory", description=__doc__
    )
    add_arguments(parser)
    parser.add_argument("--role", choices=["server"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "server":
        asyncio.run(_server(args.max_buffered_mb))
        return 0
    return main(args)


if __name__ == "__main__":
    sys.exit(_cli())
