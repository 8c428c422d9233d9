"""Episodes of the calculator demo harness on threads, as `harnessrl bench load` runs them.

A `Load` keeps `slots` episodes running until its time is up, one after another in each slot:
the harness's own `solve()` (examples/calculator/harness.py, imported by path, unchanged)
with a real `openai.OpenAI` client whose API key is the episode's token; then, against the
gateway, the episode is closed at its admin API with the controller's own client. The SDK's
transport times every HTTP attempt and counts its outcome in the load's `Tally`.

Each slot has an HTTP client of its own, as each harness process has its own: one client
shared by a thousand threads puts them all behind its pool's one lock, whose every request
scans every connection, and the bench would time that queue instead of the gateway. For
the same reason the threads take turns on the interpreter every `SWITCH_S` instead of
Python's 5 ms: with a thousand of them waiting, a thread that had connected could wait more
than the gateway's 10 s for a request's head before it wrote it, which no harness (a process
of its own) does, and the gateway rightly closes such a connection.
"""

from __future__ import annotations

import importlib.util
import ssl
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import openai

from harnessrl.command import Progress
from harnessrl.episode_token import EpisodeClaims, mint
from harnessrl.services.controller import gateway_admin

if TYPE_CHECKING:
    from harnessrl.bench.closer import Closer
    from harnessrl.services.controller.config import GatewayReplica

SWITCH_S = 0.001
"""The interpreter's switch interval while a load runs (see the module docstring)."""
EPISODE_TIMEOUT_S = 120.0
"""Lifetime of an episode's token: the gateway forgets a closed episode once it expires."""
CALCULATOR = Path(__file__).resolve().parents[1] / "examples" / "calculator"


def calculator(questions: int) -> tuple[ModuleType, list[str]]:
    """The calculator harness module and the questions of `questions` train tasks."""
    harness = _module("harnessrl_bench_calculator_harness", CALCULATOR / "harness.py")
    tasks = _module("harnessrl_bench_calculator_tasks", CALCULATOR / "tasks.py")
    return harness, [p.question for p in tasks.problems("train", questions, 0)]


def _module(name: str, path: Path) -> ModuleType:
    """Import a file as a module, unchanged (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


@dataclass
class Tally:
    """What one phase saw; updated from every slot's thread under `lock`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    latencies: list[float] = field(default_factory=list)  # seconds per answered attempt
    close_latencies: list[float] = field(default_factory=list)
    """Seconds from the harness's end to its close's answer, as its thread saw them."""
    controller_close_latencies: list[float] = field(default_factory=list)
    """Seconds each close took in the controller's client (the gateway's answer included)."""
    calls: int = 0  # 2xx answers
    episodes: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    by_replica: Counter[str] = field(default_factory=Counter)
    """Calls the harnesses made, by the gateway replica that owned their episode."""

    def answered(self, status: int, seconds: float) -> None:
        with self.lock:
            if 200 <= status < 300:
                self.calls += 1
                self.latencies.append(seconds)
            else:
                self.errors[f"http {status}"] += 1

    def error(self, kind: str) -> None:
        with self.lock:
            self.errors[kind] += 1


class TimedTransport:
    """The SDK's HTTP transport: times each attempt to its last body byte, counts outcomes.

    `http` is the httpx the installed openai SDK is built on (httpx2 from openai 3, httpx
    before); its clients take any object with handle_request() and close() as transport.
    """

    def __init__(
        self, http: ModuleType, tally: Tally, connections: int, tls: ssl.SSLContext
    ) -> None:
        limits = http.Limits(max_connections=connections, max_keepalive_connections=connections)
        self._http = http
        self._inner = http.HTTPTransport(limits=limits, verify=tls)
        self._tally = tally

    def handle_request(self, request: Any) -> Any:
        started = time.perf_counter()
        try:
            response = self._inner.handle_request(request)
            try:
                body = b"".join(response.iter_raw())
            finally:
                response.close()
        except Exception as err:
            self._tally.error(f"transport {type(err).__name__}")
            raise
        self._tally.answered(response.status_code, time.perf_counter() - started)
        return self._http.Response(
            response.status_code,
            headers=response.headers,
            stream=self._http.ByteStream(body),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._inner.close()


def sdk_http_client(tally: Tally, connections: int, tls: ssl.SSLContext) -> Any:
    """The SDK's own default HTTP client (its timeouts) on a TimedTransport. `tls` is shared
    by every client: loading the CA store anew costs each ~20 ms of CPU."""
    http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])
    transport = TimedTransport(http, tally, connections, tls)
    return openai.DefaultHttpxClient(transport=transport)  # type: ignore[arg-type]  # duck-typed


