"""`harnessrl vllm-sync` on the real broker with a real WeightSync server, driving a stand-in
for `vllm serve` (tests/vllm_standin.py), because vLLM cannot run here: the stand-in runs
the real worker extension on stand-in workers behind vLLM's dev-mode HTTP endpoints, and
for LoRA versions answers vLLM's runtime LoRA endpoints, reading each adapter directory
from disk as vLLM's loader would (it applies no adapter: nothing generates here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
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
from harnessrl.services.inference.config import VllmSyncConfig, VllmSyncSection
from harnessrl.services.inference.vllm_server import VllmUnusable
from harnessrl.services.inference.vllm_sync import VllmSyncService
from harnessrl.v1 import events_pb2 as pb
from harnessrl.v1 import weights_pb2 as pb_weights
from harnessrl.v1 import weights_pb2_grpc as pb_grpc
from harnessrl.weights import WeightSyncServer
from harnessrl.weights.settings import WeightSyncSettings
from tests.helpers import FAST_GROUP, eventually, read_topic, topic_size
from tests.vllm_standin import StandInLoraVllm, StandInVllmServer
from tests.weight_helpers import FaultInjector, same_bits, state_dict

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def weightsync() -> AsyncIterator[WeightSyncServer]:
    server = WeightSyncServer(WeightSyncSettings(port=0))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture
async def vllm() -> AsyncIterator[StandInVllmServer]:
    server = StandInVllmServer(workers=2)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@asynccontextmanager
async def running_sync(
    broker: EmbeddedBroker,
    tmp_path: Path,
    url: str,
    *,
    instance: str = "vllm-sync-0",
    canary: bool = False,
    **section: Any,
) -> AsyncIterator[tuple[VllmSyncService, CollectorRegistry]]:
    """A VllmSyncService for the vLLM at `url`, checking it every 0.3 s (`section`: more
    vllm_sync settings; `canary`: production.canary.enabled, versions unloaded as soon as the
    rollout stops needing them: keep_s 0)."""
    config = VllmSyncConfig(
        instance=instance,
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP, retry_backoff_ms=50),
        producer=ProducerSettings(spill_dir=tmp_path / f"spill-{instance}"),
        vllm_sync=VllmSyncSection(port=0, vllm_url=url, check_interval_s=0.3, **section),
        production=ProductionSection(canary=CanarySection(enabled=canary, keep_s=0.0)),
    )
    registry = CollectorRegistry()
    service = VllmSyncService(config, Runtime("vllm-sync", instance, registry, TracerProvider()))
    task = asyncio.create_task(service.run())
    try:
        yield service, registry
    finally:
        await service.stop()
        await asyncio.wait_for(task, 30)


async def _announce(broker: EmbeddedBroker, tmp_path: Path, version: int, address: str) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / f"trainer-spill-{version}"),
        name="trainer/test",
    )
    await producer.start()
    await producer.publish(
        pb.PolicyVersion(version=version, step=version, weightsync_address=address)
    )
    await producer.stop()


async def _loaded(broker: EmbeddedBroker) -> list[pb.PolicyLoaded]:
    """Every PolicyLoaded on hrl.policy, in order."""
    size = await topic_size(broker.bootstrap, events.POLICY)
    records = await read_topic(broker.bootstrap, events.POLICY, size) if size else []
    found = [events.decode(events.POLICY, r.value) for r in records]
    return [e.policy_loaded for e in found if e.WhichOneof("event") == "policy_loaded"]


async def _wait_loaded(broker: EmbeddedBroker, version: int, count: int = 1) -> pb.PolicyLoaded:
    """The `count`-th PolicyLoaded of `version`, once it is on hrl.policy."""

    async def arrived() -> bool:
        return len([e for e in await _loaded(broker) if e.version == version]) >= count

    await eventually(arrived, timeout=60, interval=0.2)
    return [e for e in await _loaded(broker) if e.version == version][count - 1]


async def test_a_policy_version_is_swapped_into_vllm_and_reported_under_its_url(
    broker: EmbeddedBroker,
    weightsync: WeightSyncServer,
    vllm: StandInVllmServer,
    tmp_path: Path,
) -> None:
    await weightsync.publish(1, 1, state_dict(seed=1))
    async with running_sync(broker, tmp_path, vllm.url) as (service, _):
        await asyncio.wait_for(service.ready.wait(), 30)
        assert service.health() == {"producer": True, "vllm_reachable": True, "following": True}
        await _announce(broker, tmp_path, 1, weightsync.address)
        loaded = await _wait_loaded(broker, 1)
        assert loaded.ok and loaded.engine == vllm.url and loaded.load_ms > 0
        for worker in (0, 1):
            assert same_bits(vllm.model_state(worker), state_dict(seed=1))
        swap = ["pause:keep", "harnessrl_stage", "harnessrl_commit", "resume"]
        assert [c for c in vllm.engine.calls if c != "harnessrl_version"] == swap
        assert not vllm.engine.paused


async def test_a_refused_version_is_reported_and_the_old_weights_keep_serving(
    broker: EmbeddedBroker,
    weightsync: WeightSyncServer,
    vllm: StandInVllmServer,
    tmp_path: Path,
) -> None:
    await weightsync.publish(1, 1, state_dict(seed=1))
    await weightsync.publish(2, 2, state_dict(seed=2))
    proxy = grpc.aio.server()
    pb_grpc.add_WeightSyncServicer_to_server(FaultInjector(weightsync.address, "flip"), proxy)
    corrupting = f"127.0.0.1:{proxy.add_insecure_port('127.0.0.1:0')}"
    await proxy.start()
    try:
        async with running_sync(broker, tmp_path, vllm.url) as (service, registry):
            await asyncio.wait_for(service.ready.wait(), 30)
            await _announce(broker, tmp_path, 1, weightsync.address)
            assert (await _wait_loaded(broker, 1)).ok
            await _announce(broker, tmp_path, 2, corrupting)  # bytes corrupted on the way
            refused = await _wait_loaded(broker, 2)
            assert not refused.ok and refused.engine == vllm.url
            assert "checksum mismatch" in refused.error
            assert same_bits(vllm.model_state(), state_dict(seed=1))
            assert not vllm.engine.paused
            await _announce(broker, tmp_path, 7, weightsync.address)  # never held: gone
            await eventually(
                lambda: (
                    registry.get_sample_value(
                        "harnessrl_engine_weight_loads_total", {"outcome": "skipped"}
                    )
                    == 1
                )
            )
            await asyncio.sleep(1.0)  # several checks: neither 2 nor 7 is tried again
            assert [(e.version, e.ok) for e in await _loaded(broker)] == [(1, True), (2, False)]
            assert (
                registry.get_sample_value(
                    "harnessrl_engine_weight_loads_total", {"outcome": "failed"}
                )
                == 1
            )
            assert same_bits(vllm.model_state(), state_dict(seed=1))
    finally:
        await proxy.stop(0)


async def test_a_restarted_vllm_gets_the_newest_version_again(
    broker: EmbeddedBroker,
    weightsync: WeightSyncServer,
    vllm: StandInVllmServer,
    tmp_path: Path,
) -> None:
    await weightsync.publish(1, 1, state_dict(seed=1))
    await weightsync.publish(2, 2, state_dict(seed=2))
    async with running_sync(broker, tmp_path, vllm.url) as (service, _):
        await asyncio.wait_for(service.ready.wait(), 30)
        await _announce(broker, tmp_path, 1, weightsync.address)
        await _announce(broker, tmp_path, 2, weightsync.address)
        await _wait_loaded(broker, 2)
        await vllm.stop()  # vLLM goes away...
        await eventually(lambda: not service.health()["vllm_reachable"], timeout=10)
        vllm.restart()  # ...and comes back on the weights it started with
        await vllm.start()
        again = await _wait_loaded(broker, 2, count=2)
        assert again.ok and again.engine == vllm.url
        assert service.health()["vllm_reachable"]
        for worker in (0, 1):
            assert same_bits(vllm.model_state(worker), state_dict(seed=2))


async def test_a_restarted_sync_reads_back_the_newest_version_and_waits_for_vllm(
    broker: EmbeddedBroker,
    weightsync: WeightSyncServer,
    vllm: StandInVllmServer,
    tmp_path: Path,
) -> None:
    await weightsync.publish(1, 1, state_dict(seed=1))
    async with running_sync(broker, tmp_path, vllm.url) as (service, _):
        await asyncio.wait_for(service.ready.wait(), 30)
        await _announce(broker, tmp_path, 1, weightsync.address)
        await _wait_loaded(broker, 1)
    # While vllm-sync is down, vLLM restarts, and is not up yet when vllm-sync starts again:
    # its group's committed offset is past version 1, so only the topic says what to load.
    await vllm.stop()
    vllm.restart()
    async with running_sync(broker, tmp_path, vllm.url) as (service, _):
        await asyncio.sleep(1.0)
        assert not service.ready.is_set()
        assert not service.health()["vllm_reachable"]
        await vllm.start()
        await asyncio.wait_for(service.ready.wait(), 30)
        assert (await _wait_loaded(broker, 1, count=2)).ok
        assert same_bits(vllm.model_state(), state_dict(seed=1))


async def test_a_vllm_without_the_dev_mode_endpoints_stops_it_with_the_reason(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    vllm = StandInVllmServer(dev_mode=False)
    await vllm.start()
    config = VllmSyncConfig(
        instance="vllm-sync-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        producer=ProducerSettings(spill_dir=tmp_path / "spill"),
        vllm_sync=VllmSyncSection(port=0, vllm_url=vllm.url),
    )
    service = VllmSyncService(
        config, Runtime("vllm-sync", "vllm-sync-0", CollectorRegistry(), TracerProvider())
    )
    try:
        with pytest.raises(VllmUnusable, match=r"answered 404 .*VLLM_SERVER_DEV_MODE=1"):
            await asyncio.wait_for(service.run(), 30)
    finally:
        await vllm.stop()


# -- vLLM serving each version as a LoRA adapter (vllm_sync.lora_name) -----------------------

ADAPTED = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"]


def _adapter(seed: int, rank: int = 4) -> tuple[dict[str, torch.Tensor], pb_weights.LoraAdapter]:
    """A version's adapter pairs (PEFT's names) and their manifest description."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for module in ADAPTED:
        out = 48 if module.endswith("down_proj") else 32
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(
            rank, 32, generator=generator
        )
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(
            out, rank, generator=generator
        )
    spec = pb_weights.LoraAdapter(
        rank=rank, alpha=2.0 * rank, target_modules=["down_proj", "q_proj"], base_model="base"
    )
    return tensors, spec


