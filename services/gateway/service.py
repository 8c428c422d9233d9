"""`harnessrl gateway`: the harness-facing API, capture to hrl.calls, and the admin API."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

import orjson

from harnessrl import events
from harnessrl.bus import BusMetrics, Consumer, Context, Producer, Record, ensure_topics
from harnessrl.bus.snapshot import read_to_end
from harnessrl.http import HttpServer, Response
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, retry
from harnessrl.runtime import Runtime
from harnessrl.services.gateway.admin import Admin
from harnessrl.services.gateway.app import AdminApp, GatewayApp, dialects
from harnessrl.services.gateway.budget import Budget, context_of
from harnessrl.services.gateway.config import GatewayConfig
from harnessrl.services.gateway.control import Gate
from harnessrl.services.gateway.dialects.anthropic import MessagesDialect
from harnessrl.services.gateway.dialects.responses import ResponsesDialect
from harnessrl.services.gateway.dialects.responses_store import ResponseStore
from harnessrl.services.gateway.engines import EnginePool
from harnessrl.services.gateway.errors import ANTHROPIC, OPENAI, GatewayError, render
from harnessrl.services.gateway.lifecycle import CallAdmission, Engines, Lifecycle
from harnessrl.services.gateway.metrics import GatewayMetrics, ServerBudgets
from harnessrl.services.gateway.models import Models
from harnessrl.services.gateway.open_episodes import EpisodeBook
from harnessrl.services.gateway.recovery import recover
from harnessrl.services.gateway.versions import EngineVersions
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

SWEEP_INTERVAL_S = 60.0


class GatewayService:
    """Wires the gateway; see services/gateway/app.py for the routes."""

    def __init__(self, config: GatewayConfig, runtime: Runtime) -> None:
        section = config.gateway
        if section.token_secret is None:
            raise ValueError("gateway.token_secret: required (the controller's token secret)")
        if section.admin_token is None:
            raise ValueError("gateway.admin_token: required (bearer token of the admin API)")
        self._config = config
        self._runtime = runtime
        self._stopping = asyncio.Event()
        self.ready = asyncio.Event()
        self.server: HttpServer | None = None
        self.app: GatewayApp | None = None
        """The harness port's request handler, once serving."""
        self.admin_server: HttpServer | None = None
        """The admin port's server, when `gateway.admin_port` is set."""
        self._producer: Producer | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.gate = Gate(hold_s=section.pause_hold_s, retry_after_s=section.pause_retry_after_s)
        self.book = EpisodeBook()
        self.recovery = Gate(
            hold_s=section.pause_hold_s,
            retry_after_s=section.pause_retry_after_s,
            why="while it recovers its episodes after a start",
            status=503,
        )
        self.versions = EngineVersions()
        self.responses = ResponseStore(section.responses_store_max)
        """The responses episodes stored (Responses API `store`)."""

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    @property
    def admin_port(self) -> int:
        """The port of the admin API (the harness port unless `gateway.admin_port` is set)."""
        return self.admin_server.port if self.admin_server is not None else self.port

    async def run(self) -> None:
        config, section, runtime = self._config, self._config.gateway, self._runtime
        assert section.token_secret is not None and section.admin_token is not None
        metrics = GatewayMetrics(runtime.registry)
        metrics.track(
            lambda: len(self.book), lambda: self.book.in_flight, lambda: float(self.gate.paused)
        )
        bus_metrics = BusMetrics(runtime.registry)
        runtime.registry.register(
            ServerBudgets(lambda: {"harness": self.server, "admin": self.admin_server})
        )
        async with AsyncExitStack() as stack:
            producer_settings = config.producer
            if section.capture_wal:
                producer_settings = producer_settings.model_copy(update={"wal": True})
            producer = Producer(
                config.kafka, producer_settings, name=runtime.producer_name, metrics=bus_metrics
            )
            await producer.start()
            stack.push_async_callback(producer.stop)
            self._producer = producer
            self.book.recovering()
            self.recovery.pause("recovering episodes")
            pool = EnginePool(
                section.engines,
                timeout_s=section.upstream_timeout_s,
                attempts=section.upstream_attempts,
            )
            stack.push_async_callback(pool.close)
            engine_model, listing = await self._discover(pool)
            context = section.max_model_len
            if context is None and listing is not None:
                context = context_of(orjson.dumps(listing))
            lifecycle = Lifecycle(
                section,
                admission=CallAdmission(self.book, self.gate, self.recovery),
                engines=Engines(pool, model=engine_model, versions=self.versions),
                budget=Budget(
                    pool, policy=section.max_tokens_policy, context=context, metrics=metrics
                ),
                producer=producer,
                metrics=metrics,
                tracer=runtime.tracer_provider.get_tracer("harnessrl.gateway"),
            )
            admin = Admin(
                token=section.admin_token.get_secret_value().encode(),
                book=self.book,
                gate=self.gate,
                producer=producer,
                metrics=metrics,
                replica=section.replica,
                status=lambda: {
                    "replica": section.replica,
                    "engines": section.engines,
                    "engine_model": engine_model,
                    "engine_versions": dict(self.versions.snapshot()),
                },
            )
            secrets = [
                s.get_secret_value().encode()
                for s in [section.token_secret, *section.previous_token_secrets]
            ]
            separate = section.admin_port is not None
            drop = section.unserved_tools == "drop"

            def dropped(kind: str) -> None:
                metrics.tools_dropped(kind[:64]).inc()

            responses = ResponsesDialect(self.responses, drop_unserved=drop, on_dropped=dropped)
            app = GatewayApp(
                lifecycle,
                None if separate else admin,
                dialects=dialects(
                    responses, MessagesDialect(drop_unserved=drop, on_dropped=dropped)
                ),
                responses=responses,
                models=Models(engine_model, listing),
                secrets=secrets,
                registry=runtime.registry,
                health=self.health,
                max_depth=section.max_json_depth,
                replica=section.replica,
            )
            self.app = app
            self.server = await self._serve(app, section.host, section.port, stack)
            if separate:
                self.admin_server = await self._serve(
                    AdminApp(admin, registry=runtime.registry, health=self.health),
                    section.admin_host or section.host,
                    section.admin_port or 0,
                    stack,
                )
            self._background(self._topics(), "topics")
            recovering = asyncio.create_task(self._recover(producer), name="recover")
            self._tasks.append(recovering)
            self._background(self._sweep(admin), "sweep")
            self._follow_policy(producer, bus_metrics, stack)
            log.info(
                "gateway serving",
                port=self.port,
                admin_port=self.admin_port,
                engines=section.engines,
                engine_model=engine_model,
            )
            stopping = asyncio.create_task(self._stopping.wait())
            await asyncio.wait([recovering, stopping], return_when=asyncio.FIRST_COMPLETED)
            if recovering.done():
                recovering.result()  # its error, if any
                self.ready.set()
            await stopping
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def stop(self) -> None:
        self._stopping.set()

    async def _serve(self, handler: Any, host: str, port: int, stack: AsyncExitStack) -> HttpServer:
        """An HTTP server with the gateway's limits and error shapes, started; stopped with
        `stack`."""
        section = self._config.gateway
        server = HttpServer(
            handler,
            host=host,
            port=port,
            max_body_bytes=section.max_body_bytes,
            max_buffered_bytes=section.max_buffered_bytes,
            header_timeout_s=section.header_timeout_s,
            body_timeout_s=section.body_timeout_s,
            keepalive_timeout_s=section.keepalive_timeout_s,
            on_error=_error_response,
        )
        await server.start()
        stack.push_async_callback(server.stop, section.shutdown_timeout_s)
        return server

    def health(self) -> dict[str, bool]:
        return {
            "serving": self.server is not None
            and (self._config.gateway.admin_port is None or self.admin_server is not None),
            "recovered": not self.recovery.paused,
            "producer": self._producer is not None and self._producer.healthy,
        }

    def _background(self, coroutine: Any, name: str) -> None:
        self._tasks.append(asyncio.create_task(coroutine, name=name))

    async def _discover(self, pool: EnginePool) -> tuple[str, dict[str, Any] | None]:
        """(model to ask the engines for, their /v1/models answer). With
        gateway.engine_model set, no engine needs to answer for the gateway to start."""
        configured = self._config.gateway.engine_model
        if configured:
            return configured, None

        async def ask() -> bytes:
            response = await pool.get("/v1/models")
            if response.status != 200:
                raise ConnectionError(f"/v1/models answered {response.status}")
            return response.body

        body = await retry(ask, backoff=Backoff(0.2, 2.0), max_attempts=60)
        listing = orjson.loads(body)
        return str(listing["data"][0]["id"]), listing

    async def _topics(self) -> None:
        if self._config.kafka.create_topics:
            await ensure_topics(
                self._config.kafka, [events.CALLS, events.POLICY], max_attempts=10**6
            )

    async def _recover(self, producer: Producer) -> None:
        state = await recover(
            self._config.kafka,
            producer,
            window_s=self._config.gateway.recovery_window_s,
            client_id=f"{self._runtime.producer_name}/recover",
            replica=self._config.gateway.replica,
        )
        self.book.restore(state)
        self.recovery.resume()

    async def _sweep(self, admin: Admin) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.book.sweep()
            self.responses.sweep()
            admin.sweep()

    def _follow_policy(
        self, producer: Producer, metrics: BusMetrics, stack: AsyncExitStack
    ) -> None:
        """Follow hrl.policy in the background: ControlCommands (with gateway.follow_control)
        and PolicyLoaded events, whose versions are first read back from the whole topic so
        that a restarted gateway knows what each engine serves."""
        consumer = Consumer(
            self._config.kafka,
            self._config.consumer,
            topics=[events.POLICY],
            group_id=f"harnessrl.gateway.{self._config.instance}",
            handler=self._on_policy,
            producer=producer,
            metrics=metrics,
        )
        rebuilt = asyncio.Event()  # from here on, stop the consumer gracefully

        async def follow() -> None:
            await retry(self._rebuild_versions, backoff=Backoff(0.5, 5.0), max_attempts=10**6)
            rebuilt.set()
            await consumer.run()

        task = asyncio.create_task(follow(), name="policy")

        async def stop() -> None:
            await consumer.stop()
            if not rebuilt.is_set():
                task.cancel()  # still waiting for the broker: nothing in flight
            await asyncio.gather(task, return_exceptions=True)

        stack.push_async_callback(stop)

    async def _rebuild_versions(self) -> None:
        async for _, event, _ in read_to_end(
            self._config.kafka, events.POLICY, client_id=f"{self._runtime.producer_name}/versions"
        ):
            if isinstance(event, pb.PolicyLoaded):
                self.versions.loaded(event)
        log.info("engine versions read", versions=dict(self.versions.snapshot()))

    async def _on_policy(self, record: Record, ctx: Context) -> None:
        event = record.event
        if isinstance(event, pb.PolicyLoaded):
            if self.versions.loaded(event):
                log.info("engine version loaded", engine=event.engine, version=event.version)
        elif isinstance(event, pb.ControlCommand) and self._config.gateway.follow_control:
            command = event
            if command.action == pb.CONTROL_ACTION_PAUSE:
                self.gate.pause(command.reason or "control command")
            elif command.action == pb.CONTROL_ACTION_RESUME:
                self.gate.resume()
            log.info(
                "control command applied",
                action=pb.ControlAction.Name(command.action),
                paused=self.gate.paused,
            )


def _error_response(status: int, message: str, path: str = "") -> Response:
    """Errors the HTTP layer answers itself (malformed, too large, too slow), in the shape of
    the route's API: Anthropic's for /v1/messages..., else OpenAI's."""
    shape = ANTHROPIC if "/v1/messages" in path else OPENAI
    return render(shape, GatewayError(status, message))
