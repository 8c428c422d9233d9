"""`harnessrl inference`: the engine, its HTTP API, and (optionally) the policy follower."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

from harnessrl import events
from harnessrl.bus.snapshot import read_to_end
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, retry
from harnessrl.runtime import Runtime
from harnessrl.service_bus import Handlers, ServiceBus, Subscription
from harnessrl.services.inference.api import create_app
from harnessrl.services.inference.codec import TextCodec
from harnessrl.services.inference.config import InferenceConfig, InferenceSection
from harnessrl.services.inference.engine import Engine
from harnessrl.services.inference.follower import EngineLoader, PolicyFollower, weightsync_puller
from harnessrl.services.inference.rollout_follower import RolloutFollower
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


def load_model(section: InferenceSection) -> tuple[Any, Any]:
    """(model, tokenizer) from the model directory, on the configured device and dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = section.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = section.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    tokenizer = AutoTokenizer.from_pretrained(section.model)
    model: Any = AutoModelForCausalLM.from_pretrained(section.model, dtype=getattr(torch, dtype))
    return model.to(device).eval(), tokenizer


def eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every id that ends a turn: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


def context_length(model: Any, tokenizer: Any, section: InferenceSection) -> int:
    if section.max_model_len is not None:
        return section.max_model_len
    limits = [
        getattr(model.config, "max_position_embeddings", None),
        getattr(tokenizer, "model_max_length", None),
    ]
    return min(int(x) for x in limits if isinstance(x, int) and 0 < x < 10**7)


