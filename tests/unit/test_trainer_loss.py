"""The policy-gradient loss: its gradient against a plainly written reference, the weights of
each normalization, exactness of micro-batching on the real tiny model, and log-probs."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from harnessrl.trust import loss as loss_module
from harnessrl.trust.loss import (
    LossSettings,
    LossStats,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    token_logprobs,
)
from harnessrl.trust.packing import (
    MicroBatch,
    Normalization,
    SampleArrays,
    normalization_weights,
    pack,
)
from tests.model_helpers import TINY

MODES: list[Normalization] = ["token_mean", "episode_mean", "constant"]


def make_sample(
    sample_id: str,
    mask: Sequence[bool],
    *,
    advantage: float,
    temperature: float = 1.0,
    vocab: int = 2048,
    seed: int = 0,
) -> SampleArrays:
    rng = np.random.default_rng(seed)
    loss_mask = np.array(mask, dtype=np.bool_)
    return SampleArrays(
        sample_id=sample_id,
        episode_id=sample_id.split("/", maxsplit=1)[0],
        token_ids=rng.integers(0, vocab, loss_mask.size).astype(np.int64),
        loss_mask=loss_mask,
        behavior=np.where(loss_mask, np.float32(-1.0), np.float32(0.0)),
        advantage=advantage,
        temperature=temperature,
        policy_version_min=0,
    )


def turns(*runs: tuple[int, int]) -> list[bool]:
    """A mask from (context tokens, completion tokens) runs."""
    return [m for context, completion in runs for m in [False] * context + [True] * completion]


def one_batch(samples: Sequence[SampleArrays], mode: Normalization) -> MicroBatch:
    weights = normalization_weights(samples, mode, constant_tokens=64)
    (batch,) = pack(samples, weights, micro_batch_tokens=1 << 20)
    return batch


# --- the loss against a reference written token by token ----------------------------------

V = 11
SETTINGS = LossSettings(clip_low=0.2, clip_high=0.28, ratio_cap=3.0)
# log-ratios cycled over the mask tokens: ratio 0.37 (below 1 - clip_low), 1.82 (above
# 1 + clip_high), 1.05 (inside), 4.48 (above ratio_cap), 0.90 (inside)
LOG_RATIOS = [-1.0, 0.6, 0.05, 1.5, -0.1]


def reference_loss(
    logits: torch.Tensor,
    batch: MicroBatch,
    samples: dict[str, SampleArrays],
    mode: Normalization,
    settings: LossSettings,
    ref_logp: torch.Tensor | None,
) -> torch.Tensor:
    """The loss of the module docstring, one token at a time, weights counted here."""
    all_tokens = sum(int(s.loss_mask.sum()) for s in samples.values())
    episode_tokens: dict[str, int] = {}
    for s in samples.values():
        episode_tokens[s.episode_id] = episode_tokens.get(s.episode_id, 0) + int(s.loss_mask.sum())
    total = torch.zeros(())
    for b, sid in enumerate(batch.sample_ids):
        s = samples[sid]
        if mode == "token_mean":
            w = 1 / all_tokens
        elif mode == "episode_mean":
            w = 1 / (len(episode_tokens) * episode_tokens[s.episode_id])
        else:
            w = 1 / 64
        A = s.advantage
        for t in range(1, s.token_ids.size):
            if not s.loss_mask[t]:
                continue
            logp = torch.log_softmax(logits[b, t - 1] / s.temperature, dim=-1)[s.token_ids[t]]
            ratio = torch.exp(logp - batch.behavior[b, t])
            loss = -torch.min(
                ratio * A, torch.clamp(ratio, 1 - settings.clip_low, 1 + settings.clip_high) * A
            )
            if A < 0:
                loss = torch.min(loss, torch.tensor(-settings.ratio_cap * A))
            if ref_logp is not None:
                d = ref_logp[b, t] - logp
                loss = loss + settings.kl_coef * (torch.exp(d) - d - 1)
            total = total + w * loss
    return total


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
@pytest.mark.parametrize("mode", MODES)
def test_policy_loss_gradient_matches_a_token_by_token_reference(
    mode: Normalization, kl_coef: float
) -> None:
    samples = [
        make_sample("a/0/0", turns((2, 4), (2, 3)), advantage=1.2, vocab=V, seed=1),
        make_sample("a/0/1", turns((3, 5)), advantage=1.2, temperature=0.7, vocab=V, seed=2),
        make_sample("b/0/0", turns((1, 6), (1, 4)), advantage=-0.8, vocab=V, seed=3),
        make_sample("c/0/0", turns((4, 9)), advantage=-1.5, temperature=1.3, vocab=V, seed=4),
    ]
    batch = one_batch(samples, mode)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*batch.input_ids.shape, V, generator=gen, requires_grad=True)  # [B,T,V]
    logp0 = logprobs_from_logits(logits.detach(), batch)  # [B, T]
    shifts = torch.zeros_like(logp0)
    shifts[batch.loss_mask] = torch.tensor(LOG_RATIOS).repeat(40)[: int(batch.loss_mask.sum())]
    batch = dataclasses.replace(batch, behavior=torch.where(batch.loss_mask, logp0 - shifts, 0.0))
    ref = logp0 + 0.3 * torch.randn(logp0.shape, generator=gen) if kl_coef else None
    settings = dataclasses.replace(SETTINGS, kl_coef=kl_coef)

    loss, stats = policy_loss(logprobs_from_logits(logits, batch), batch, settings, ref)
    (grad,) = torch.autograd.grad(loss, logits)
    by_id = {s.sample_id: s for s in samples}
    expected = reference_loss(logits, batch, by_id, mode, settings, ref)
    (expected_grad,) = torch.autograd.grad(expected, logits)

    assert stats.clipped > 0 and stats.dual_clipped > 0  # every branch of the loss is taken
    assert float(stats.loss) == pytest.approx(float(expected.detach()), rel=1e-5)
    assert loss.item() == pytest.approx(float(expected.detach()), rel=1e-5)
    assert expected_grad.abs().max() > 1e-3
    assert torch.allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_policy_loss_needs_a_reference_when_kl_is_on() -> None:
    batch = one_batch([make_sample("a/0/0", turns((1, 2)), advantage=1.0)], "token_mean")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(torch.zeros(1, 3), batch, LossSettings(kl_coef=0.1))


# --- episode_mean: an episode of ten calls weighs what an episode of one call weighs ------


def test_episode_mean_weighs_a_ten_call_episode_like_a_one_call_episode() -> None:
    samples = [make_sample(f"ten/0/{k}", turns((5, 6)), advantage=1.0, seed=k) for k in range(10)]
    samples.append(make_sample("merged/0/0", turns(*[(4, 6)] * 10), advantage=1.0, seed=10))
    samples.append(make_sample("one/0/0", turns((5, 6)), advantage=1.0, seed=11))

    def gradient_per_episode(mode: Normalization) -> dict[str, float]:
        batch = one_batch(samples, mode)
        behavior = batch.behavior.clone()  # [B, T]
        logp = behavior.clone().requires_grad_(True)  # [B, T] ratio 1 everywhere
        loss, _ = policy_loss(logp, batch, LossSettings())
        loss.backward()
        assert logp.grad is not None
        per_episode: dict[str, float] = {}
        for b, sid in enumerate(batch.sample_ids):
            episode = sid.split("/", maxsplit=1)[0]
            per_episode[episode] = per_episode.get(episode, 0.0) + float(logp.grad[b].sum())
        return per_episode

    # At ratio 1 the gradient of token t w.r.t. its log-prob is -A * w_t: an episode's share
    # of the step is its total weight.
    assert gradient_per_episode("episode_mean") == pytest.approx(
        {"ten": -1 / 3, "merged": -1 / 3, "one": -1 / 3}, rel=1e-5
    )
    # token_mean: the one-call episode (6 of 126 tokens) is drowned out.
    assert gradient_per_episode("token_mean") == pytest.approx(
        {"ten": -60 / 126, "merged": -60 / 126, "one": -6 / 126}, rel=1e-5
    )


# --- the real tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    m.eval()  # no dropout; gradients are computed all the same
    return m


def model_samples(model: torch.nn.Module) -> list[SampleArrays]:
    """Agent-like samples whose behaviour log-probs are the model's own, perturbed so that
    the clip and the dual clip are active on some tokens."""
    runs = [
        [(6, 5), (4, 8)],
        [(9, 12)],
        [(5, 4), (3, 4), (3, 6), (2, 5)],
        [(12, 20), (6, 10)],
        [(4, 3)],
        [(7, 9), (5, 2)],
        [(3, 30)],
    ]
    advantages = [0.9, 0.9, -1.1, -1.1, 0.4, -0.6, 1.3]
    episodes = ["e0/0/0", "e0/0/1", "e1/0/0", "e1/0/1", "e2/0/0", "e3/0/0", "e4/0/0"]
    samples = [
        make_sample(sid, turns(*r), advantage=a, temperature=0.8 if k % 2 else 1.0, seed=k)
        for k, (sid, r, a) in enumerate(zip(episodes, runs, advantages, strict=True))
    ]
    batch = one_batch(samples, "token_mean")
    with torch.no_grad():
        logp0 = token_logprobs(model, batch)  # [B, T]
    gen = torch.Generator().manual_seed(1)
    behavior = logp0 - 0.8 * torch.randn(logp0.shape, generator=gen)  # [B, T]
    row = {sid: b for b, sid in enumerate(batch.sample_ids)}
    return [
        dataclasses.replace(
            s,
            behavior=np.where(
                s.loss_mask, behavior[row[s.sample_id], : s.token_ids.size].numpy(), 0
            ).astype(np.float32),
        )
        for s in samples
    ]


def gradients(
    model: torch.nn.Module, batches: Sequence[MicroBatch]
) -> tuple[list[torch.Tensor], LossStats]:
    model.zero_grad(set_to_none=True)
    total = LossStats()
    for batch in batches:
        loss, stats = policy_loss(token_logprobs(model, batch), batch, LossSettings())
        loss.backward()
        total.add(stats)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads, total


@pytest.mark.parametrize("mode", MODES)
def test_micro_batching_does_not_change_the_gradient(
    model: torch.nn.Module, mode: Normalization
) -> None:
    samples = model_samples(model)
    weights = normalization_weights(samples, mode, constant_tokens=500)
    whole = pack(samples, weights, micro_batch_tokens=1 << 20)
    split = pack(samples, weights, micro_batch_tokens=64)
    assert len(whole) == 1 and len(split) >= 4

    whole_grads, whole_stats = gradients(model, whole)
    split_grads, split_stats = gradients(model, split)

    assert whole_stats.clipped > 0 and whole_stats.dual_clipped > 0
    assert float(split_stats.loss) == pytest.approx(float(whole_stats.loss), rel=1e-5)
    assert len(whole_grads) == len(split_grads) == len(list(model.parameters()))
    scale = max(float(g.abs().max()) for g in whole_grads)
    assert scale > 0
    for a, b in zip(whole_grads, split_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6 * scale)


def test_first_pass_ratio_is_one_and_nothing_is_clipped(model: torch.nn.Module) -> None:
    batch = one_batch(model_samples(model), "episode_mean")
    with torch.no_grad():
        logp0 = token_logprobs(model, batch)  # [B, T]
    batch = dataclasses.replace(batch, behavior=torch.where(batch.loss_mask, logp0, 0.0))
    logp = token_logprobs(model, batch)  # [B, T]
    loss, stats = policy_loss(logp, batch, LossSettings())
    ratio = torch.exp(logp - batch.behavior)[batch.loss_mask]  # [N]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
    summary = stats.as_dict()
    assert summary["clip_fraction"] == 0.0 and summary["dual_clip_fraction"] == 0.0
    assert summary["mean_abs_logprob_diff"] < 1e-5
    # ratio 1: the loss is -sum(w * A), the plain policy gradient
    assert loss.item() == pytest.approx(float(-(batch.weights * batch.advantages).sum()), rel=1e-5)


def test_token_logprobs_apply_each_rows_temperature(model: torch.nn.Module) -> None:
    batch = one_batch(model_samples(model)[:3], "token_mean")
    temperature = torch.tensor([0.5, 1.0, 0.5])
    hot = dataclasses.replace(batch, temperature=temperature)
    logp = token_logprobs(model, hot)  # [B, T]
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    for b in range(3):
        n = int(batch.attention_mask[b].sum())
        scaled = torch.log_softmax(logits[b, : n - 1] / temperature[b], dim=-1)  # [n-1, V]
        expected = scaled.gather(-1, batch.input_ids[b, 1:n, None]).squeeze(-1)  # [n-1]
        assert torch.allclose(logp[b, 1:n], expected, atol=1e-5)
        assert logp[b, 0] == 0 and not logp[b, n:].any()
    plain = token_logprobs(model, dataclasses.replace(batch, temperature=torch.ones(3)))
    assert not torch.allclose(logp[0], plain[0], atol=1e-3)
    assert torch.allclose(logp[1], plain[1])

    entropy = entropy_from_logits(logits, hot)  # [B, T]
    p = torch.softmax(logits[0, :-1] / 0.5, dim=-1)  # [T-1, V]
    n = int(batch.attention_mask[0].sum())
    expected_entropy = -(p * p.log()).sum(-1)[: n - 1]  # [n-1]
    trained = hot.loss_mask[0, 1:n]  # [n-1] entropy is reported where tokens are trained
    assert trained.any()
    assert torch.allclose(entropy[0, 1:n][trained], expected_entropy[trained], atol=1e-5)
    assert torch.all(entropy[0, 1:n][~trained] == 0)
    # a row at a time gives the same values as the default chunks (it bounds the peak only)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss_module, "ENTROPY_CHUNK_ELEMENTS", logits.shape[-1])
        assert torch.equal(entropy_from_logits(logits, hot), entropy)
