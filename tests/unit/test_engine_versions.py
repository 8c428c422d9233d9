"""Several LoRA versions served at once by the project's engine (a canary rollout): each batch
row gets its own version's adapter (lora_hooks.LoraRows), a request asks for a version, and
adding or removing one never disturbs requests for the others."""

from __future__ import annotations

import asyncio

import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import Qwen2Config, Qwen2ForCausalLM

from harnessrl.services.inference.engine import Engine, EngineRequest, VersionNotServed
from harnessrl.services.inference.lora_hooks import LoraOverlay, LoraRows
from harnessrl.services.inference.sampling import SamplingParams
from harnessrl.v1 import weights_pb2 as pb

VOCAB = 96
TARGETS = ("q_proj", "v_proj", "down_proj")
SPEC = pb.LoraAdapter(rank=4, alpha=8.0, target_modules=TARGETS)


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


def _tensors(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A trained-looking adapter (B not zero) for every target module, published names."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rpartition(".")[2] in TARGETS:
            prefix = f"base_model.model.{path}"
            a = torch.randn(SPEC.rank, module.in_features, generator=generator) * 0.3
            b = torch.randn(module.out_features, SPEC.rank, generator=generator) * 0.3
            tensors[f"{prefix}.lora_A.weight"] = a
            tensors[f"{prefix}.lora_B.weight"] = b
    return tensors


def _overlay(model: torch.nn.Module, seed: int) -> LoraOverlay:
    return LoraOverlay.build(model, SPEC, _tensors(model, seed))


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_rows_all_routed_to_one_version_compute_exactly_that_overlay(
    model: Qwen2ForCausalLM,
) -> None:
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(1))
    overlay = _overlay(model, seed=1)
    overlay.attach(model)
    alone = _logits(model, ids)
    overlay.detach()
    rows = LoraRows(model)
    rows.hook(overlay)
    rows.route([overlay] * 3, ids.device)
    routed = _logits(model, ids)
    rows.clear()
    assert torch.equal(routed, alone)  # single-version results unchanged, bit for bit


def test_a_mixed_batch_gives_each_row_its_own_versions_output(model: Qwen2ForCausalLM) -> None:
    ids = torch.randint(0, VOCAB, (3, 11), generator=torch.Generator().manual_seed(2))
    one, two = _overlay(model, seed=1), _overlay(model, seed=2)
    expected = []
    for row, overlay in enumerate((one, two, None)):
        if overlay is not None:
            overlay.attach(model)
        expected.append(_logits(model, ids[row : row + 1])[0])
        if overlay is not None:
            overlay.detach()
    rows = LoraRows(model)
    rows.hook(one)
    rows.hook(two)
    rows.route([one, two, None], ids.device)
    mixed = _logits(model, ids)
    rows.clear()
    for row in range(3):
        assert torch.allclose(mixed[row], expected[row], atol=1e-5), row
    assert not torch.allclose(expected[0], expected[1], atol=1e-3)  # the versions differ
    assert not torch.allclose(expected[0], expected[2], atol=1e-3)
    assert torch.equal(_logits(model, ids), _logits(model, ids))  # hooks gone: the base


def _engine(model: Qwen2ForCausalLM) -> Engine:
    return Engine(
        model,
        eos_ids=frozenset(),
        pad_id=0,
        max_model_len=256,
        max_batch=8,
        version=0,
        registry=CollectorRegistry(),
        decode=lambda ids: "",
    )


async def _collect(request: EngineRequest) -> tuple[list[int], list[float]]:
    ids, logprobs = [], []
    while (token := await request.tokens.get()) is not None:
        ids.append(token.token_id)
        logprobs.append(token.logprob)
    return ids, logprobs


def _params(max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=7)


