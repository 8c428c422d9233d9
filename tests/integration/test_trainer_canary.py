"""The trainer under a canary rollout, on the real broker with the trainer service on the
tiny model: a ROLLBACK on hrl.policy rewinds the weights to the stable version, the next
version says it was trained from it, samples of the retired versions are dropped as
rolled_back, and the stable version stays servable, also after a restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.production import ProductionSection
from harnessrl.rollout import CanarySection
from harnessrl.runtime import Runtime
from harnessrl.services.trainer import journal
from harnessrl.services.trainer.config import LoraSection, TrainerConfig, TrainerSection
from harnessrl.services.trainer.service import TrainerService
from harnessrl.v1 import events_pb2 as pb
from harnessrl.weights import WeightSyncClient
from tests.helpers import FAST_GROUP, eventually
from tests.integration.test_trainer import PROMPTS, policy_events
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration


@asynccontextmanager
async def canary_trainer(
    broker: EmbeddedBroker, tmp_path: Path, lora: LoraSection | None = None
) -> AsyncIterator[TrainerService]:
    config = TrainerConfig(
        instance="trainer-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "trainer-spill"),
        trainer=TrainerSection(
            port=0,
            model=TINY,
            device="cpu",
            checkpoint_dir=tmp_path / "checkpoints",
            weightsync={"port": 0, "keep_versions": 1},
            batch_groups=1,
            checkpoint_every=1,
            max_staleness=1,  # counted along the lineage: stable is 0 steps behind a rewind
            lr=1e-3,
            lora=lora,
        ),
        production=ProductionSection(canary=CanarySection(enabled=True)),
    )
    registry = CollectorRegistry()
    service = TrainerService(config, Runtime("trainer", "trainer-0", registry, TracerProvider()))
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield service
    finally:
        await service.stop()
        await task


async def _publish(broker: EmbeddedBroker, tmp_path: Path, *events: Any) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "test-spill"),
        name="canary/test",
    )
    await producer.start()
    for event in events:
        await producer.publish(event)
    await producer.stop()


def _group(group_id: str, version: int) -> pb.GroupSamples:
    prompt = PROMPTS[0]
    sample = pb.Sample(
        sample_id=f"{group_id}/0/0",
        episode_id=f"{group_id}/0",
        token_ids=[*prompt, 101, 102, 103],
        loss_mask=[False] * len(prompt) + [True] * 3,
        behavior_logprobs=[0.0] * len(prompt) + [-7.0] * 3,
        advantage=1.0,
        temperature=1.0,
        policy_version_min=version,
        policy_version_max=version,
    )
    return pb.GroupSamples(group_id=group_id, task_id=group_id, estimator="grpo", samples=[sample])


def _decision(action: Any, version: int, share: float = 0.0) -> pb.RolloutDecision:
    return pb.RolloutDecision(
        decision_id=f"test-{version}-{action}",
        action=action,
        version=version,
        stable=0,
        actor="canary",
        reason="test",
        share=share,
    )


async def _versions(broker: EmbeddedBroker) -> dict[int, pb.PolicyVersion]:
    return {e.version: e for _, e in await policy_events(broker) if isinstance(e, pb.PolicyVersion)}


async def _announced(broker: EmbeddedBroker, version: int) -> pb.PolicyVersion:
    async def there() -> bool:
        return version in await _versions(broker)

    await eventually(there, timeout=90)
    return (await _versions(broker))[version]


async def _fetch(address: str, version: int) -> dict[str, torch.Tensor]:
    client = WeightSyncClient(address)
    try:
        return (await client.fetch(version)).state_dict
    finally:
        await client.close()


@pytest.mark.parametrize("lora", [None, LoraSection(rank=4, alpha=8.0)], ids=["full", "lora"])
async def test_a_rollback_rewinds_to_stable_and_the_next_version_is_trained_from_it(
    broker: EmbeddedBroker, tmp_path: Path, lora: LoraSection | None
) -> None:
    async with canary_trainer(broker, tmp_path, lora) as service:
        v0 = await _announced(broker, 0)
        assert not v0.HasField("base")  # the initial weights
        address = v0.weightsync_address
        stable = await _fetch(address, 0)
        await _publish(broker, tmp_path, _group("g1", 0))
        assert (await _announced(broker, 1)).base == 0
        await _publish(broker, tmp_path, _decision(pb.ROLLOUT_ACTION_START, 1, share=0.5))
        await _publish(broker, tmp_path, _group("g2", 1))
        assert (await _announced(broker, 2)).base == 1

        await _publish(broker, tmp_path, _decision(pb.ROLLOUT_ACTION_ROLLBACK, 1))
        await eventually(lambda: service.metrics.rewinds._value.get() == 1, timeout=60)
        # Produced by the rolled-back candidate: dropped; by stable: trained from stable.
        await _publish(broker, tmp_path, _group("g3", 1), _group("g4", 0))
        v3 = await _announced(broker, 3)
        assert v3.base == 0
        assert dict(v3.tokens_dropped) == {"rolled_back": 3}
        # Stable is still served (keep_versions=1 would have evicted it long ago).
        assert all(torch.equal(t, stable[n]) for n, t in (await _fetch(address, 0)).items())

    records = journal.read(tmp_path / "checkpoints" / journal.JOURNAL)
    assert [(s.version, s.samples) for s in journal.lineage(records)] == [(3, ("g4/0/0",))]
    assert [s.version for s in journal.trained(records)] == [1, 2, 3]

    # Restarted: stable is served again from the archive, and nothing is rewound twice.
    async with canary_trainer(broker, tmp_path, lora) as service:
        restarted = (await _versions(broker))[3].weightsync_address
        assert all(torch.equal(t, stable[n]) for n, t in (await _fetch(restarted, 0)).items())
        assert service.metrics.rewinds._value.get() == 0


async def test_a_rollback_while_the_trainer_is_down_rewinds_it_at_start(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with canary_trainer(broker, tmp_path):
        await _announced(broker, 0)
        await _publish(broker, tmp_path, _group("g1", 0))
        await _announced(broker, 1)
        await _publish(broker, tmp_path, _decision(pb.ROLLOUT_ACTION_START, 1, share=0.5))
        await _publish(broker, tmp_path, _group("g2", 1))
        await _announced(broker, 2)
    await _publish(broker, tmp_path, _decision(pb.ROLLOUT_ACTION_ROLLBACK, 1))
    async with canary_trainer(broker, tmp_path) as service:
        assert service.metrics.rewinds._value.get() == 1  # before it served anything
        assert max(await _versions(broker)) == 2  # the retired weights were not re-announced
        await _publish(broker, tmp_path, _group("g3", 0))
        assert (await _announced(broker, 3)).base == 0
    records = journal.read(tmp_path / "checkpoints" / journal.JOURNAL)
    assert [s.version for s in journal.lineage(records)] == [3]
