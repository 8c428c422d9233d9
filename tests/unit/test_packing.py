"""Packing a batch into micro-batches, and the loss weights that make the split exact."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from harnessrl.trust.packing import (
    SampleArrays,
    normalization_weights,
    pack,
    padding_fraction,
)
from harnessrl.v1 import events_pb2 as pb


def make_sample(
    sample_id: str,
    length: int,
    *,
    episode_id: str | None = None,
    prompt: int = 3,
    advantage: float = 1.0,
    seed: int = 0,
) -> SampleArrays:
    """A sample with `prompt` mask-False tokens, then mask True on every other token."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(length, dtype=np.bool_)
    mask[prompt::2] = True
    behavior = np.where(mask, -rng.random(length, dtype=np.float32), 0).astype(np.float32)
    return SampleArrays(
        sample_id=sample_id,
        episode_id=episode_id or sample_id.split("/", maxsplit=1)[0],
        token_ids=rng.integers(0, 2048, length).astype(np.int64),
        loss_mask=mask,
        behavior=behavior,
        advantage=advantage,
        temperature=1.0,
        policy_version_min=0,
    )


def skewed_samples(n: int = 40) -> list[SampleArrays]:
    """Mostly short samples and a few long ones (a typical agent batch)."""
    rng = random.Random(7)
    lengths = [rng.randint(8, 40) for _ in range(n - 4)] + [300, 280, 260, 500]
    return [make_sample(f"e{i % 13}/0/{i}", n_, seed=i) for i, n_ in enumerate(lengths)]


def test_pack_respects_the_token_budget_and_puts_an_oversized_sample_alone() -> None:
    samples = skewed_samples()
    weights = normalization_weights(samples, "token_mean", constant_tokens=1)
    batches = pack(samples, weights, micro_batch_tokens=400)
    for mb in batches:
        B, T = mb.input_ids.shape
        assert B * T <= 400 or B == 1
    assert [mb.input_ids.shape for mb in batches if mb.input_ids.shape[1] > 400] == [
        torch.Size([1, 500])
    ]


def test_pack_keeps_every_sample_exactly_once_with_its_arrays() -> None:
    samples = skewed_samples()
    weights = normalization_weights(samples, "episode_mean", constant_tokens=1)
    batches = pack(samples, weights, micro_batch_tokens=256)
    assert len(batches) > 3
    by_id = {s.sample_id: (s, w) for s, w in zip(samples, weights, strict=True)}
    seen = [sid for mb in batches for sid in mb.sample_ids]
    assert sorted(seen) == sorted(by_id)
    for mb in batches:
        for b, sid in enumerate(mb.sample_ids):
            s, w = by_id[sid]
            n = s.token_ids.size
            assert mb.input_ids[b, :n].tolist() == s.token_ids.tolist()
            assert mb.attention_mask[b].sum() == n
            assert torch.equal(mb.loss_mask[b, :n], torch.from_numpy(s.loss_mask))
            assert torch.equal(mb.behavior[b, :n], torch.from_numpy(s.behavior))
            assert torch.equal(mb.weights[b, :n], torch.from_numpy(w))
            assert torch.all(mb.advantages[b, :n] == np.float32(s.advantage))
            # padding: nothing attended, trained on or weighted
            assert not mb.loss_mask[b, n:].any() and not mb.weights[b, n:].any()
            assert not mb.attention_mask[b, n:].any() and not mb.advantages[b, n:].any()
        assert mb.tokens == int(mb.attention_mask.sum())


def test_pack_is_deterministic_whatever_the_input_order() -> None:
    samples = skewed_samples()
    shuffled = samples[:]
    random.Random(1).shuffle(shuffled)
    first = pack(
        samples,
        normalization_weights(samples, "token_mean", constant_tokens=1),
        micro_batch_tokens=300,
    )
    second = pack(
        shuffled,
        normalization_weights(shuffled, "token_mean", constant_tokens=1),
        micro_batch_tokens=300,
    )
    assert [mb.sample_ids for mb in first] == [mb.sample_ids for mb in second]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.weights, b.weights)