async def test_requests_for_three_versions_in_one_batch_get_what_each_gets_alone(
    model: Qwen2ForCausalLM,
) -> None:
    engine = _engine(model)
    loop = asyncio.create_task(engine.run())
    try:
        await engine.add(1, _tensors(model, seed=1), SPEC)
        await engine.add(2, _tensors(model, seed=2), SPEC)
        assert engine.versions == (0, 1, 2)
        prompt = [5, 17, 30, 42, 9]
        alone = {v: await _collect(engine.submit(prompt, _params(), version=v)) for v in (0, 1, 2)}
        together = [engine.submit(prompt, _params(), version=v) for v in (0, 1, 2)]
        outputs = await asyncio.gather(*(_collect(r) for r in together))
    finally:
        await engine.stop()
        await loop
    assert [r.version for r in together] == [0, 1, 2]
    for version, (ids, logprobs) in zip((0, 1, 2), outputs, strict=True):
        assert ids == alone[version][0]
        assert logprobs == pytest.approx(alone[version][1], abs=1e-4)
    assert alone[0][1] != pytest.approx(alone[1][1], abs=1e-3)  # versions are not the base


async def test_a_version_served_alone_samples_as_after_a_swap(model: Qwen2ForCausalLM) -> None:
    """Adding a version beside the base gives its requests exactly what a swap to it gives."""
    prompt = [3, 4, 5, 6]
    results = []
    for beside in (False, True):
        engine = _engine(model)
        loop = asyncio.create_task(engine.run())
        try:
            if beside:
                await engine.add(1, _tensors(model, seed=1), SPEC)
            else:
                await engine.swap(1, _tensors(model, seed=1), SPEC)
            results.append(await _collect(engine.submit(prompt, _params(), version=1)))
        finally:
            await engine.stop()
            await loop
    assert results[0] == results[1]


async def test_removing_a_version_refuses_new_requests_and_lets_its_running_ones_finish(
    model: Qwen2ForCausalLM,
) -> None:
    engine = _engine(model)
    loop = asyncio.create_task(engine.run())
    try:
        await engine.add(1, _tensors(model, seed=1), SPEC)
        long = engine.submit([1, 2, 3], _params(max_tokens=60), version=1)
        first = await long.tokens.get()
        assert first is not None
        removal = asyncio.create_task(engine.remove(1))
        await asyncio.sleep(0)
        assert engine.versions == (0,)
        with pytest.raises(VersionNotServed, match="version 1 is not served here"):
            engine.submit([1, 2, 3], _params(), version=1)
        other = engine.submit([4, 5], _params(max_tokens=4))  # the default: now version 0
        other_ids, _ = await _collect(other)
        assert other.version == 0 and len(other_ids) == 4
        assert not removal.done()  # the long request still runs on version 1
        rest, _ = await _collect(long)
        await asyncio.wait_for(removal, 10)
    finally:
        await engine.stop()
        await loop
    assert long.version == 1 and long.finish_reason == "length" and len(rest) == 59
    assert engine.versions == (0,)


async def test_a_request_naming_no_version_gets_the_newest_served(model: Qwen2ForCausalLM) -> None:
    engine = _engine(model)
    loop = asyncio.create_task(engine.run())
    try:
        await engine.add(3, _tensors(model, seed=3), SPEC)
        request = engine.submit([1, 2], _params(max_tokens=2))
        await _collect(request)
        with pytest.raises(ValueError, match="only version served"):
            await engine.remove(0)
            await engine.remove(3)
    finally:
        await engine.stop()
        await loop
    assert request.version == 3 and engine.version == 3


async def test_adding_and_removing_versions_does_not_disturb_requests_in_flight(
    model: Qwen2ForCausalLM,
) -> None:
    engine = _engine(model)
    loop = asyncio.create_task(engine.run())
    prompt = [11, 12, 13]
    try:
        await engine.add(2, _tensors(model, seed=2), SPEC)
        alone = await _collect(engine.submit(prompt, _params(max_tokens=30), version=0))
        running = engine.submit(prompt, _params(max_tokens=30), version=0)
        first = await running.tokens.get()
        assert first is not None
        await engine.add(1, _tensors(model, seed=1), SPEC)  # joins between two steps
        await engine.remove(2)  # no request holds it: gone at once
        assert engine.versions == (0, 1)
        ids, logprobs = await _collect(running)
    finally:
        await engine.stop()
        await loop
    assert [first.token_id, *ids] == alone[0]
    assert [first.logprob, *logprobs] == pytest.approx(alone[1], abs=1e-5)
