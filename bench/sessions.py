"""`harnessrl bench sessions`: production sessions through the real services, and what the
sessions awaiting feedback cost them in memory.

Six processes: the embedded broker (Tansu), the engine stand-in (bench/calculator_standin.py),
and `harnessrl gateway`, `harnessrl reward` and `harnessrl sample-builder` started from one
generated config with one production app (exploration 1: every session trains; one required
signal, `thumbs`), their stores in a temporary directory; this process drives them over HTTP
with the project's client, `--concurrency` requests in flight.

1. Sessions: each is one chat call through the gateway naming it in `x-harnessrl-session`,
   then `POST /sessions/<id>/end`. First N/10 sessions, then the other 9N/10; each part is
   timed until the reward service holds all of them awaiting feedback
   (`harnessrl_feedback_sessions{state="awaiting_feedback"}`) and the sample builder has
   parked them (`harnessrl_samples_sessions{state="waiting"}`).
2. Memory: after each part, with N/10 and then N sessions awaiting feedback and none given
   yet, the peak (VmHWM) and current (VmRSS) resident memory of each process, and the size of
   the stores on disk.
3. Signals: one `thumbs` per session through the feedback API, timed until the reward service
   has published every session's reward (`state="published"`), then until the sample builder
   has published every session's samples.
4. Baseline, last (its episodes stay in the sample builder's memory, waiting for a controller
   that never comes): `--baseline-episodes` controller episodes through the same gateway, each
   one call with its own episode token and a close at the admin API, as the controller does.
   `session_over_episode_gateway` is the sessions' rate at the gateway (the clients' time)
   over the episodes'.

Every session is accounted: each count in the JSON must equal `sessions`. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

APP, KEY = "bench", "bench-app-key-0123456789abcdef0123"
SECRET, ADMIN = "bench-sessions-secret-0123456789ab", "bench-sessions-admin-0123456789abcd"
AUTH = ("authorization", f"Bearer {KEY}")
JSON = ("content-type", "application/json")
CHAT = orjson.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "What is 17 + 25?"}]}
)
STALL_S = 180.0
"""A wait that sees no progress for this long fails, naming what is missing."""
SERVICES = ("gateway", "reward", "sample-builder")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument(
        "--sessions", type=int, default=100_000, help="sessions (default 100000; at least 10)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=64, help="requests in flight (default 64)"
    )
    parser.add_argument(
        "--baseline-episodes",
        type=int,
        default=10_000,
        help="controller episodes of the baseline, at most --sessions (default 10000)",
    )


def main(args: argparse.Namespace) -> int:
    if args.sessions < 10:
        raise SystemExit("bench sessions: --sessions must be at least 10")

    def log(line: str) -> None:
        print(f"bench sessions: {line}", file=sys.stderr, flush=True)

    result = asyncio.run(_main(args, log))
    if not args.json:
        for key, value in result.items():
            print(f"{key:>40}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


def _config(work: Path, bootstrap: str, ports: dict[str, int]) -> Path:
    """The one config file every service reads (JSON is YAML)."""
    config = {
        "kafka": {"bootstrap_servers": bootstrap},
        "consumer": {"session_timeout_ms": 2000, "heartbeat_interval_ms": 500},
        "log": {"level": "WARNING"},
        "gateway": {
            "token_secret": SECRET,
            "admin_token": ADMIN,
            "engines": [f"http://127.0.0.1:{ports['engine']}"],
        },
        "reward": {"port": ports["reward"], "feedback_port": ports["feedback"]},
        "sample_builder": {"port": ports["sample-builder"]},
        "production": {
            "apps": [
                {
                    "name": APP,
                    "key_sha256": hashlib.sha256(KEY.encode()).hexdigest(),
                    "exploration": 1.0,
                }
            ],
            "store": str(work / "sessions"),
        },
    }
    path = work / "config.yaml"
    path.write_bytes(orjson.dumps(config))
    return path


async def _main(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    from harnessrl.bench import calculator_standin
    from harnessrl.bench.load_driver import wait_http
    from harnessrl.broker import EmbeddedBroker, free_ports

    names = ("engine", "gateway", "reward", "feedback", "sample-builder")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    broker = EmbeddedBroker(port=0)
    await broker.start()
    standin = multiprocessing.get_context("spawn").Process(
        target=calculator_standin.serve, args=(ports["engine"],), daemon=True
    )
    standin.start()
    processes: dict[str, asyncio.subprocess.Process] = {}
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-sessions-") as temp:
        work = Path(temp)
        config = _config(work, broker.bootstrap, ports)
        try:
            for name in SERVICES:
                processes[name] = await _service(name, config, work, ports[name])
            for name in ("engine", *SERVICES):
                path = "/v1/models" if name == "engine" else "/healthz"
                await asyncio.to_thread(wait_http, f"http://127.0.0.1:{ports[name]}{path}", 120)
            log(f"broker, stand-in engine, {', '.join(SERVICES)} up")
            pids = {name: p.pid for name, p in processes.items()} | {"broker": broker.pid}
            bench = _Bench(args, ports, pids, processes, log)
            try:
                return await bench.run(work / "sessions")
            finally:
                await bench.close()
        finally:
            for name in reversed(SERVICES):
                if name in processes:
                    await _stop(processes[name])
            standin.terminate()
            await asyncio.to_thread(standin.join, 10)
            await broker.stop()


async def _service(name: str, config: Path, work: Path, port: int) -> asyncio.subprocess.Process:
    env = {**os.environ, "HARNESSRL_PRODUCER__SPILL_DIR": str(work / "spill" / name)}
    port_args = ["--port", str(port)] if name == "gateway" else []
    output = (work / f"{name}.log").open("wb")
    with output:  # the child holds its own copy of the descriptor
        return await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "harnessrl", name, "--config", str(config), *port_args),
            env=env,
            stdout=output,
            stderr=output,
        )


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM, then SIGKILL if it is still there after 60 s."""
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 60)
        except TimeoutError:
            process.kill()
            await process.wait()


