"""`harnessrl gateway`: the harness-facing API, capture to hrl.calls, and the admin API."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from typing import Any

import orjson

from harnessrl import events
from harnessrl.bus import Context
from harnessrl.bus.snapshot import read_to_end
from harnessrl.http import HttpServer, Response
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, retry
from harnessrl.rollout import RolloutState, describe
from harnessrl.runtime import Runtime
from harnessrl.service_bus import EventHandler, ServiceBus, Subscription
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
from harnessrl.services.gateway.production_sessions import ProductionSessions
from harnessrl.services.gateway.recovery import recover
from harnessrl.services.gateway.session_owners import SessionOwners
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
        self._bus = ServiceBus(config, runtime, wal=section.capture_wal)
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
        self.rollout = RolloutState()
        """The canary rollout's state, folded from hrl.policy (harnessrl.rollout)."""
        self._policy_read = asyncio.Event()
        """Set once hrl.policy was read to its end at start."""
        self.responses = ResponseStore(section.responses_store_max)
        """The responses episodes stored (Responses API `store`)."""
        self._closers: list[Any] = []
        self.sessions: ProductionSessions | None = None
        """The production sessions this replica owns (with production.apps set)."""

    @property
    def port(self) -> int:
        return self.server.port if self.server is not None else 0

    @property
    def admin_port(self) -> int:
        """The port of the admin API (the harness port unless `gateway.admin_port` is set)."""
        return self.admin_server.port if self.admin_server is not None else self.port

    async def run(self) -> None:
        section = self._config.gateway
        metrics = self._metrics()
        async with AsyncExitStack() as stack:
            await self._bus.start(stack)
            self.book.recovering()
            self.recovery.pause("recovering episodes")
            pool = EnginePool(
                section.engines,
                timeout_s=section.upstream_timeout_s,
                attempts=section.upstream_attempts,
            )
            stack.push_async_callback(pool.close)
            engine_model, listing = await self._discover(pool)
            lifecycle = self._lifecycle(pool, engine_model, listing, metrics)
            admin = self._admin(engine_model, metrics)
            if self._config.production.apps:
                self.sessions = ProductionSessions(
                    self._config.production,
                    book=self.book,
                    producer=self._bus.producer,
                    close=admin.close,
                    metrics=metrics,
                    replica=section.replica,
                    rollout=self.rollout,
                    served=self.versions.serves,
                )
                metrics.sessions_open.set_function(lambda: len(self.sessions or ()))
            app = self._app(lifecycle, admin, engine_model, listing, metrics)
            for closer in self._closers:
                stack.push_async_callback(closer)
            await self._listen(app, admin, stack)
            recovering = self._start_background(admin, stack)
            log.info(
                "gateway serving",
                port=self.port,
                admin_port=self.admin_port,
                engines=section.engines,
                engine_model=engine_model,
            )
            await self._until_stopped(recovering)

    def _metrics(self) -> GatewayMetrics:
        """The gateway's metrics, with its gauges of open episodes, calls in flight, the
        pause and the servers' buffer budgets."""
        registry = self._runtime.registry
        metrics = GatewayMetrics(registry)
        metrics.track(
            lambda: len(self.book), lambda: self.book.in_flight, lambda: float(self.gate.paused)
        )
        registry.register(
            ServerBudgets(lambda: {"harness": self.server, "admin": self.admin_server})
        )
        return metrics

    def _lifecycle(
        self,
        pool: EnginePool,
        engine_model: str,
        listing: dict[str, Any] | None,
        metrics: GatewayMetrics,
    ) -> Lifecycle:
        """The one call lifecycle: admission, budget, forwarding to `pool`, capture."""
        section = self._config.gateway
        context = section.max_model_len
        if context is None and listing is not None:
            context = context_of(orjson.dumps(listing))
        rollout = self.rollout if self._config.production.canary.enabled else None
        return Lifecycle(
            section,
            admission=CallAdmission(self.book, self.gate, self.recovery),
            engines=Engines(pool, model=engine_model, versions=self.versions, rollout=rollout),
            budget=Budget(pool, policy=section.max_tokens_policy, context=context, metrics=metrics),
            producer=self._bus.producer,
            metrics=metrics,
            tracer=self._runtime.tracer,
        )

    def _admin(self, engine_model: str, metrics: GatewayMetrics) -> Admin:
        """The admin routes (episode closes, pause and resume, status)."""
        section = self._config.gateway
        assert section.admin_token is not None  # checked in __init__
        return Admin(
            token=section.admin_token.get_secret_value().encode(),
            book=self.book,
            gate=self.gate,
            producer=self._bus.producer,
            metrics=metrics,
            replica=section.replica,
            status=lambda: {
                "replica": section.replica,
                "engines": section.engines,
                "engine_model": engine_model,
                "engine_versions": dict(self.versions.snapshot()),
                "engine_serving": {
                    engine: {str(v): model for v, model in sorted(served.items())}
                    for engine, served in self.versions.serving().items()
                },
                "rollout": describe(self.rollout.state),
            },
        )

    def _app(
        self,
        lifecycle: Lifecycle,
        admin: Admin,
        engine_model: str,
        listing: dict[str, Any] | None,
        metrics: GatewayMetrics,
    ) -> GatewayApp:
        """The harness port's handler: every dialect, and the admin routes unless they have
        a port of their own."""
        section = self._config.gateway
        assert section.token_secret is not None  # checked in __init__
        secrets = [
            s.get_secret_value().encode()
            for s in [section.token_secret, *section.previous_token_secrets]
        ]
        drop = section.unserved_tools == "drop"

        def dropped(kind: str) -> None:
            metrics.tools_dropped(kind[:64]).inc()

        responses = ResponsesDialect(self.responses, drop_unserved=drop, on_dropped=dropped)
        return GatewayApp(
            lifecycle,
            None if section.admin_port is not None else admin,
            dialects=dialects(responses, MessagesDialect(drop_unserved=drop, on_dropped=dropped)),
            responses=responses,
            models=Models(engine_model, listing),
            secrets=secrets,
            registry=self._runtime.registry,
            health=self.health,
            max_depth=section.max_json_depth,
            replica=section.replica,
            sessions=self.sessions,
            owners=self._owners(),
        )

    def _owners(self) -> SessionOwners | None:
        """The replicas sharing production sessions, when `gateway.peers` names several."""
        section = self._config.gateway
        if self.sessions is None or len(section.peers) < 2:
            return None
        owners = SessionOwners(section.peers, section.replica, timeout_s=section.upstream_timeout_s)
        self._closers.append(owners.aclose)
        return owners

    async def _listen(self, app: GatewayApp, admin: Admin, stack: AsyncExitStack) -> None:
        """Serve `app` on the harness port, and `admin` on the admin port when it is set."""
        section = self._config.gateway
        self.app = app
        self.server = await self._serve(app, section.host, section.port, stack)
        if section.admin_port is not None:
            admin_app = AdminApp(admin, registry=self._runtime.registry, health=self.health)
            host = section.admin_host or section.host
            self.admin_server = await self._serve(admin_app, host, section.admin_port, stack)

    def _start_background(self, admin: Admin, stack: AsyncExitStack) -> asyncio.Task[None]:
        """Start what runs beside the servers: topic creation, recovery (returned), the
        sweep and following hrl.policy."""
        topics = [events.CALLS, events.POLICY]
        if self.sessions is not None:  # sessions are opened and finished here
            topics.append(events.EPISODES)
            self._background(self._sweep_sessions(self.sessions), "session sweep")
        self._background(self._bus.create_topics(topics), "topics")
        recovering = asyncio.create_task(self._recover(), name="recover")
        self._tasks.append(recovering)
        self._background(self._sweep(admin), "sweep")
        handlers: dict[type[Any], EventHandler] = {
            pb.PolicyLoaded: self._on_loaded,
            pb.PolicyVersion: self._on_version,
            pb.RolloutDecision: self._on_decision,
        }
        if self.sessions is not None:
            handlers[pb.SessionDeleted] = self._on_deleted
        if self._config.gateway.follow_control:
            handlers[pb.ControlCommand] = self._on_command
        group = f"harnessrl.gateway.{self._config.instance}"
        # hrl.policy is followed once the engines' versions and the rollout are read back
        # from all of it, so that a restarted gateway knows what each engine serves and
        # which versions serve sessions.
        self._bus.consume(stack, Subscription(group, handlers), before=self._rebuild_versions)
        return recovering

    async def _until_stopped(self, recovering: asyncio.Task[None]) -> None:
        """Ready once recovered (its error raised); then wait for stop() and end the
        background tasks."""
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
            "producer": self._bus.healthy,
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

    async def _recover(self) -> None:
        state = await recover(
            self._config.kafka,
            self._bus.producer,
            window_s=self._config.gateway.recovery_window_s,
            client_id=f"{self._runtime.producer_name}/recover",
            replica=self._config.gateway.replica,
            sessions=self.sessions is not None,
        )
        if self.sessions is not None:
            if self._config.production.canary.enabled:
                await self._policy_read.wait()  # sessions are assigned from the rollout
            log.info("sessions recovered", open=self.sessions.restore(state))
        self.book.restore(state)
        self.recovery.resume()

    async def _sweep(self, admin: Admin) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self.book.sweep()
            self.responses.sweep()
            admin.sweep()

    async def _sweep_sessions(self, sessions: ProductionSessions) -> None:
        """End idle sessions (and those asked to end) within a few seconds of it."""
        production = self._config.production
        interval = min(5.0, production.idle_s / 4)
        roll_every = min(3600.0, production.retention_s / 10)
        rolled = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            if not self.recovery.paused:
                sessions.sweep()
            if time.monotonic() - rolled >= roll_every:  # acknowledged records leave the
                self._bus.producer.roll_spill()  # disk within the hour, not at 64 MB
                rolled = time.monotonic()

    async def _rebuild_versions(self) -> None:
        async def read() -> None:
            async for _, event, _ in read_to_end(
                self._config.kafka,
                events.POLICY,
                client_id=f"{self._runtime.producer_name}/versions",
            ):
                if isinstance(event, pb.PolicyLoaded):
                    self.versions.loaded(event)
                elif isinstance(event, pb.PolicyVersion):
                    self.rollout.announced(event)
                elif isinstance(event, pb.RolloutDecision):
                    self.rollout.decided(event)

        await retry(read, backoff=Backoff(0.5, 5.0), max_attempts=10**6)
        self._policy_read.set()
        log.info(
            "engine versions read",
            versions=dict(self.versions.snapshot()),
            rollout=describe(self.rollout.state),
        )

    async def _on_loaded(self, event: pb.PolicyLoaded, ctx: Context) -> None:
        if self.versions.loaded(event):
            log.info("engine version loaded", engine=event.engine, version=event.version)

    async def _on_version(self, event: pb.PolicyVersion, ctx: Context) -> None:
        self.rollout.announced(event)

    async def _on_decision(self, event: pb.RolloutDecision, ctx: Context) -> None:
        refused = self.rollout.decided(event)
        log.info(
            "rollout decision",
            decision_id=event.decision_id,
            actor=event.actor,
            refused=refused,
            rollout=describe(self.rollout.state),
        )

    async def _on_deleted(self, event: pb.SessionDeleted, ctx: Context) -> None:
        """An app deleted a production session: ended if open here, its stored responses
        dropped, and the spill log rolled so its records leave the disk once delivered."""
        assert self.sessions is not None
        await self.sessions.delete(event.group_id)
        stored = self.responses.forget((event.group_id, 1))
        self._bus.producer.roll_spill()
        log.info("session deleted", group_id=event.group_id, responses_dropped=stored)

    async def _on_command(self, command: pb.ControlCommand, ctx: Context) -> None:
        """With gateway.follow_control: pause or resume new calls."""
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
