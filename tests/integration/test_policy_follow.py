"""A weight push end to end: trainer-side WeightSync, PolicyVersion on the real broker, the
engine pulls, swaps, reports PolicyLoaded, and serves the new weights (or refuses bad ones)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from safetensors.torch import load_file

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.runtime import Runtime
from harnessrl.services.inference.config import InferenceConfig, InferenceSection
from harnessrl.services.inference.service import InferenceService
from harnessrl.v1 import events_pb2 as pb
from harnessrl.v1 import weights_pb2_grpc as pb_grpc
from harnessrl.weights import WeightSyncServer
from harnessrl.weights.settings import WeightSyncSettings
from tests.helpers import FAST_GROUP, eventually, read_topic, topic_size
from tests.model_helpers import TINY, overfit
from tests.weight_helpers import FaultInjector

pytestmark = pytest.mark.integration

QUESTION = [{"role": "user", "content": "What is 6 * 7?"}]
REPLY = "The answer is 42."


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The state dict of a tiny model that answers QUESTION with REPLY."""
    model = overfit(tmp_path_factory.mktemp("trained"), [(QUESTION, None, REPLY)])
    return load_file(model / "model.safetensors")


@pytest_asyncio.fixture
async def engine(broker: EmbeddedBroker, tmp_path: Path) -> AsyncIterator[tuple[str, Any]]:
    config = InferenceConfig(
        instance="engine-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "spill"),
        inference=InferenceSection(model=TINY, port=0),
    )
    registry = CollectorRegistry()
    service = InferenceService(config, Runtime("inference", "engine-0", registry, TracerProvider()))
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield f"http://127.0.0.1:{service.port}", registry
    finally:
        await service.stop()
        await task


async def _announce(kafka_bootstrap: str, tmp_path: Path, version: int, address: str) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=kafka_bootstrap),
        ProducerSettings(spill_dir=tmp_path / f"trainer-spill-{version}"),
        name="trainer/test",
    )
    await producer.start()
    await producer.publish(
        pb.PolicyVersion(version=version, step=version, weightsync_address=address)
    )
    await producer.stop()


async def _loaded(bootstrap: str, version: int) -> pb.PolicyLoaded:
    """Wait for the engine's PolicyLoaded for `version` on hrl.policy."""
    found: list[pb.PolicyLoaded] = []

    async def arrived() -> bool:
        size = await topic_size(bootstrap, events.POLICY)
        for record in await read_topic(bootstrap, events.POLICY, size):
            envelope = events.decode(events.POLICY, record.value)
            if (
                envelope.WhichOneof("event") == "policy_loaded"
                and envelope.policy_loaded.version == version
            ):
                found.append(envelope.policy_loaded)
        return bool(found)

    await eventually(arrived, timeout=60, interval=0.3)
    return found[0]


async def _ask(base: str) -> tuple[str, str]:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny-model", "messages": QUESTION, "temperature": 0, "max_tokens": 24},
        )
    response.raise_for_status()
    return response.headers["x-policy-version"], response.json()["choices"][0]["message"]["content"]


async def test_a_pushed_version_is_pulled_through_shared_memory_and_served(
    broker: EmbeddedBroker,
    engine: tuple[str, Any],
    trained: dict[str, Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    base, _ = engine
    before = await _ask(base)
    assert before[0] == "0" and before[1] != REPLY
    server = WeightSyncServer(WeightSyncSettings(port=0, shared_memory=True))
    await server.start()
    try:
        with caplog.at_level(logging.INFO):
            await server.publish(1, 1, trained)
            await _announce(broker.bootstrap, tmp_path, 1, server.address)
            loaded = await _loaded(broker.bootstrap, 1)
        assert loaded.ok and loaded.engine == base and loaded.load_ms > 0
        assert await _ask(base) == ("1", REPLY)  # the next responses: new version, new weights
        fetched = [r for r in caplog.records if r.getMessage() == "weights version fetched"]
        assert fetched[0].hrl_fields["transport"] == "shm"  # type: ignore[attr-defined]
    finally:
        await server.stop()


async def test_a_corrupted_push_is_refused_and_the_old_version_keeps_serving(
    broker: EmbeddedBroker,
    engine: tuple[str, Any],
    trained: dict[str, Any],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    base, registry = engine
    server = WeightSyncServer(WeightSyncSettings(port=0))
    await server.start()
    proxy = grpc.aio.server()
    pb_grpc.add_WeightSyncServicer_to_server(FaultInjector(server.address, "flip"), proxy)
    proxy_address = f"127.0.0.1:{proxy.add_insecure_port('127.0.0.1:0')}"
    await proxy.start()
    try:
        await server.publish(1, 1, trained)
        await _announce(broker.bootstrap, tmp_path, 1, server.address)
        assert (await _loaded(broker.bootstrap, 1)).ok
        other = {k: v.clone() * 0.5 for k, v in trained.items()}
        await server.publish(2, 2, other)
        with caplog.at_level(logging.ERROR):
            await _announce(broker.bootstrap, tmp_path, 2, proxy_address)  # bytes corrupted
            refused = await _loaded(broker.bootstrap, 2)
        assert not refused.ok
        assert "WeightSyncError" in refused.error and "checksum" in refused.error
        assert await _ask(base) == ("1", REPLY)  # still the previous version, untouched
        failures = registry.get_sample_value(
            "harnessrl_engine_weight_loads_total", {"outcome": "failed"}
        )
        assert failures == 1
        assert any(
            r.getMessage() == "policy version refused; still serving the previous one"
            for r in caplog.records
        )
    finally:
        await proxy.stop(0)
        await server.stop()


async def test_a_restarted_replica_serves_the_newest_version_at_once(
    broker: EmbeddedBroker, trained: dict[str, Any], tmp_path: Path
) -> None:
    """Its weights went with the process; its consumer group's offsets did not: without
    catching up it would serve its initial weights until the next announcement."""
    server = WeightSyncServer(WeightSyncSettings(port=0, shared_memory=False))
    await server.start()
    config = InferenceConfig(
        instance="engine-again",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "spill-again"),
        inference=InferenceSection(model=TINY, port=0),
    )

    async def replica(check: Any) -> None:
        runtime = Runtime("inference", "engine-again", CollectorRegistry(), TracerProvider())
        service = InferenceService(config, runtime)
        task = asyncio.create_task(service.run())
        try:
            await asyncio.wait_for(service.ready.wait(), 60)
            await check(f"http://127.0.0.1:{service.port}")
        finally:
            await service.stop()
            await task

    async def loads_version_2(base: str) -> None:
        await server.publish(2, 2, trained)
        await _announce(broker.bootstrap, tmp_path, 2, server.address)
        await _loaded(broker.bootstrap, 2)
        assert await _ask(base) == ("2", REPLY)

    async def serves_version_2(base: str) -> None:
        async def caught_up() -> bool:
            return (await _ask(base))[0] == "2"

        await eventually(caught_up, timeout=60, interval=0.3)
        assert await _ask(base) == ("2", REPLY)

    try:
        await replica(loads_version_2)
        await replica(serves_version_2)  # restarted: nothing new announced
    finally:
        await server.stop()