async def _publish_adapter(server: WeightSyncServer, version: int, rank: int = 4) -> None:
    tensors, spec = _adapter(seed=version, rank=rank)
    await server.publish(version, version, tensors, adapter=spec)


@pytest_asyncio.fixture
async def trainer() -> AsyncIterator[WeightSyncServer]:
    """A WeightSync server that keeps every version these tests publish."""
    server = WeightSyncServer(WeightSyncSettings(port=0, keep_versions=8))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture
async def lora_vllm() -> AsyncIterator[StandInLoraVllm]:
    server = StandInLoraVllm(max_lora_rank=8)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def test_adapter_versions_load_under_versioned_names_and_the_oldest_are_unloaded(
    broker: EmbeddedBroker,
    trainer: WeightSyncServer,
    lora_vllm: StandInLoraVllm,
    tmp_path: Path,
) -> None:
    adapters = tmp_path / "adapters"
    for version in (1, 2, 3):
        await _publish_adapter(trainer, version)
    async with running_sync(
        broker, tmp_path, lora_vllm.url, lora_name="policy", adapter_dir=adapters
    ) as (service, _):
        await asyncio.wait_for(service.ready.wait(), 30)
        assert service.health() == {"producer": True, "vllm_reachable": True, "following": True}
        await _announce(broker, tmp_path, 1, trainer.address)
        loaded = await _wait_loaded(broker, 1)
        assert loaded.ok and loaded.engine == lora_vllm.url
        assert loaded.served_model == "policy-v1"  # what the gateway asks vLLM for
        config, tensors = lora_vllm.adapters["policy-v1"]
        assert same_bits(tensors, dict(sorted(_adapter(seed=1)[0].items())))
        assert (config["r"], config["lora_alpha"]) == (4, 8)
        assert lora_vllm.paths["policy-v1"] == str((adapters / "policy-v1").resolve())
        for version in (2, 3):
            await _announce(broker, tmp_path, version, trainer.address)
            assert (await _wait_loaded(broker, version)).served_model == f"policy-v{version}"
        assert sorted(lora_vllm.adapters) == ["policy-v2", "policy-v3"]  # keep_adapters: 2
        assert sorted(p.name for p in adapters.iterdir()) == ["policy-v2", "policy-v3"]
        assert service.vllm.version == 3
    assert not any("collective_rpc" in r or "pause" in r for r in lora_vllm.requests)


