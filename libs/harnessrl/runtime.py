"""How every service process runs: logging, tracing, metrics, health, signals, teardown.

A service is an object with `run()` (returns after `stop()`), an idempotent `stop()`, and
`health()`. `serve()` is what a service's `__main__` calls:

    sys.exit(serve("reward", config, config.reward, lambda rt: RewardService(config, rt)))

SIGTERM or SIGINT asks the service to stop; it then has `shutdown_timeout_s` to finish
in-flight work before it is cancelled. A second signal cancels at once.
"""

from __future__ import annotations

import asyncio
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, Info, ProcessCollector

from harnessrl import __version__
from harnessrl.config import ServiceConfig, ServiceSection, secret_values
from harnessrl.health import HealthServer
from harnessrl.logs import configure_logging, get_logger
from harnessrl.telemetry import create_tracer_provider

log = get_logger(__name__)


class Service(Protocol):
    async def run(self) -> None:
        """Run until stop() is called (or a fatal error is raised)."""

    async def stop(self) -> None:
        """Ask run() to finish its in-flight work and return. Idempotent."""

    def health(self) -> dict[str, bool]:
        """Named checks; the service is healthy when all are true."""


@dataclass(frozen=True, slots=True)
class Runtime:
    """Per-process facilities handed to a service when it is built."""

    name: str
    instance: str
    registry: CollectorRegistry
    tracer_provider: TracerProvider

    @property
    def producer_name(self) -> str:
        return f"{self.name}/{self.instance}"

    @property
    def tracer(self) -> trace.Tracer:
        """The service's own tracer, `harnessrl.<name>` ("sample-builder" as
        "harnessrl.sample_builder")."""
        return self.tracer_provider.get_tracer(f"harnessrl.{self.name.replace('-', '_')}")


def serve(
    name: str,
    config: ServiceConfig,
    section: ServiceSection,
    build: Callable[[Runtime], Service],
    *,
    health_endpoint: bool = True,
    fast_loop: bool = False,
) -> int:
    """Run a service process to completion; returns the process exit code (0 = clean stop).

    `health_endpoint=False` for services that serve /healthz and /metrics themselves.
    `fast_loop` runs it on uvloop when installed (the gateway: its hot path is socket
    writes, which uvloop's C transports make a good deal cheaper); the default loop else.
    """
    configure_logging(name, config.log, secrets=secret_values(config))
    with asyncio.Runner(loop_factory=_fast_loop() if fast_loop else None) as runner:
        return runner.run(_serve(name, config, section, build, health_endpoint))


def _fast_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # not on this platform (the dependency is skipped on Windows)
        return None
    return uvloop.new_event_loop


async def _drain(run_task: asyncio.Task[None], timeout_s: float) -> None:
    """Give a stopping service `timeout_s` seconds to finish, then cancel it. Returns also
    when a second signal cancels it meanwhile (the caller reads the outcome)."""
    try:
        await asyncio.wait_for(asyncio.shield(run_task), timeout_s)
    except TimeoutError:
        log.error("shutdown deadline passed; cancelling", timeout_s=timeout_s)
        run_task.cancel()
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # this coroutine itself is being cancelled
        # else a second signal cancelled the service: its exit code says so


async def _serve(
    name: str,
    config: ServiceConfig,
    section: ServiceSection,
    build: Callable[[Runtime], Service],
    health_endpoint: bool,
) -> int:
    provider = create_tracer_provider(name, config.instance, config.telemetry)
    trace.set_tracer_provider(provider)  # the process entry point owns the global provider
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    Info("harnessrl_service", "The service this process runs.", registry=registry).info(
        {"service": name, "instance": config.instance, "version": __version__}
    )
    runtime = Runtime(name, config.instance, registry, provider)
    service = build(runtime)
    health = HealthServer(section.host, section.port, runtime.registry, service.health)
    if health_endpoint:
        await health.start()
        log.info("health and metrics listening", url=f"http://{section.host}:{health.port}")
    loop = asyncio.get_running_loop()
    run_task = asyncio.create_task(service.run(), name=f"{name}.run")
    stopping = asyncio.Event()
    stop_tasks: set[asyncio.Task[None]] = set()

    def on_signal(signum: int) -> None:
        if stopping.is_set():
            log.warning("second signal; cancelling", signal=signal.Signals(signum).name)
            run_task.cancel()
            return
        log.info("stopping", signal=signal.Signals(signum).name)
        stopping.set()
        task = loop.create_task(service.stop())
        stop_tasks.add(task)
        task.add_done_callback(stop_tasks.discard)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    code = 0
    try:
        await asyncio.wait(
            [run_task, asyncio.ensure_future(stopping.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if not run_task.done():
            await _drain(run_task, section.shutdown_timeout_s)
        await asyncio.gather(run_task, return_exceptions=True)
        if run_task.cancelled():
            code = 1
        elif (err := run_task.exception()) is not None:
            log.error(
                "service failed",
                error=repr(err),
                traceback="".join(traceback.format_exception(err)),
            )
            code = 1
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await health.stop()
        provider.shutdown()
    log.info("stopped", code=code)
    return code
