"""The engine's batching is exact: any mix of requests gives what each would get alone."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest
import torch
from prometheus_client import CollectorRegistry
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from harnessrl.services.inference.engine import Engine, EngineRequest
from harnessrl.services.inference.kv import RunningBatch, cache_argument, positions_from_mask
from harnessrl.services.inference.sampling import SamplingParams, generator_for, sample

VOCAB = 96


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
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


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return _model()


def _logits_alone(model: Qwen2ForCausalLM, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


def _greedy_alone(model: Qwen2ForCausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(torch.argmax(_logits_alone(model, ids))))
    return ids[len(prompt) :]


def _prefill(
    model: Qwen2ForCausalLM, prompts: list[list[int]]
) -> tuple[object, torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions_from_mask(mask),
            use_cache=True,
            **{cache_argument(model): DynamicCache(config=model.config)},
        )
    return out[cache_argument(model)], mask, out.logits[:, -1]


def test_running_batch_matches_sequences_decoded_alone(model: Qwen2ForCausalLM) -> None:
    seqs = {"a": [5, 9, 3, 7, 1], "b": [11, 2, 8, 4, 6, 13, 9, 2, 30], "c": [40, 41]}
    batch = RunningBatch()
    rows: list[str] = []

    def join(names: list[str]) -> None:
        cache, mask, logits = _prefill(model, [seqs[n] for n in names])
        for name, row_logits in zip(names, logits, strict=True):
            assert torch.allclose(row_logits, _logits_alone(model, seqs[name]), atol=1e-4)
            seqs[name].append(int(torch.argmax(row_logits)))
        batch.merge(cache, mask)
        rows.extend(names)

    def step() -> None:
        last = torch.tensor([[seqs[n][-1]] for n in rows])
        positions = batch.next_positions()
        mask = batch.extend_mask()
        with torch.inference_mode():
            out = model(
                input_ids=last,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{cache_argument(model): batch.cache},
            )
        batch.cache = out[cache_argument(model)]
        for name, row_logits in zip(rows, out.logits[:, -1], strict=True):
            expected = _logits_alone(model, seqs[name])
            assert torch.allclose(row_logits, expected, atol=1e-4), name
            seqs[name].append(int(torch.argmax(row_logits)))

    join(["a"])
    for _ in range(3):
        step()
    join(["b", "c"])  # two new sequences, longer and shorter, join a running batch
    for _ in range(3):
        step()
    batch.keep([1, 2])  # "a" finished; its padding columns are trimmed away
    rows.remove("a")
    for _ in range(3):
        step()
    assert batch.size == 2
    assert batch.mask.any(dim=0).all()  # no column is padding in every row


def _engine(model: Qwen2ForCausalLM, max_batch: int = 8) -> Engine:
    return Engine(
        model,
        eos_ids=frozenset(),
        pad_id=0,
        max_model_len=256,
        max_batch=max_batch,
        version=0,
        registry=CollectorRegistry(),
        decode=lambda ids: "",
    )


async def _collect(request: EngineRequest) -> list[int]:
    out = []
    while (token := await request.tokens.get()) is not None:
        out.append(token.token_id)
    return out


async def test_concurrent_requests_get_what_each_would_get_alone(model: Qwen2ForCausalLM) -> None:
    engine = _engine(model, max_batch=3)  # fewer rows than requests: some wait for a slot
    loop = asyncio.create_task(engine.run())
    prompts = [[3, 4, 5], [7] * 12, [1, 2], [9, 8, 7, 6, 5, 4, 3], [20, 21, 22, 23]]
    lengths = [6, 3, 9, 5, 7]
    requests = []
    for prompt, n in zip(prompts, lengths, strict=True):
        requests.append(engine.submit(prompt, SamplingParams(temperature=0, max_tokens=n)))
        await asyncio.sleep(0.003)  # arrive while others decode
    outputs = await asyncio.gather(*(_collect(r) for r in requests))
    await engine.stop()
    await loop
    for prompt, n, got in zip(prompts, lengths, outputs, strict=True):
        assert got == _greedy_alone(model, prompt, n)


async def test_seeded_sampling_does_not_depend_on_batch_company(model: Qwen2ForCausalLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    engine = _engine(model)
    loop = asyncio.create_task(engine.run())
    alone = await _collect(engine.submit([5, 6, 7], params))
    others = [
        engine.submit([9, 9, 9, 9], SamplingParams(temperature=1.0, max_tokens=20))
        for _ in range(3)
    ]
    again = await _collect(engine.submit([5, 6, 7], params))
    await asyncio.gather(*(_collect(r) for r in others))
    await engine.stop()
    await loop
    assert alone == again


async def test_swap_waits_for_running_requests_then_serves_the_new_weights(
    model: Qwen2ForCausalLM,
) -> None:
    engine = _engine(_model(seed=0))
    loop = asyncio.create_task(engine.run())
    running = engine.submit([3, 1, 4, 1, 5], SamplingParams(temperature=0, max_tokens=30))
    await running.admitted.wait()
    new_model = _model(seed=7)
    swap = asyncio.create_task(engine.swap(5, new_model.state_dict()))
    await asyncio.sleep(0.01)
    waiting = engine.submit([2, 7, 1, 8], SamplingParams(temperature=0, max_tokens=6))
    old_tokens, new_tokens = await asyncio.gather(_collect(running), _collect(waiting))
    await swap
    await engine.stop()
    await loop
    assert running.version == 0 and waiting.version == 5
    assert old_tokens == _greedy_alone(_model(seed=0), [3, 1, 4, 1, 5], 30)
    assert new_tokens == _greedy_alone(new_model, [2, 7, 1, 8], 6)


async def test_a_state_dict_that_does_not_fit_is_refused_and_old_weights_stay(
    model: Qwen2ForCausalLM,
) -> None:
    engine = _engine(_model(seed=0))
    loop = asyncio.create_task(engine.run())
    bad = dict(_model(seed=3).state_dict())
    bad["model.norm.weight"] = torch.ones(7)
    with pytest.raises(ValueError, match=r"model\.norm\.weight: shape \(7,\)"):
        await engine.swap(1, bad)
    tokens = await _collect(engine.submit([4, 4], SamplingParams(temperature=0, max_tokens=4)))
    await engine.stop()
    await loop
    assert engine.version == 0
    assert tokens == _greedy_alone(_model(seed=0), [4, 4], 4)


async def test_a_step_that_raises_fails_its_batch_and_the_engine_serves_on() -> None:
    model = _model(seed=0)
    forward = model.forward
    poison = 77

    @functools.wraps(forward)  # keeps the signature the engine reads its cache argument from
    def failing_forward(*args: object, **kwargs: object) -> object:
        ids = kwargs["input_ids"]
        assert isinstance(ids, torch.Tensor)
        if (ids == poison).any():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return forward(*args, **kwargs)

    model.forward = failing_forward  # type: ignore[method-assign]
    engine = _engine(model)
    failures = engine._metrics.step_failures
    loop = asyncio.create_task(engine.run())
    # Both in one step's prefill: the poisoned prompt takes its batch-mate down with it.
    bad = engine.submit([3, poison, 5], SamplingParams(temperature=0, max_tokens=5))
    mate = engine.submit([4, 4, 4], SamplingParams(temperature=0, max_tokens=5))
    assert await _collect(bad) == [] and await _collect(mate) == []
    assert bad.error == mate.error == "the engine failed while generating (RuntimeError)"
    # The next request gets a fresh batch and exactly what it would get alone.
    after = engine.submit([2, 7, 1, 8], SamplingParams(temperature=0, max_tokens=6))
    assert await _collect(after) == _greedy_alone(_model(seed=0), [2, 7, 1, 8], 6)
    assert after.error is None and failures._value.get() == 1
    await engine.stop()
    await loop


def test_processed_logprobs_are_of_the_distribution_sampled_from() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    gen = [generator_for(0)]
    # Temperature only: log softmax(logits / T).
    token, lp, _ = sample(logits, [SamplingParams(temperature=0.5)], gen)
    assert lp[0] == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[0, token[0]]), abs=1e-6)
    # Top-p: the nucleus renormalised; tokens outside it are never drawn.
    probs = torch.softmax(logits[0], -1)
    nucleus = probs[:2] / probs[:2].sum()  # p(top1) < 0.8 <= p(top1) + p(top2)
    for seed in range(50):
        token, lp, _ = sample(
            logits, [SamplingParams(temperature=1.0, top_p=0.8)], [generator_for(seed)]
        )
        assert token[0] in (0, 1)
        assert lp[0] == pytest.approx(math.log(float(nucleus[token[0]])), abs=1e-5)
    # Greedy: the argmax, with its plain log-prob.
    token, lp, top = sample(logits, [SamplingParams(temperature=0)], gen, top_k=2)
    assert token == [0]
    assert lp[0] == pytest.approx(float(torch.log_softmax(logits, -1)[0, 0]), abs=1e-6)
    assert [t for t, _ in top[0]] == [0, 1]


def test_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens, _, _ = sample(logits.expand(4000, -1), params, [generator_for(None)] * 4000)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03)