async def test_a_refused_adapter_is_reported_and_the_previous_one_keeps_serving(
    broker: EmbeddedBroker,
    trainer: WeightSyncServer,
    lora_vllm: StandInLoraVllm,
    tmp_path: Path,
) -> None:
    adapters = tmp_path / "adapters"
    await _publish_adapter(trainer, 1)
    await _publish_adapter(trainer, 2)
    await _publish_adapter(trainer, 3, rank=16)  # above vLLM's --max-lora-rank 8
    await trainer.publish(4, 4, state_dict(seed=4))  # full weights
    proxy = grpc.aio.server()
    pb_grpc.add_WeightSyncServicer_to_server(FaultInjector(trainer.address, "flip"), proxy)
    corrupting = f"127.0.0.1:{proxy.add_insecure_port('127.0.0.1:0')}"
    await proxy.start()
    try:
        async with running_sync(
            broker, tmp_path, lora_vllm.url, lora_name="policy", adapter_dir=adapters
        ) as (service, _):
            await asyncio.wait_for(service.ready.wait(), 30)
            await _announce(broker, tmp_path, 1, trainer.address)
            assert (await _wait_loaded(broker, 1)).ok
            await _announce(broker, tmp_path, 2, corrupting)  # bytes corrupted on the way
            await _announce(broker, tmp_path, 3, trainer.address)
            await _announce(broker, tmp_path, 4, trainer.address)
            refused = [await _wait_loaded(broker, v) for v in (2, 3, 4)]
            assert [e.ok for e in refused] == [False, False, False]
            assert "checksum mismatch" in refused[0].error
            assert "greater than max_lora_rank 8" in refused[1].error
            assert "full weights" in refused[2].error
            assert all(not e.served_model for e in refused)
            assert list(lora_vllm.adapters) == ["policy-v1"]
            assert [p.name for p in adapters.iterdir()] == ["policy-v1"]
            assert (service.vllm.version, service.vllm.served_model) == (1, "policy-v1")
    finally:
        await proxy.stop(0)


