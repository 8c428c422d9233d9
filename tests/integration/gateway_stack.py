"""A running stack for gateway tests: the real broker, engine and gateway, in this process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.episode_token import EpisodeClaims, mint
from harnessrl.production import ProductionSection
from harnessrl.runtime import Runtime
from harnessrl.services.gateway.config import GatewayConfig, GatewaySection
from harnessrl.services.gateway.service import GatewayService
from harnessrl.services.inference.config import InferenceConfig, InferenceSection
from harnessrl.services.inference.service import InferenceService
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, read_topic, topic_size

SECRET = "token-secret-for-tests-0123456789"
ADMIN = "admin-token-for-tests-0123456789abcdef"


@dataclass
class Stack:
    broker: EmbeddedBroker
    engine_url: str
    gateway_url: str
    gateway: GatewayService
    registry: CollectorRegistry
    inference: InferenceService

    @property
    def admin_url(self) -> str:
        """Where the admin API is: the harness port unless `admin_port` was set."""
        return f"http://127.0.0.1:{self.gateway.admin_port}"

    def fail_next_engine_step(self) -> None:
        """The engine's next step raises, as a device error would (then it is itself again)."""
        engine = self.inference.engine
        assert engine is not None
        model = engine.model

        def failing(*_: Any, **__: Any) -> Any:
            del model.forward  # the class's forward again from the next step on
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        model.forward = failing

    def token(
        self,
        episode: str = "ep-1",
        attempt: int = 1,
        group: str = "g-1",
        mode: str = "train",
        ttl: float = 300.0,
    ) -> str:
        claims = EpisodeClaims(episode, attempt, group, mode, time.time() + ttl)  # type: ignore[arg-type]
        return mint(claims, SECRET.encode())

    def openai_base(self, token: str) -> str:
        return f"{self.gateway_url}/e/{token}/v1"

    def anthropic_base(self, token: str) -> str:
        return f"{self.gateway_url}/e/{token}"

    async def calls(self, at_least: int = 0, timeout: float = 30.0) -> list[pb.ModelCall]:
        """Every ModelCall on hrl.calls (waiting until there are `at_least`)."""
        # read_to_end, not the broker's ListOffsets: Tansu's can lag a record behind.
        from harnessrl.bus.snapshot import read_to_end

        kafka = KafkaSettings(bootstrap_servers=self.broker.bootstrap)
        deadline = time.monotonic() + timeout
        while True:
            calls = [
                event
                async for kind, event, _ in read_to_end(kafka, events.CALLS, client_id="test")
                if kind == "model_call"
            ]
            if len(calls) >= at_least or time.monotonic() > deadline:
                return calls  # type: ignore[return-value]
            await asyncio.sleep(0.1)

    async def closed(self) -> list[pb.EpisodeClosed]:
        size = await topic_size(self.broker.bootstrap, events.CALLS)
        records = await read_topic(self.broker.bootstrap, events.CALLS, size) if size else []
        found = [events.decode(events.CALLS, r.value) for r in records]
        return [e.episode_closed for e in found if e.WhichOneof("event") == "episode_closed"]


@asynccontextmanager
async def running_stack(
    broker: EmbeddedBroker,
    tmp_path: Path,
    model: Path,
    tracer_provider: TracerProvider | None = None,
    engine_settings: dict[str, Any] | None = None,
    production: ProductionSection | None = None,
    **gateway: Any,
) -> AsyncIterator[Stack]:
    """The stack; `engine_settings` are extra InferenceSection fields, `gateway` extra
    GatewaySection fields, `production` the production apps."""
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3)
    inference = InferenceSection(
        model=model, port=0, follow_policy=False, **(engine_settings or {})
    )
    engine = InferenceService(
        InferenceConfig(inference=inference),
        Runtime("inference", "e-0", CollectorRegistry(), tracer_provider or TracerProvider()),
    )
    engine_task = asyncio.create_task(engine.run())
    await asyncio.wait_for(engine.ready.wait(), 60)
    engine_url = f"http://127.0.0.1:{engine.port}"
    registry = CollectorRegistry()
    gateway.setdefault("engines", [engine_url])
    gateway.setdefault("port", 0)
    section = GatewaySection(
        token_secret=SecretStr(SECRET),
        admin_token=SecretStr(ADMIN),
        **gateway,
    )
    config = GatewayConfig(
        instance="gw-0",
        kafka=kafka,
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "gw-spill"),
        gateway=section,
        production=production or ProductionSection(),
    )
    service = GatewayService(
        config, Runtime("gateway", "gw-0", registry, tracer_provider or TracerProvider())
    )
    gateway_task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield Stack(
            broker, engine_url, f"http://127.0.0.1:{service.port}", service, registry, engine
        )
    finally:
        await service.stop()
        await gateway_task
        await engine.stop()
        await engine_task