def memory_mb(pid: int) -> dict[str, float]:
    """Peak (VmHWM) and current (VmRSS) resident memory of `pid` in MiB, from /proc."""
    fields = {"VmHWM:": "peak_rss_mb", "VmRSS:": "rss_mb"}
    figures = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition("\t")
        if name in fields:
            figures[fields[name]] = round(int(rest.split()[0]) / 1024, 1)
    return figures


def metrics(text: bytes, name: str) -> dict[str, float]:
    """The values of Prometheus metric `name` in an exposition, by its `state` label."""
    values = {}
    prefix = f'{name}{{state="'.encode()
    for line in text.splitlines():
        if line.startswith(prefix):
            state, _, value = line[len(prefix) :].partition(b'"} ')
            values[state.decode()] = float(value)
    return values


class _Bench:
    """The phases, against services already started."""

    def __init__(
        self,
        args: argparse.Namespace,
        ports: dict[str, int],
        pids: dict[str, int],
        processes: dict[str, asyncio.subprocess.Process],
        log: Callable[[str], None],
    ) -> None:
        from harnessrl.http import HttpClient

        self._args, self._pids, self._processes, self._log = args, pids, processes, log
        url = "http://127.0.0.1:{}".format
        size = args.concurrency + 4
        self._gateway = HttpClient(url(ports["gateway"]), max_connections=size)
        self._feedback = HttpClient(url(ports["feedback"]), max_connections=size)
        self._reward = HttpClient(url(ports["reward"]), max_connections=2)
        self._builder = HttpClient(url(ports["sample-builder"]), max_connections=2)
        self._errors: dict[str, int] = {}

    async def close(self) -> None:
        for client in (self._gateway, self._feedback, self._reward, self._builder):
            await client.close()

    async def run(self, store: Path) -> dict[str, Any]:
        n, args = self._args.sessions, self._args
        result: dict[str, Any] = {"sessions": n, "concurrency": args.concurrency}
        result["cpus"] = os.cpu_count()
        gateway_s = e2e_s = 0.0
        for part, (lo, hi) in enumerate(((0, n // 10), (n // 10, n))):
            started = time.perf_counter()
            await self._drive("session", lo, hi, self._session)
            gateway_s += time.perf_counter() - started
            await self._until("reward", "awaiting_feedback", hi)
            e2e_s += time.perf_counter() - started
            await self._until("sample-builder", "waiting", hi)
            label = "tenth" if part == 0 else "all"
            result[f"memory_{label}"] = {"waiting": hi, **self._memory(store)}
            self._log(f"{hi:,} sessions awaiting feedback: {result[f'memory_{label}']}")
        result["sessions_per_s"] = round(n / e2e_s, 1)
        result["sessions_per_s_at_gateway"] = round(n / gateway_s, 1)
        started = time.perf_counter()
        await self._drive("signal", 0, n, self._signal)
        signals_s = time.perf_counter() - started
        await self._until("reward", "published", n)
        decided_s = time.perf_counter() - started
        await self._until("sample-builder", "published", n)
        built_s = time.perf_counter() - started
        result["signals_per_s"] = round(n / decided_s, 1)
        result["signals_per_s_accepted"] = round(n / signals_s, 1)
        result["sessions_built_per_s"] = round(n / built_s, 1)
        result["reward_sessions"] = await self._states("reward")
        result["builder_sessions"] = await self._states("sample-builder")
        episodes = min(args.baseline_episodes, n)
        if episodes > 0:
            tokens = _tokens(episodes)
            started = time.perf_counter()
            await self._drive("episode", 0, episodes, lambda i: self._episode(i, tokens[i]))
            rate = episodes / (time.perf_counter() - started)
            result["baseline_episodes"] = episodes
            result["episodes_per_s_at_gateway"] = round(rate, 1)
            result["session_over_episode_gateway"] = round(n / gateway_s / rate, 3)
        result["errors"] = self._errors
        return result

    async def _drive(
        self, what: str, lo: int, hi: int, one: Callable[[int], Awaitable[bool]]
    ) -> None:
        """Run `one(i)` for i in [lo, hi), `--concurrency` at a time; count the failures."""
        following = iter(range(lo, hi))
        done = 0

        async def worker() -> None:
            nonlocal done
            for i in following:
                if not await one(i):
                    self._errors[what] = self._errors.get(what, 0) + 1
                done += 1

        async def progress() -> None:
            while True:
                await asyncio.sleep(10)
                self._log(f"{what}s: {lo + done:,} of {hi:,}")

        reporter = asyncio.create_task(progress())
        try:
            await asyncio.gather(*(worker() for _ in range(self._args.concurrency)))
        finally:
            reporter.cancel()
        self._log(f"{what}s: {hi:,} sent, errors {self._errors.get(what, 0)}")

    async def _session(self, i: int) -> bool:
        headers = [AUTH, JSON, ("x-harnessrl-session", f"b-{i}")]
        call = await self._gateway.request(
            "POST", "/v1/chat/completions", headers=headers, body=CHAT
        )
        end = await self._gateway.request("POST", f"/sessions/b-{i}/end", headers=[AUTH])
        return call.status == 200 and end.status == 200

    async def _signal(self, i: int) -> bool:
        body = orjson.dumps({"session": f"b-{i}", "name": "thumbs", "value": (i % 2) * 2 - 1})
        answer = await self._feedback.request(
            "POST", "/v1/feedback", headers=[AUTH, JSON], body=body
        )
        return answer.status == 202

    async def _episode(self, i: int, token: str) -> bool:
        call = await self._gateway.request(
            "POST", f"/e/{token}/v1/chat/completions", headers=[JSON], body=CHAT
        )
        body = orjson.dumps({"attempt": 1, "group_id": f"bench-g{i}", "reason": "done"})
        close = await self._gateway.request(
            "POST",
            f"/admin/episodes/bench-{i}/close",
            headers=[("authorization", f"Bearer {ADMIN}"), JSON],
            body=body,
        )
        return call.status == 200 and close.status == 200

    async def _states(self, service: str) -> dict[str, float]:
        client = self._reward if service == "reward" else self._builder
        name = (
            "harnessrl_feedback_sessions" if service == "reward" else "harnessrl_samples_sessions"
        )
        return metrics((await client.request("GET", "/metrics")).body, name)

    async def _until(self, service: str, state: str, n: int) -> None:
        """Until `service` counts at least `n` sessions in `state`. Raises RuntimeError when
        the count stops moving for STALL_S or a service exits."""
        last, moved, shown = -1.0, time.monotonic(), time.monotonic()
        while (count := (await self._states(service)).get(state, 0.0)) < n:
            if count != last:
                last, moved = count, time.monotonic()
            if time.monotonic() - shown > 10:
                self._log(f"{service}: {count:,.0f} of {n:,} sessions {state}")
                shown = time.monotonic()
            exited = [name for name, p in self._processes.items() if p.returncode is not None]
            if exited or time.monotonic() - moved > STALL_S:
                raise RuntimeError(
                    f"{service}: {count:.0f} of {n} sessions {state} "
                    f"({', '.join(exited) + ' exited' if exited else 'stalled'})"
                )
            await asyncio.sleep(0.2)

    def _memory(self, store: Path) -> dict[str, Any]:
        figures: dict[str, Any] = {name: memory_mb(pid) for name, pid in self._pids.items()}
        on_disk = sum(f.stat().st_size for f in store.iterdir() if f.is_file())
        figures["stores_on_disk_mb"] = round(on_disk / 2**20, 1)
        return figures


def _tokens(n: int) -> list[str]:
    """Episode tokens for episodes bench-<i> of groups bench-g<i>, valid a day."""
    from harnessrl.episode_token import EpisodeClaims, mint

    expiry = time.time() + 86_400
    return [
        mint(EpisodeClaims(f"bench-{i}", 1, f"bench-g{i}", "train", expiry), SECRET.encode())
        for i in range(n)
    ]