async def test_a_restarted_vllm_gets_the_newest_adapter_again(
    broker: EmbeddedBroker,
    trainer: WeightSyncServer,
    lora_vllm: StandInLoraVllm,
    tmp_path: Path,
) -> None:
    await _publish_adapter(trainer, 1)
    async with running_sync(
        broker, tmp_path, lora_vllm.url, lora_name="policy", adapter_dir=tmp_path / "a"
    ) as (service, _):
        await asyncio.wait_for(service.ready.wait(), 30)
        await _announce(broker, tmp_path, 1, trainer.address)
        await _wait_loaded(broker, 1)
        lora_vllm.restart()  # no adapter loaded any more: it serves its base
        again = await _wait_loaded(broker, 1, count=2)
        assert again.ok and again.served_model == "policy-v1"
        assert list(lora_vllm.adapters) == ["policy-v1"]


async def test_a_vllm_without_runtime_lora_updating_refuses_naming_the_setting(
    broker: EmbeddedBroker, trainer: WeightSyncServer, tmp_path: Path
) -> None:
    vllm = StandInLoraVllm(runtime_updating=False)
    await vllm.start()
    await _publish_adapter(trainer, 1)
    try:
        async with running_sync(
            broker, tmp_path, vllm.url, lora_name="policy", adapter_dir=tmp_path / "a"
        ) as (service, _):
            await asyncio.wait_for(service.ready.wait(), 30)
            await _announce(broker, tmp_path, 1, trainer.address)
            refused = await _wait_loaded(broker, 1)
            assert not refused.ok
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in refused.error
            assert not (tmp_path / "a" / "policy-v1").exists()
    finally:
        await vllm.stop()


# -- a canary rollout (production.canary.enabled) ----------------------------------------------


async def _policy(broker: EmbeddedBroker, tmp_path: Path, *items: Any) -> None:
    """Publish trainer and judge events on hrl.policy, in order."""
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "judge-spill"),
        name="judge/test",
    )
    await producer.start()
    for item in items:
        await producer.publish(item)
    await producer.stop()