class _Server:
    """uvicorn without its own signal handlers: the service runtime owns the signals."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        self.server = Quiet(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_config=None,
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=10,
            )
        )

    @property
    def port(self) -> int:
        servers = getattr(self.server, "servers", None) or []
        for server in servers:
            for sock in server.sockets:
                port: int = sock.getsockname()[1]
                return port
        return 0

    async def wait_started(self) -> None:
        while not self.server.started:  # noqa: ASYNC110 - uvicorn exposes only a flag
            await asyncio.sleep(0.01)


class InferenceService:
    """The engine behind an OpenAI-compatible API; see services/inference/api.py."""

    def __init__(self, config: InferenceConfig, runtime: Runtime) -> None:
        self._config = config
        self._runtime = runtime
        self._stopping = asyncio.Event()
        self._engine_task: asyncio.Task[None] | None = None
        self._server: _Server | None = None
        self.engine: Engine | None = None
        self.ready = asyncio.Event()
        self._follow_task: asyncio.Task[None] | None = None
        self._bus = ServiceBus(config, runtime)

    @property
    def port(self) -> int:
        return self._server.port if self._server is not None else 0

    async def run(self) -> None:
        section = self._config.inference
        model, tokenizer = await asyncio.to_thread(load_model, section)
        codec = TextCodec(tokenizer)
        engine = Engine(
            model,
            eos_ids=eos_ids(model, tokenizer),
            pad_id=tokenizer.pad_token_id or 0,
            max_model_len=context_length(model, tokenizer, section),
            max_batch=section.max_batch,
            version=section.initial_version,
            registry=self._runtime.registry,
            decode=codec.decode,
        )
        self.engine = engine
        names = [section.served_model_name or section.model.resolve().name, str(section.model)]
        app = create_app(
            engine,
            codec,
            served_names=names,
            default_max_tokens=section.default_max_tokens,
            registry=self._runtime.registry,
            health=self.health,
            list_versions=self._config.production.canary.enabled,
        )
        self._server = _Server(app, section.host, section.port)
        async with AsyncExitStack() as stack:
            self._engine_task = asyncio.create_task(engine.run(), name="engine")
            stack.push_async_callback(self._stop_engine, engine)
            serving = asyncio.create_task(self._server.server.serve(), name="http")
            await self._server.wait_started()
            log.info(
                "inference engine serving",
                model=names[0],
                port=self.port,
                device=str(engine.device),
                max_model_len=engine.max_model_len,
                version=engine.version,
            )
            if section.follow_policy:
                await self._follow(engine, names[0], stack)
            self.ready.set()
            stopped = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            self._server.server.should_exit = True  # finish open requests, then close
            await serving

    async def _follow(self, engine: Engine, served_name: str, stack: AsyncExitStack) -> None:
        """Start following hrl.policy in the background (the engine serves without Kafka)."""
        section = self._config.inference
        await self._bus.start(stack)
        name = section.advertise_url or f"http://{section.host}:{self.port}"
        loader = EngineLoader(
            engine,
            weightsync_puller(section.use_shared_memory),
            base_model=section.model,
            served_name=served_name,
        )
        group = f"harnessrl.inference.{self._config.instance}"
        if self._config.production.canary.enabled:
            canary = self._config.production.canary
            rollout = RolloutFollower(
                loader,
                engine_name=name,
                follow=section.follow,
                registry=self._runtime.registry,
                keep_s=canary.keep_s,
            )

            async def rebuild() -> None:
                await self._bus.create_topics([events.POLICY])
                await self._rebuild_rollout(rollout)

            handlers: Handlers = {
                pb.PolicyVersion: rollout.on_version,
                pb.RolloutDecision: rollout.on_decision,
            }
            subscription = Subscription(group, handlers)
            self._follow_task = self._bus.consume(stack, subscription, before=rebuild).task
            expiry = asyncio.create_task(self._expire(rollout, canary.keep_s), name="expire")
            stack.callback(expiry.cancel)
            return
        follower = PolicyFollower(loader, engine_name=name, registry=self._runtime.registry)

        async def before() -> None:  # in the background: the engine serves without Kafka
            await self._bus.create_topics([events.POLICY])
            await self._catch_up(follower)

        # Every replica must see every version: a consumer group of its own.
        subscription = Subscription(group, {pb.PolicyVersion: follower.on_version})
        self._follow_task = self._bus.consume(stack, subscription, before=before).task

    async def _catch_up(self, follower: PolicyFollower) -> None:
        """Load the newest announced version before following: a replica started (or
        restarted) after it was announced would otherwise serve its initial weights until
        the next one. The consumer then skips what this already loaded."""
        newest: pb.PolicyVersion | None = None

        async def scan() -> None:
            nonlocal newest
            async for _, event, _ in read_to_end(
                self._config.kafka,
                events.POLICY,
                client_id=f"{self._runtime.producer_name}/catch-up",
            ):
                if isinstance(event, pb.PolicyVersion) and (
                    newest is None or event.version > newest.version
                ):
                    newest = event

        try:
            await retry(scan, backoff=Backoff(0.5, 5.0), max_attempts=10**6)
            if newest is not None:
                announced = newest

                async def load() -> pb.PolicyLoaded | None:
                    return await follower.apply(announced)

                loaded = await retry(load, backoff=Backoff(0.5, 5.0), max_attempts=20)
                if loaded is not None:
                    await self._bus.producer.publish(loaded)
        except Exception as err:  # the consumer still brings the next version
            log.warning("could not catch up with the newest policy version", error=repr(err))

    async def _expire(self, rollout: RolloutFollower, keep_s: float) -> None:
        """Unload, now and then, the versions kept past `keep_s` after the rollout stopped
        needing them (between events nothing else would)."""
        while True:
            await asyncio.sleep(min(60.0, max(1.0, keep_s / 4)))
            try:
                await rollout.expire(self._publish_loaded)
            except Exception as err:  # an engine or trainer away: the next tick retries
                log.warning("could not unload expired versions", error=repr(err))

    def _publish_loaded(self, loaded: pb.PolicyLoaded) -> None:
        self._bus.producer.publish(loaded).add_done_callback(_log_unpublished)

    async def _rebuild_rollout(self, rollout: RolloutFollower) -> None:
        """Fold hrl.policy's history, then serve what the rollout needs: a replica started
        (or restarted) mid-canary loads the stable and the candidate again at once. The
        consumer then replays nothing twice (the fold is idempotent)."""

        async def scan() -> None:
            async for _, event, _ in read_to_end(
                self._config.kafka,
                events.POLICY,
                client_id=f"{self._runtime.producer_name}/rollout",
            ):
                if isinstance(event, pb.PolicyVersion | pb.RolloutDecision):
                    rollout.fold(event)

        async def reconcile() -> None:
            await rollout.reconcile(self._publish_loaded)

        await retry(scan, backoff=Backoff(0.5, 5.0), max_attempts=10**6)
        try:
            await retry(reconcile, backoff=Backoff(0.5, 5.0), max_attempts=20)
        except Exception as err:  # the consumer's next event reconciles again
            log.warning("could not load the rollout's versions", error=repr(err))

    async def _stop_engine(self, engine: Engine) -> None:
        await engine.stop()
        if self._engine_task is not None:
            await asyncio.gather(self._engine_task, return_exceptions=True)

    async def stop(self) -> None:
        self._stopping.set()

    def health(self) -> dict[str, bool]:
        engine_alive = self._engine_task is not None and not self._engine_task.done()
        checks = {"model_loaded": self.engine is not None, "engine_loop": engine_alive}
        if self._config.inference.follow_policy:
            checks["policy_follower"] = (
                self._follow_task is not None and not self._follow_task.done()
            )
            checks["producer"] = self._bus.healthy
        return checks


def _log_unpublished(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("PolicyLoaded not published", error=repr(future.exception()))
