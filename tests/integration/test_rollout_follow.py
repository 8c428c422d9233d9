"""A canary rollout on the real broker: the trainer's WeightSync server (real gRPC), its
PolicyVersion events and the judge's RolloutDecision on hrl.policy, and `harnessrl inference`
with production.canary.enabled. The engine serves the stable and the candidate at once,
reports both in PolicyLoaded.serving, answers each under its own model name, and, restarted
mid-canary, loads both again from hrl.policy's history."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.production import ProductionSection
from harnessrl.rollout import CanarySection
from harnessrl.runtime import Runtime
from harnessrl.services.inference.config import InferenceConfig, InferenceSection
from harnessrl.services.inference.service import InferenceService, load_model
from harnessrl.services.trainer.config import LoraSection
from harnessrl.services.trainer.lora import adapter_spec
from harnessrl.v1 import events_pb2 as pb
from harnessrl.weights import WeightSyncServer
from harnessrl.weights.settings import WeightSyncSettings
from tests.helpers import FAST_GROUP, eventually, read_topic, topic_size
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration

LORA = LoraSection(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))


def _adapter(seed: int) -> dict[str, torch.Tensor]:
    model, _ = load_model(InferenceSection(model=TINY, device="cpu"))
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rpartition(".")[2] in LORA.target_modules:
            prefix = f"base_model.model.{path}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(LORA.rank, module.in_features, generator=generator) * 0.05
            )
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(module.out_features, LORA.rank, generator=generator) * 0.05
            )
    return tensors


async def _publish(bootstrap: str, tmp_path: Path, *items: Any) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=bootstrap),
        ProducerSettings(spill_dir=tmp_path / "trainer-spill"),
        name="trainer/test",
    )
    await producer.start()
    for item in items:
        await producer.publish(item)
    await producer.stop()


async def _loaded_serving(bootstrap: str, engine: str, versions: set[int]) -> pb.PolicyLoaded:
    """Wait for a PolicyLoaded(ok) of `engine` serving exactly `versions`."""
    found: list[pb.PolicyLoaded] = []

    async def arrived() -> bool:
        size = await topic_size(bootstrap, events.POLICY)
        for record in await read_topic(bootstrap, events.POLICY, size):
            envelope = events.decode(events.POLICY, record.value)
            if envelope.WhichOneof("event") != "policy_loaded":
                continue
            loaded = envelope.policy_loaded
            served = {s.version for s in loaded.serving}
            if loaded.engine == engine and loaded.ok and served == versions:
                found.append(loaded)
        return bool(found)

    await eventually(arrived, timeout=60, interval=0.3)
    return found[-1]


async def _version_of(base: str, model: str) -> str:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{base}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
    response.raise_for_status()
    return response.headers["x-policy-version"]


async def test_an_engine_serves_stable_and_candidate_and_loads_both_again_after_a_restart(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    server = WeightSyncServer(WeightSyncSettings(port=0, keep_versions=4))
    await server.start()
    engine_name = "http://engine-canary"
    config = InferenceConfig(
        instance="engine-canary",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "spill"),
        inference=InferenceSection(model=TINY, port=0, advertise_url=engine_name),
        production=ProductionSection(canary=CanarySection(enabled=True)),
    )

    async def replica(check: Callable[[str], Awaitable[None]]) -> None:
        runtime = Runtime("inference", "engine-canary", CollectorRegistry(), TracerProvider())
        service = InferenceService(config, runtime)
        task = asyncio.create_task(service.run())
        try:
            await asyncio.wait_for(service.ready.wait(), 60)
            await check(f"http://127.0.0.1:{service.port}")
        finally:
            await service.stop()
            await task

    async def starts_the_candidate(base: str) -> None:
        await server.publish(1, 1, _adapter(seed=1), adapter=adapter_spec(LORA, TINY))
        address = server.address
        await _publish(
            broker.bootstrap,
            tmp_path,
            pb.PolicyVersion(version=0, step=0, weightsync_address=address),
            pb.PolicyVersion(version=1, step=1, weightsync_address=address, base=0),
            pb.RolloutDecision(
                decision_id="start-1",
                action=pb.ROLLOUT_ACTION_START,
                version=1,
                stable=0,
                actor="canary",
                share=0.5,
            ),
        )
        loaded = await _loaded_serving(broker.bootstrap, engine_name, {0, 1})
        assert {s.version: s.model for s in loaded.serving} == {
            0: "tiny-model@v0",
            1: "tiny-model@v1",
        }
        assert await _version_of(base, "tiny-model@v0") == "0"
        assert await _version_of(base, "tiny-model@v1") == "1"

    async def serves_both_again(base: str) -> None:
        async def both() -> bool:
            async with httpx.AsyncClient() as http:
                listed = (await http.get(f"{base}/v1/models")).json()["data"]
            return {m["id"] for m in listed} >= {"tiny-model@v0", "tiny-model@v1"}

        await eventually(both, timeout=60, interval=0.3)
        assert await _version_of(base, "tiny-model@v1") == "1"
        assert await _version_of(base, "tiny-model@v0") == "0"

    try:
        await replica(starts_the_candidate)
        await replica(serves_both_again)  # restarted: nothing new on hrl.policy
    finally:
        await server.stop()