def _announced(address: str, version: int, base: int | None = None) -> pb.PolicyVersion:
    event = pb.PolicyVersion(version=version, step=version, weightsync_address=address)
    if base is not None:
        event.base = base
    return event


def _decided(action: int, version: int, stable: int) -> pb.RolloutDecision:
    return pb.RolloutDecision(
        decision_id=f"{action}-{version}-{stable}",
        action=action,
        version=version,
        stable=stable,
        actor="canary",
        share=0.25,
    )


async def _serving(broker: EmbeddedBroker, versions: dict[int, str]) -> None:
    """Wait until the last PolicyLoaded is ok and its `serving` is exactly `versions`."""

    async def arrived() -> bool:
        loaded = await _loaded(broker)
        last = loaded[-1] if loaded else None
        return (
            last is not None and last.ok and {s.version: s.model for s in last.serving} == versions
        )

    await eventually(arrived, timeout=60, interval=0.2)


async def test_during_a_canary_the_stable_and_candidate_adapters_are_never_unloaded(
    broker: EmbeddedBroker,
    trainer: WeightSyncServer,
    lora_vllm: StandInLoraVllm,
    tmp_path: Path,
) -> None:
    for version in (1, 2, 3):
        await _publish_adapter(trainer, version)
    address = trainer.address
    async with running_sync(
        broker,
        tmp_path,
        lora_vllm.url,
        canary=True,
        lora_name="policy",
        adapter_dir=tmp_path / "a",
        keep_adapters=1,
    ) as (service, _):
        await asyncio.wait_for(service.ready.wait(), 30)
        await _policy(
            broker,
            tmp_path,
            _announced(address, 0),
            _announced(address, 1),
            _decided(pb.ROLLOUT_ACTION_START, 1, 0),
            _decided(pb.ROLLOUT_ACTION_PROMOTE, 1, 0),
            _announced(address, 2),
            _announced(address, 3),
            _decided(pb.ROLLOUT_ACTION_START, 2, 1),
        )
        # stable 1, candidate 2, current 3: all three, though keep_adapters is 1 (2 was
        # unloaded when 3 was announced, and loaded again as the candidate)
        await _serving(broker, {1: "policy-v1", 2: "policy-v2", 3: "policy-v3"})
        assert sorted(lora_vllm.adapters) == ["policy-v1", "policy-v2", "policy-v3"]
        assert [sorted(s.version for s in e.serving) for e in await _loaded(broker)] == [
            [0],  # the initial weights, reported before anything is loaded
            [0, 1],
            [1],
            [1, 2],
            [1, 2, 3],
            [1, 3],
            [1, 2, 3],
        ]

        lora_vllm.restart()  # its adapters are gone: the next check loads them all again
        await eventually(
            lambda: sorted(lora_vllm.adapters) == ["policy-v1", "policy-v2", "policy-v3"],
            timeout=60,
            interval=0.2,
        )

        # rolled back: 2 and 3 (trained from 2) are retired and unloaded
        await _policy(broker, tmp_path, _decided(pb.ROLLOUT_ACTION_ROLLBACK, 2, 1))
        await _serving(broker, {1: "policy-v1"})
        assert list(lora_vllm.adapters) == ["policy-v1"]


async def test_during_a_canary_a_full_weight_vllm_serves_its_follow_label(
    broker: EmbeddedBroker,
    weightsync: WeightSyncServer,
    vllm: StandInVllmServer,
    tmp_path: Path,
) -> None:
    for version in (1, 2):
        await weightsync.publish(version, version, state_dict(seed=version))
    address = weightsync.address
    async with running_sync(broker, tmp_path, vllm.url, canary=True, follow="candidate") as (
        service,
        _,
    ):
        await asyncio.wait_for(service.ready.wait(), 30)
        await _policy(
            broker,
            tmp_path,
            _announced(address, 0),
            _announced(address, 1),
            _announced(address, 2),
        )
        await _serving(broker, {2: ""})  # no candidate: the current version
        await _policy(broker, tmp_path, _decided(pb.ROLLOUT_ACTION_START, 1, 0))
        await _serving(broker, {1: ""})  # the candidate, older than current
        assert [e.version for e in await _loaded(broker)] == [0, 1, 2, 1]
        assert await service.vllm.check() == 1  # what vLLM's workers serve
