"""A LoRA version from the trainer to the project's engine over real WeightSync gRPC on
loopback: the engine applies the adapter on its base and samples with the log-probs the
trainer's PEFT model computes; a version that fails verification, or that is for another
base, leaves the previous adapter serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch
from prometheus_client import CollectorRegistry

from harnessrl.services.inference.config import InferenceSection
from harnessrl.services.inference.engine import Engine
from harnessrl.services.inference.follower import EngineLoader, weightsync_puller
from harnessrl.services.inference.sampling import SamplingParams
from harnessrl.services.inference.service import load_model
from harnessrl.services.trainer.config import LoraSection, TrainerSection
from harnessrl.services.trainer.distributed import World
from harnessrl.services.trainer.lora import adapter_spec
from harnessrl.services.trainer.policy import Policy
from harnessrl.v1 import weights_pb2 as pb
from harnessrl.v1 import weights_pb2_grpc as pb_grpc
from harnessrl.weights import WeightSyncError, WeightSyncServer
from harnessrl.weights.settings import WeightSyncSettings
from tests.model_helpers import TINY
from tests.weight_helpers import FaultInjector

pytestmark = pytest.mark.integration

LORA = LoraSection(rank=8, alpha=16.0)
PROMPT = [5, 17, 300, 42, 9, 1000, 7]


@pytest.fixture(scope="module")
def policy() -> Policy:
    """The trainer's LoRA policy, its adapters moved as training would move them."""
    policy = Policy.load(
        TrainerSection(model=TINY, device="cpu", dtype="float32", lora=LORA), World()
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    policy.model.eval()
    return policy


@pytest_asyncio.fixture
async def trainer(policy: Policy) -> AsyncIterator[WeightSyncServer]:
    server = WeightSyncServer(WeightSyncSettings(port=0))
    await server.start()
    await server.publish(1, 1, policy.state_dict(), adapter=adapter_spec(LORA, TINY))
    try:
        yield server
    finally:
        await server.stop()


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[Engine]:
    model, tokenizer = load_model(InferenceSection(model=TINY, device="cpu"))
    engine = Engine(
        model,
        eos_ids=frozenset(),
        pad_id=tokenizer.pad_token_id or 0,
        max_model_len=512,
        max_batch=4,
        version=0,
        registry=CollectorRegistry(),
        decode=lambda ids: "",
    )
    loop = asyncio.create_task(engine.run())
    try:
        yield engine
    finally:
        await engine.stop()
        await loop


async def _sample(engine: Engine) -> tuple[list[int], list[float]]:
    """(tokens, log-probs) of one seeded temperature-1 request."""
    request = engine.submit(PROMPT, SamplingParams(temperature=1.0, max_tokens=12, seed=3))
    ids, logprobs = [], []
    while (token := await request.tokens.get()) is not None:
        ids.append(token.token_id)
        logprobs.append(token.logprob)
    return ids, logprobs


def _trainer_logprobs(model: Any, completion: list[int]) -> list[float]:
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)[0]
    start = len(PROMPT)
    return [float(logp[start + i - 1, t]) for i, t in enumerate(completion)]


async def test_an_adapter_pulled_over_grpc_samples_with_the_trainers_log_probs(
    policy: Policy, trainer: WeightSyncServer, engine: Engine
) -> None:
    loader = EngineLoader(engine, weightsync_puller(use_shm=False), base_model=TINY)
    _, base_logprobs = await _sample(engine)
    await loader.load(trainer.address, 1)
    assert engine.version == 1 and loader.served_model == ""
    ids, logprobs = await _sample(engine)
    expected = _trainer_logprobs(policy.model, ids)
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) <= 1e-5
    with policy.model.disable_adapter():  # the base: what the engine served before
        base = _trainer_logprobs(policy.model, ids)
    assert max(abs(a - b) for a, b in zip(logprobs, base, strict=True)) > 1e-3
    assert base_logprobs != logprobs


async def test_a_corrupted_or_foreign_adapter_leaves_the_previous_one_serving(
    policy: Policy, trainer: WeightSyncServer, engine: Engine
) -> None:
    loader = EngineLoader(engine, weightsync_puller(use_shm=False), base_model=TINY)
    await loader.load(trainer.address, 1)
    served = await _sample(engine)
    foreign = adapter_spec(LORA, TINY)
    foreign.base_checksum = "xxh3_64:0123456789abcdef"
    await trainer.publish(2, 2, policy.state_dict(), adapter=foreign)
    with pytest.raises(WeightSyncError, match="the adapter is for base model"):
        await loader.load(trainer.address, 2)
    await trainer.publish(3, 3, policy.state_dict(), adapter=adapter_spec(LORA, TINY))
    proxy = grpc.aio.server()
    pb_grpc.add_WeightSyncServicer_to_server(FaultInjector(trainer.address, "flip"), proxy)
    corrupting = f"127.0.0.1:{proxy.add_insecure_port('127.0.0.1:0')}"
    await proxy.start()
    try:
        with pytest.raises(WeightSyncError, match="checksum mismatch"):
            await loader.load(corrupting, 3)
    finally:
        await proxy.stop(0)
    assert engine.version == 1
    assert await _sample(engine) == served


async def test_an_adapter_is_refused_once_full_weights_replaced_the_base(
    policy: Policy, trainer: WeightSyncServer, engine: Engine
) -> None:
    loader = EngineLoader(engine, weightsync_puller(use_shm=False), base_model=TINY)
    full = {k: v.clone() for k, v in engine.model.state_dict().items()}
    await trainer.publish(2, 2, full)
    await loader.load(trainer.address, 2)
    await trainer.publish(3, 3, policy.state_dict(), adapter=adapter_spec(LORA, TINY))
    with pytest.raises(WeightSyncError, match="serves the full weights of an earlier version"):
        await loader.load(trainer.address, 3)
    assert engine.version == 2
    manifest = await _manifest(trainer, 3)
    assert manifest.adapter.rank == 8 and manifest.total_bytes < sum(
        t.numel() * t.element_size() for t in full.values()
    )


async def _manifest(server: WeightSyncServer, version: int) -> pb.WeightManifest:
    from harnessrl.weights import WeightSyncClient

    async with WeightSyncClient(server.address) as client:
        return await client.manifest(version)