@dataclass(frozen=True)
class Closing:
    """Where episodes go and how they are closed: each at the replica that owns it (the
    controller's rendezvous hashing over `replicas`), closed by `closer` (the controller's
    own client, in a process of its own); `timeout_s` bounds one close, retries included."""

    replicas: Sequence[GatewayReplica]
    closer: Closer
    timeout_s: float


class Load:
    """`slots` episodes at a time against `base_url`, one after another in each slot, until
    `seconds` are up; each closed at the gateway when `closing` is given."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        slots: int,
        seconds: float,
        harness: ModuleType,
        questions: list[str],
        secret: bytes,
        closing: Closing | None = None,
    ) -> None:
        self.name = name
        self.tally = Tally()
        self._base_url = base_url
        self._slots = slots
        self._seconds = seconds
        self._harness = harness
        self._questions = questions
        self._secret = secret
        self._closing = closing
        self._stop = threading.Event()
        self._go = threading.Event()
        self._deadline = 0.0
        self._tls = ssl.create_default_context()

    def stop(self) -> None:
        """Start no new episode and give up closes in progress (the gateway is about to be
        stopped); the harnesses in flight run to their end. Idempotent."""
        self._stop.set()

    def run(self) -> float:
        """Run the phase, progress on stderr; returns its wall time in seconds."""
        threads = [
            threading.Thread(target=self._slot, args=(i,), name=f"load-{i}", daemon=True)
            for i in range(self._slots)
        ]
        for thread in threads:  # each waits for `go`: slots started early would run alone
            thread.start()
        started = time.monotonic()
        self._deadline = started + self._seconds
        progress = Progress(f"bench load: {self.name} calls", None)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_S)
        self._go.set()
        try:
            while alive := [t for t in threads if t.is_alive()]:
                alive[0].join(0.25)
                tally = self.tally
                progress.update(
                    tally.calls,
                    f"{time.monotonic() - started:.0f}/{self._seconds:.0f} s, "
                    f"{tally.episodes:,} episodes, {sum(tally.errors.values())} errors",
                )
        finally:
            sys.setswitchinterval(switch)
            progress.close()
        return time.monotonic() - started

    def _slot(self, slot: int) -> None:
        http = sdk_http_client(self.tally, 2, self._tls)  # one call at a time, and a spare
        self._go.wait()
        try:
            self._episodes(slot, http)
        finally:
            http.close()

    def _episodes(self, slot: int, http: Any) -> None:
        n = 0
        while not self._stop.is_set() and time.monotonic() < self._deadline:
            n += 1
            episode_id = f"{self.name}-{slot}-{n}"
            base_url, replica = self._base_url, ""
            if self._closing is not None:  # through the gateways: the episode's owner
                owner = gateway_admin.owner(episode_id, self._closing.replicas)
                base_url, replica = f"{owner.url}/v1", owner.name
            claims = EpisodeClaims(
                episode_id,
                1,
                f"g-{episode_id}",
                "train",
                time.time() + EPISODE_TIMEOUT_S,
                gateway=replica,
            )
            client = openai.OpenAI(
                base_url=base_url,
                api_key=mint(claims, self._secret),
                http_client=http,
            )
            question = self._questions[(slot + n * self._slots) % len(self._questions)]
            calls: int | None = None
            try:
                calls = int(self._harness.solve(client, question)["calls"])
            except Exception as err:  # what would have ended the harness's process
                self.tally.error(f"harness {type(err).__name__}")
            else:
                with self.tally.lock:
                    self.tally.by_replica[replica] += calls
            if self._closing is not None and not self._stop.is_set():
                self._close(self._closing, slot, claims, calls)
            with self.tally.lock:
                self.tally.episodes += 1

    def _close(self, closing: Closing, slot: int, claims: EpisodeClaims, calls: int | None) -> None:
        """Close as the controller does once the harness exits; check its call count."""
        started = time.perf_counter()
        episode = (claims.episode_id, claims.attempt, claims.group_id, "finished")
        try:
            count, controller_s = closing.closer.close(
                slot, episode, timeout_s=closing.timeout_s, given_up=self._stop.is_set
            )
        except Exception as err:
            self.tally.error(f"close {type(err).__name__}")
            return
        with self.tally.lock:
            self.tally.close_latencies.append(time.perf_counter() - started)
            self.tally.controller_close_latencies.append(controller_s)
        if calls is not None and count != calls:
            self.tally.error("closed call_count differs from the harness's calls")
