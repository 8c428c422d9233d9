"""A canary rollout followed by the project's engine (services/inference/rollout_follower.py):
real WeightSync gRPC on loopback, the real engine on the tiny model, hrl.policy's events
folded in order. The engine serves exactly the rollout's versions (stable, candidate,
current), never a retired one; a restarted engine loads the stable and the candidate again;
a version that fails verification is reported ok=false and never served, one the trainer
does not hold is reported ok=false once and loaded when it is held again; a full-weight
engine serves the version its `follow` label names."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch
from prometheus_client import CollectorRegistry

from harnessrl.services.inference.config import Follow, InferenceSection
from harnessrl.services.inference.engine import Engine
from harnessrl.services.inference.follower import EngineLoader, weightsync_puller
from harnessrl.services.inference.rollout_follower import RolloutFollower
from harnessrl.services.inference.sampling import SamplingParams
from harnessrl.services.inference.service import load_model
from harnessrl.services.trainer.config import LoraSection
from harnessrl.services.trainer.lora import adapter_spec
from harnessrl.v1 import events_pb2 as pb
from harnessrl.v1 import weights_pb2_grpc as pb_grpc
from harnessrl.weights import WeightSyncServer
from harnessrl.weights.settings import WeightSyncSettings
from tests.model_helpers import TINY
from tests.weight_helpers import FaultInjector

pytestmark = pytest.mark.integration

LORA = LoraSection(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
NAME = "tiny-model"


@pytest.fixture(scope="module")
def base() -> Any:
    model, _ = load_model(InferenceSection(model=TINY, device="cpu"))
    return model


def _adapter(model: Any, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rpartition(".")[2] in LORA.target_modules:
            prefix = f"base_model.model.{path}"
            a = torch.randn(LORA.rank, module.in_features, generator=generator) * 0.05
            b = torch.randn(module.out_features, LORA.rank, generator=generator) * 0.05
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    return tensors


@pytest_asyncio.fixture
async def trainer() -> AsyncIterator[WeightSyncServer]:
    server = WeightSyncServer(WeightSyncSettings(port=0, keep_versions=10))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class Replica:
    """An engine on the tiny model, its loader and a rollout follower (one process's)."""

    def __init__(self, follow: Follow = "newest", keep_s: float = 0.0) -> None:
        model, tokenizer = load_model(InferenceSection(model=TINY, device="cpu"))
        self.engine = Engine(
            model,
            eos_ids=frozenset(),
            pad_id=tokenizer.pad_token_id or 0,
            max_model_len=256,
            max_batch=4,
            version=0,
            registry=CollectorRegistry(),
            decode=lambda ids: "",
        )
        loader = EngineLoader(
            self.engine, weightsync_puller(use_shm=False), base_model=TINY, served_name=NAME
        )
        self.now = 0.0
        self.follower = RolloutFollower(
            loader,
            engine_name="engine-a",
            follow=follow,
            registry=CollectorRegistry(),
            keep_s=keep_s,
            clock=lambda: self.now,
        )
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Replica:
        self.task = asyncio.create_task(self.engine.run())
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.engine.stop()
        if self.task is not None:
            await self.task

    async def feed(self, *events: pb.PolicyVersion | pb.RolloutDecision) -> list[pb.PolicyLoaded]:
        """Fold `events` one by one as the consumer does; every PolicyLoaded reported."""
        reports: list[pb.PolicyLoaded] = []
        for event in events:
            self.follower.fold(event)
            await self.follower.reconcile(reports.append)
        return reports


def _version(server: WeightSyncServer, version: int, base: int | None = None) -> pb.PolicyVersion:
    event = pb.PolicyVersion(version=version, step=version, weightsync_address=server.address)
    if base is not None:
        event.base = base
    return event


def _decision(action: int, version: int, stable: int, share: float = 0.0) -> pb.RolloutDecision:
    return pb.RolloutDecision(
        decision_id=f"{action}-{version}-{stable}",
        action=action,
        version=version,
        stable=stable,
        actor="canary",
        share=share,
    )


def _serving(report: pb.PolicyLoaded) -> dict[int, str]:
    return {s.version: s.model for s in report.serving}


async def _publish(server: WeightSyncServer, base: Any, *versions: int) -> None:
    spec = adapter_spec(LORA, TINY)
    for version in versions:
        await server.publish(version, version, _adapter(base, seed=version), adapter=spec)


async def test_an_engine_serves_exactly_the_rollouts_versions_through_start_rollback_promote(
    trainer: WeightSyncServer, base: Any
) -> None:
    await _publish(trainer, base, 1, 2)
    async with Replica() as replica:
        engine = replica.engine
        # 0 is the trainer's initial weights (the base) and stable; 1, then 2 is current.
        # The initial weights are reported at once: the gateways route stable's sessions.
        (initial,) = await replica.feed(_version(trainer, 0))
        assert (initial.version, _serving(initial)) == (0, {0: f"{NAME}@v0"})
        (loaded,) = await replica.feed(_version(trainer, 1))
        assert (loaded.version, loaded.ok, loaded.served_model) == (1, True, f"{NAME}@v1")
        assert _serving(loaded) == {0: f"{NAME}@v0", 1: f"{NAME}@v1"}
        loaded, unloaded = await replica.feed(_version(trainer, 2))
        assert engine.versions == (0, 2)  # 1 is neither stable, candidate nor current
        assert _serving(loaded) == {0: f"{NAME}@v0", 1: f"{NAME}@v1", 2: f"{NAME}@v2"}
        assert (unloaded.version, _serving(unloaded)) == (2, {0: f"{NAME}@v0", 2: f"{NAME}@v2"})

        (loaded,) = await replica.feed(_decision(pb.ROLLOUT_ACTION_START, 1, 0, share=0.2))
        assert engine.versions == (0, 1, 2) and loaded.version == 1 and loaded.ok

        # Rolled back: 1 and 2 (trained from 1) are retired; stable 0 alone is served.
        (unloaded,) = await replica.feed(_decision(pb.ROLLOUT_ACTION_ROLLBACK, 1, 0))
        assert engine.versions == (0,)
        assert (unloaded.version, unloaded.ok, _serving(unloaded)) == (0, True, {0: f"{NAME}@v0"})

        # The trainer rewound to 0 and goes on: 3 (base 0) is current; 2 never comes back.
        await _publish(trainer, base, 3)
        (loaded,) = await replica.feed(_version(trainer, 3, base=0))
        assert engine.versions == (0, 3) and loaded.version == 3

        reports = await replica.feed(
            _decision(pb.ROLLOUT_ACTION_START, 3, 0, share=0.2),
            _decision(pb.ROLLOUT_ACTION_PROMOTE, 3, 0),
        )
        assert engine.versions == (3,)
        assert [(r.version, _serving(r)) for r in reports] == [(3, {3: f"{NAME}@v3"})]
        request = engine.submit([5, 6, 7], SamplingParams(temperature=0, max_tokens=2))
        while await request.tokens.get() is not None:
            pass
        assert request.version == 3


async def test_a_version_the_rollout_stops_needing_stays_served_keep_s_for_its_sessions(
    trainer: WeightSyncServer, base: Any
) -> None:
    await _publish(trainer, base, 1)
    async with Replica(keep_s=600.0) as replica:
        engine = replica.engine
        await replica.feed(_version(trainer, 0), _version(trainer, 1))
        await replica.feed(_decision(pb.ROLLOUT_ACTION_START, 1, 0, share=0.5))
        assert engine.versions == (0, 1)
        # 0 is stable no more: its sessions may still be open, so it is kept a while.
        assert await replica.feed(_decision(pb.ROLLOUT_ACTION_PROMOTE, 1, 0)) == []
        assert engine.versions == (0, 1)
        replica.now = 599.0
        reports: list[pb.PolicyLoaded] = []
        await replica.follower.expire(reports.append)
        assert engine.versions == (0, 1) and reports == []
        replica.now = 601.0
        await replica.follower.expire(reports.append)
        assert engine.versions == (1,)
        assert [_serving(r) for r in reports] == [{1: f"{NAME}@v1"}]


async def test_a_restarted_engine_mid_canary_loads_the_stable_and_the_candidate_again(
    trainer: WeightSyncServer, base: Any
) -> None:
    await _publish(trainer, base, 1, 2, 3)
    history = [
        _version(trainer, 0),
        _version(trainer, 1),
        _decision(pb.ROLLOUT_ACTION_START, 1, 0, share=0.2),
        _decision(pb.ROLLOUT_ACTION_PROMOTE, 1, 0),
        _version(trainer, 2),
        _version(trainer, 3),
        _decision(pb.ROLLOUT_ACTION_START, 2, 1, share=0.2),
    ]
    async with Replica() as before:
        await before.feed(*history)
        assert before.engine.versions == (1, 2, 3)
    async with Replica() as after:  # a new process: folds the history, then reconciles once
        for event in history:
            after.follower.fold(event)
        reports: list[pb.PolicyLoaded] = []
        await after.follower.reconcile(reports.append)
        assert after.engine.versions == (1, 2, 3)
        assert [r.version for r in reports[:3]] == [3, 2, 1]  # loaded, current first
        assert sorted(_serving(reports[-1])) == [1, 2, 3]  # the initial 0 unloaded after
        assert await after.feed(*history) == []  # the consumer's replay changes nothing


async def test_a_version_that_fails_verification_or_is_gone_is_reported_and_never_served(
    trainer: WeightSyncServer, base: Any
) -> None:
    foreign = adapter_spec(LORA, TINY)
    foreign.base_checksum = foreign.base_checksum[:-4] + "0000"  # trained on another base
    await trainer.publish(1, 1, _adapter(base, seed=1), adapter=foreign)
    async with Replica() as replica:
        reports = await replica.feed(
            _version(trainer, 0),
            _version(trainer, 1),
            _decision(pb.ROLLOUT_ACTION_START, 1, 0, share=0.2),
        )
        assert [(r.version, r.ok) for r in reports] == [(0, True), (1, False)]
        assert "another" in reports[1].error and _serving(reports[1]) == {0: f"{NAME}@v0"}
        assert replica.engine.versions == (0,)
        assert await replica.feed(_version(trainer, 0)) == []  # never tried again

        (gone,) = await replica.feed(_version(trainer, 2))  # not published: NOT_FOUND
        assert (gone.version, gone.ok) == (2, False)
        assert gone.error.startswith("version gone: ")
        assert replica.engine.versions == (0,)
        assert await replica.feed(_version(trainer, 2)) == []  # tried again, reported once

        await _publish(trainer, base, 2)  # the trainer serves it (again)
        (loaded,) = await replica.feed(_version(trainer, 2))
        assert (loaded.version, loaded.ok) == (2, True)
        assert replica.engine.versions == (0, 2)


async def test_a_candidate_whose_adapter_fails_its_checksum_is_never_served(
    trainer: WeightSyncServer, base: Any
) -> None:
    """The candidate's bytes arrive corrupted (a flipped byte on the wire): the replica
    reports the checksum failure (the judge rolls the candidate back on it), keeps serving
    stable alone, and a request naming the candidate is refused."""
    await _publish(trainer, base, 1)
    proxy = grpc.aio.server()
    pb_grpc.add_WeightSyncServicer_to_server(FaultInjector(trainer.address, "flip"), proxy)
    corrupting = f"127.0.0.1:{proxy.add_insecure_port('127.0.0.1:0')}"
    await proxy.start()
    try:
        async with Replica() as replica:
            announced = pb.PolicyVersion(version=1, step=1, weightsync_address=corrupting)
            reports = await replica.feed(
                _version(trainer, 0), announced, _decision(pb.ROLLOUT_ACTION_START, 1, 0, 0.5)
            )
            refused = [r for r in reports if not r.ok]
            assert [r.version for r in refused] == [1]
            assert "checksum" in refused[0].error
            assert _serving(reports[-1]) == {0: f"{NAME}@v0"}
            assert replica.engine.versions == (0,)
            with pytest.raises(Exception, match="version 1 is not served"):
                replica.engine.submit([5, 6], SamplingParams(max_tokens=1), version=1)
    finally:
        await proxy.stop(0)


@pytest.mark.parametrize(("follow", "served"), [("stable", 0), ("candidate", 1), ("newest", 2)])
async def test_a_full_weight_engine_serves_the_version_its_follow_label_names(
    trainer: WeightSyncServer, base: Any, follow: Follow, served: int
) -> None:
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    for version in (1, 2):
        await trainer.publish(version, version, weights)
    async with Replica(follow) as replica:
        reports = await replica.feed(
            _version(trainer, 0),
            _version(trainer, 1),
            _version(trainer, 2),
            _decision(pb.ROLLOUT_ACTION_START, 1, 0, share=0.2),
        )
        assert replica.engine.versions == (served,)
        if served == 0:  # its initial weights: nothing loaded, what it serves reported
            assert [(r.version, _serving(r)) for r in reports] == [(0, {0: f"{NAME}@v0"})]
        else:
            assert (reports[-1].version, reports[-1].ok) == (served, True)
            assert _serving(reports[-1]) == {served: f"{NAME}@v{served}"}