def test_pack_pads_far_less_than_padding_to_the_longest_sample() -> None:
    samples = skewed_samples()
    weights = normalization_weights(samples, "token_mean", constant_tokens=1)
    batches = pack(samples, weights, micro_batch_tokens=512)
    lengths = [s.token_ids.size for s in samples]
    naive = 1.0 - sum(lengths) / (len(lengths) * max(lengths))
    assert padding_fraction(batches) < naive / 3
    assert padding_fraction([]) == 0.0


@pytest.mark.parametrize("mode", ["token_mean", "episode_mean"])
def test_normalization_weights_sum_to_one_over_the_batch(mode: str) -> None:
    samples = skewed_samples()
    weights = normalization_weights(samples, mode, constant_tokens=1)  # type: ignore[arg-type]
    assert sum(float(w.sum(dtype=np.float64)) for w in weights) == pytest.approx(1.0, rel=1e-6)
    for s, w in zip(samples, weights, strict=True):
        assert w.dtype == np.float32 and w.shape == s.loss_mask.shape
        assert not w[~s.loss_mask].any() and (w[s.loss_mask] > 0).all()


def test_episode_mean_gives_each_episode_one_over_n_episodes() -> None:
    # episode "long": 10 segments; "one": one call; "merged": one segment, 10 completions
    samples = [make_sample(f"long/0/{k}", 30, seed=k) for k in range(10)]
    samples.append(make_sample("one/0/0", 12, seed=11))
    merged = make_sample("merged/0/0", 200, seed=12)
    samples.append(merged)
    weights = normalization_weights(samples, "episode_mean", constant_tokens=1)
    per_episode: dict[str, float] = {}
    for s, w in zip(samples, weights, strict=True):
        per_episode[s.episode_id] = per_episode.get(s.episode_id, 0.0) + float(w.sum())
    assert per_episode == pytest.approx({"long": 1 / 3, "one": 1 / 3, "merged": 1 / 3}, rel=1e-6)


def test_constant_weights_are_one_over_the_budget_on_mask_tokens() -> None:
    samples = skewed_samples()
    weights = normalization_weights(samples, "constant", constant_tokens=4096)
    for s, w in zip(samples, weights, strict=True):
        assert np.all(w == np.where(s.loss_mask, np.float32(1 / 4096), 0))


def test_token_mean_with_no_mask_tokens_weighs_nothing() -> None:
    sample = make_sample("a/0/0", 5, prompt=5)
    assert not normalization_weights([sample], "token_mean", constant_tokens=1)[0].any()


def test_from_proto_round_trips_through_the_wire() -> None:
    proto = pb.Sample(
        sample_id="ep/0/1",
        episode_id="ep",
        segment_index=1,
        token_ids=[5, 2043, 4_000_000_000, 7],
        loss_mask=[False, True, True, False],
        behavior_logprobs=[0.0, -0.125, -3.3, 0.0],
        advantage=-0.75,
        temperature=0.7,
        policy_version_min=12,
    )
    arrays = SampleArrays.from_proto(pb.Sample.FromString(proto.SerializeToString()))
    assert (arrays.sample_id, arrays.episode_id) == ("ep/0/1", "ep")
    assert arrays.token_ids.dtype == np.int64
    assert arrays.token_ids.tolist() == [5, 2043, 4_000_000_000, 7]
    assert arrays.loss_mask.tolist() == [False, True, True, False]
    assert arrays.behavior.dtype == np.float32
    assert np.array_equal(arrays.behavior, np.array([0.0, -0.125, -3.3, 0.0], np.float32))
    assert arrays.advantage == np.float32(-0.75) and arrays.temperature == np.float32(0.7)
    assert arrays.policy_version_min == 12


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_mask": [False, True]}, "loss_mask"),
        ({"loss_mask": [True, True, False]}, r"loss_mask\[0\]"),
        ({"token_ids": [], "loss_mask": [], "behavior_logprobs": []}, "empty"),
        ({"temperature": 0.0}, "temperature"),
    ],
)
def test_from_proto_rejects_malformed_samples(change: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {
        "sample_id": "ep/0/0",
        "token_ids": [1, 2, 3],
        "loss_mask": [False, True, False],
        "behavior_logprobs": [0.0, -1.0, 0.0],
        "temperature": 1.0,
    }
    with pytest.raises(ValueError, match=message):
        SampleArrays.from_proto(pb.Sample(**(fields | change)))  # type: ignore[arg-type]
