"""`harnessrl bench load`: hundreds of concurrent episodes of the demo harness through the
gateway. Does it answer every call and capture every call, and at what latency?

Five processes: the embedded broker, the stand-in engine (bench/calculator_standin.py), the
real `harnessrl gateway` capturing every call to hrl.calls, the controller's part
(bench/closer.py: the controller's own client closing episodes at the gateway's admin API),
and this one, which keeps `--episodes` episodes running on threads for `--seconds`
(bench/episode_load.py): each is the calculator harness's own `solve()` with a real
`openai.OpenAI` client whose API key is the episode's token; when it ends, the episode is
closed, and the next episode starts in its slot. Close latency is given twice: in the
controller's client, and as the harness's thread saw it (the hand-offs included).

The SDK's transport times every HTTP attempt (request sent to last body byte) and counts its
outcome. An error is any exception or non-2xx answer the harness sees (attempts the SDK then
retried included), an episode that fails to close or whose closed call count differs from
the calls the harness made, and any answered call missing from hrl.calls (read back at the
end). Before that, the same load runs `--baseline-seconds` straight against the stand-in
(no gateway), so the ratios are measured in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from harnessrl.bench.closer import Closer
from harnessrl.bench.episode_load import Closing, Load, calculator

SECRET, ADMIN = "bench-load-secret-0123456789abcdef", "bench-load-admin-0123456789abcdef012"
CLOSE_TIMEOUT_S = 30.0
"""How long closing an episode may retry (the controller's client) before it is an error."""
STOP_GRACE_S = 60.0
"""On Ctrl-C, how long episodes in flight get to end before the processes are stopped."""
QUESTIONS = 1000


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000, 2) if values else 0.0


