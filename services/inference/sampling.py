"""Choosing the next token, and its log-probability under the distribution sampled from.

The log-prob reported for a token is that of the distribution the token was actually drawn
from, after temperature and top-p (vLLM's `processed_logprobs`): log softmax(logits / T) over
the top-p nucleus, renormalised. With temperature 0 the choice is greedy and the log-prob is
that of softmax(logits). The trainer relies on this: it recomputes the same quantity from
its own logits at the same temperature and compares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples. Validated at the API edge."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    top_k: int = 0,
) -> tuple[list[int], list[float], list[tuple[tuple[int, float], ...]]]:
    """Sample one token per row of `logits` [B, V].

    Returns (token ids, processed log-probs of those tokens, per row the `top_k` most likely
    (token id, processed log-prob) pairs). Row i uses params[i]; a seeded row draws from its
    own generators[i], so it samples the same tokens whatever else is in the batch (given the
    same logits); unseeded rows draw from torch's global generator.
    """
    logits = logits.float()
    temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy = temperatures == 0
    scaled = logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1)  # [B, V]
    logprobs = torch.log_softmax(scaled, dim=-1)
    needs_top_p = [p.top_p < 1.0 and p.temperature > 0 for p in params]
    if any(needs_top_p):
        logprobs = _nucleus(logprobs, torch.tensor([p.top_p for p in params]), needs_top_p)
    # Inverse-CDF sampling: one uniform per row (from the row's own generator when seeded),
    # then the first token whose cumulative probability reaches it. Exact, and one vectorised
    # pass instead of a multinomial call per row.
    uniforms = torch.rand(len(params))
    for row, p in enumerate(params):
        if p.seed is not None:
            uniforms[row] = torch.rand(1, generator=generators[row])[0]
    cdf = logprobs.exp().cumsum(dim=-1)  # [B, V]
    drawn = torch.searchsorted(cdf, (uniforms * cdf[:, -1]).unsqueeze(1)).squeeze(1)
    drawn = drawn.clamp(max=logprobs.shape[-1] - 1)
    picked = torch.where(greedy, torch.argmax(logprobs, dim=-1), drawn)
    tokens: list[int] = picked.tolist()
    chosen: list[float] = logprobs.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(params)
    if top_k > 0:
        values, indices = torch.topk(logprobs, min(top_k, logprobs.shape[-1]), dim=-1)
        tops = [
            tuple(zip(i.tolist(), v.tolist(), strict=True))
            for i, v in zip(indices, values, strict=True)
        ]
    return tokens, chosen, tops


def _nucleus(logprobs: torch.Tensor, top_p: torch.Tensor, rows: list[bool]) -> torch.Tensor:
    """Restrict each selected row to its smallest set of tokens with mass >= top_p, and
    renormalise: the returned rows are log-probs of the distribution actually sampled from."""
    sorted_lp, order = torch.sort(logprobs, dim=-1, descending=True)
    cumulative = sorted_lp.exp().cumsum(dim=-1)
    # Keep a token if the mass before it is below top_p (so the top token is always kept).
    keep_sorted = (cumulative - sorted_lp.exp()) < top_p.unsqueeze(1)
    keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
    apply = torch.tensor(rows).unsqueeze(1)
    keep = keep | ~apply
    masked = logprobs.masked_fill(~keep, float("-inf"))
    return torch.log_softmax(masked, dim=-1)


def generator_for(seed: int | None) -> torch.Generator:
    """A CPU generator for one request: seeded when asked, else from fresh entropy."""
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