@dataclass(frozen=True)
class Usage:
    """A process's resident memory (MiB) and CPU time used so far (user + system, s)."""

    rss_mb: float
    cpu_s: float

    @classmethod
    def of(cls, pid: int) -> Usage | None:
        """Read from /proc (Linux); None when the process is gone."""
        from harnessrl.bench.load_driver import rss_mb

        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            rss = rss_mb(pid)
        except (FileNotFoundError, ProcessLookupError):
            return None
        return cls(rss, (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK"))


async def _phase(load: Load, gateways: Sequence[asyncio.subprocess.Process] = ()) -> float:
    """Run `load` on a thread; its wall time. If a gateway exits meanwhile, that is an error
    and no new episode starts. When cancelled (Ctrl-C), its episodes in flight end first."""
    task = asyncio.ensure_future(asyncio.to_thread(load.run))
    exits = [asyncio.ensure_future(g.wait()) for g in gateways]
    try:
        await asyncio.wait([task, *exits], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            load.tally.error("a gateway exited under load")
            load.stop()
        return await asyncio.shield(task)
    finally:
        for watch in exits:
            watch.cancel()
        if not task.done():
            load.stop()
            await asyncio.wait([task], timeout=STOP_GRACE_S)


async def _captured(bootstrap: str, prefix: str) -> tuple[int, int]:
    """(ModelCalls, EpisodeClosed) on hrl.calls whose episode id starts with `prefix`."""
    from harnessrl import events
    from harnessrl.bus.snapshot import read_to_end
    from harnessrl.config import KafkaSettings
    from harnessrl.v1 import events_pb2 as pb

    calls = closed = 0
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    async for _, event, _ in read_to_end(kafka, events.CALLS, client_id="bench-load"):
        if isinstance(event, pb.ModelCall) and event.episode_id.startswith(prefix):
            calls += 1
        elif isinstance(event, pb.EpisodeClosed) and event.episode_id.startswith(prefix):
            closed += 1
    return calls, closed


async def _gateway(
    bootstrap: str, engine_port: int, port: int, spill: str, replica: str
) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        "HARNESSRL_GATEWAY__TOKEN_SECRET": SECRET,
        "HARNESSRL_GATEWAY__ADMIN_TOKEN": ADMIN,
        "HARNESSRL_GATEWAY__REPLICA": replica,
        "HARNESSRL_INSTANCE": replica,
        "HARNESSRL_LOG__LEVEL": "WARNING",
        "HARNESSRL_PRODUCER__SPILL_DIR": f"{spill}/{replica}",
        # After a Ctrl-C the broker is gone (it got the terminal's SIGINT too), and the
        # gateway's producer would wait the default 20 s for it.
        "HARNESSRL_GATEWAY__SHUTDOWN_TIMEOUT_S": "5",
    }
    # Its own session: a terminal's Ctrl-C reaches the bench alone, which then stops the
    # gateway with one SIGTERM once its episodes have ended (a second signal aborts it).
    return await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "harnessrl", "gateway", "--port", str(port)),
        *("--engine", f"http://127.0.0.1:{engine_port}", "--bootstrap", bootstrap),
        env=env,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL if it is still there after 30 s."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()


async def _main(args: argparse.Namespace, log: Any) -> dict[str, Any]:
    """Start the broker, the stand-in and the gateways, run both phases, stop them all."""
    from harnessrl.bench import calculator_standin
    from harnessrl.bench.load_driver import wait_http
    from harnessrl.broker import EmbeddedBroker, free_ports
    from harnessrl.services.controller.config import GatewayReplica

    engine_port, *ports = free_ports(1 + args.gateways)
    engine = f"http://127.0.0.1:{engine_port}"
    replicas = [
        GatewayReplica(name=f"gw-{i}", url=f"http://127.0.0.1:{port}")
        for i, port in enumerate(ports)
    ]
    broker = EmbeddedBroker(port=0)
    await broker.start()
    standin = multiprocessing.get_context("spawn").Process(
        target=calculator_standin.serve, args=(engine_port,), daemon=True
    )
    standin.start()
    processes: list[asyncio.subprocess.Process] = []
    closer: Closer | None = None
    spill = tempfile.TemporaryDirectory(prefix="harnessrl-bench-load-")
    try:
        closer = Closer(replicas, ADMIN, timeout_s=CLOSE_TIMEOUT_S, channels=args.episodes)
        for replica, port in zip(replicas, ports, strict=True):
            processes.append(
                await _gateway(broker.bootstrap, engine_port, port, spill.name, replica.name)
            )
        await asyncio.to_thread(wait_http, f"{engine}/v1/models")
        for replica in replicas:
            await asyncio.to_thread(wait_http, f"{replica.url}/healthz")
        log(
            f"broker, stand-in engine and {len(replicas)} gateway(s) up; "
            f"{args.episodes} concurrent episodes"
        )
        closing = Closing(replicas, closer, CLOSE_TIMEOUT_S + 10)
        return await _run(args, engine=engine, gateways=processes, closing=closing,
                          bootstrap=broker.bootstrap)  # fmt: skip
    finally:
        if closer is not None:
            await asyncio.to_thread(closer.stop)
        for process in processes:
            await _stop(process)
        standin.terminate()
        await asyncio.to_thread(standin.join, 10)
        await broker.stop()
        spill.cleanup()


async def _run(
    args: argparse.Namespace,
    *,
    engine: str,
    gateways: list[asyncio.subprocess.Process],
    closing: Closing,
    bootstrap: str,
) -> dict[str, Any]:
    """The baseline phase, the gateway phase, and the read-back of hrl.calls."""
    harness, questions = calculator(QUESTIONS)

    def load(name: str, url: str, seconds: float, closing: Closing | None = None) -> Load:
        return Load(
            name,
            url,
            slots=args.episodes,
            seconds=seconds,
            harness=harness,
            questions=questions,
            secret=SECRET.encode(),
            closing=closing,
        )

    base = load("baseline", f"{engine}/v1", args.baseline_seconds)
    base_wall = await _phase(base)
    through = load("gateway", "", args.seconds, closing)
    before, load_cpu = [Usage.of(g.pid) for g in gateways], time.process_time()
    wall = await _phase(through, gateways)
    after, load_cpu = [Usage.of(g.pid) for g in gateways], time.process_time() - load_cpu
    captured, closed = await _captured(bootstrap, "gateway-")
    result = _result(args, (through, wall), (base, base_wall), captured, closed)
    per_call = 1000 / max(through.tally.calls, 1)
    if all(u is not None for u in [*before, *after]):
        start = sum(u.rss_mb for u in before if u is not None)
        end = sum(u.rss_mb for u in after if u is not None)
        cpu = sum(a.cpu_s - b.cpu_s for a, b in zip(after, before, strict=True) if a and b)
        result["gateway_rss_mb_start"] = round(start, 1)
        result["gateway_rss_mb_end"] = round(end, 1)
        result["gateway_cpu_ms_per_call"] = round(cpu * per_call, 3)
        result["replicas"] = {
            replica.name: _replica_figures(through.tally.by_replica[replica.name], wall, b, a)
            for replica, b, a in zip(closing.replicas, before, after, strict=True)
        }
    result["gateways"] = len(gateways)
    result["load_cpu_ms_per_call"] = round(load_cpu * per_call, 3)
    return result


def _replica_figures(calls: int, wall: float, before: Any, after: Any) -> dict[str, Any]:
    """One replica's share: its calls, calls/s, CPU per call, and calls per CPU-second (what
    one core of it carries at that rate), and its memory."""
    cpu = after.cpu_s - before.cpu_s
    return {
        "calls": calls,
        "calls_per_s": round(calls / wall, 1),
        "cpu_ms_per_call": round(cpu * 1000 / max(calls, 1), 3),
        "calls_per_cpu_s": round(calls / cpu, 1) if cpu > 0 else None,
        "rss_mb_end": round(after.rss_mb, 1),
    }


def _result(
    args: argparse.Namespace,
    gateway: tuple[Load, float],
    baseline: tuple[Load, float],
    captured: int,
    closed: int,
) -> dict[str, Any]:
    (load, wall), (base, base_wall) = gateway, baseline
    g, b = load.tally, base.tally
    errors = Counter(g.errors)
    if captured != g.calls:
        errors["answered calls not captured on hrl.calls"] += abs(g.calls - captured)
    if closed != len(g.close_latencies):
        errors["EpisodeClosed events differ from closes"] += abs(len(g.close_latencies) - closed)
    p50, p99 = _ms(g.latencies, 0.5), _ms(g.latencies, 0.99)
    b50, b99 = _ms(b.latencies, 0.5), _ms(b.latencies, 0.99)
    rate, base_rate = g.calls / wall, b.calls / base_wall
    return {
        "episodes": g.episodes,
        "calls": g.calls,
        "errors": sum(errors.values()),
        "p50_ms": p50,
        "p99_ms": p99,
        "max_ms": _ms(g.latencies, 1.0),
        "captured": captured,
        "closed": closed,
        "concurrency": args.episodes,
        "seconds": round(wall, 1),
        "calls_per_s": round(rate, 1),
        "calls_per_episode": round(g.calls / max(g.episodes, 1), 2),
        "close_p50_ms": _ms(g.close_latencies, 0.5),
        "close_p99_ms": _ms(g.close_latencies, 0.99),
        "controller_close_p50_ms": _ms(g.controller_close_latencies, 0.5),
        "controller_close_p99_ms": _ms(g.controller_close_latencies, 0.99),
        "error_kinds": dict(errors),
        "baseline_seconds": round(base_wall, 1),
        "baseline_calls": b.calls,
        "baseline_errors": sum(b.errors.values()),
        "baseline_error_kinds": dict(b.errors),
        "baseline_p50_ms": b50,
        "baseline_p99_ms": b99,
        "baseline_calls_per_s": round(base_rate, 1),
        "p50_ratio": round(p50 / b50, 2) if b50 else None,
        "p99_ratio": round(p99 / b99, 2) if b99 else None,
        "throughput_ratio": round(rate / base_rate, 3) if base_rate else None,
    }


def main(args: argparse.Namespace) -> int:
    """Run the bench; the last line on stdout is one JSON object. Exit 1 when any error."""

    def log(line: str) -> None:
        print(f"bench load: {line}", file=sys.stderr, flush=True)

    result = asyncio.run(_main(args, log))
    if not args.json:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    failed = result["errors"] + result["baseline_errors"]
    if failed:
        log(f"{failed} errors: {result['error_kinds'] | result['baseline_error_kinds']}")
    return 1 if failed else 0
