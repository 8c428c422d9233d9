"""Token log-probs of the policy, and the clipped policy-gradient loss.

Log-probs. For row b sampled at temperature tau_b, the log-prob of token t is

    logp[b, t] = log_softmax(logits[b, t-1] / tau_b)[input_ids[b, t]]        (t >= 1)

and 0 at t = 0 and on padding. The engine's behaviour log-probs are taken after temperature
scaling (vLLM's "processed" log-probs), so the trainer scales the same way or the ratio below
would be off by the temperature alone. Computed in float32 whatever the model's dtype.

Loss. On a loss-mask token with advantage A, behaviour log-prob b, reference log-prob q:

    r      = exp(logp - b)                                     importance ratio
    L_clip = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)
    L_pg   = min(L_clip, -ratio_cap * A)   if A < 0           dual clip
             L_clip                        otherwise
    k3     = exp(q - logp) - (q - logp) - 1                    KL(policy || reference), k3
    l      = L_pg + kl_coef * k3

and the micro-batch's loss is  sum_t w_t * l_t  with the weights of packing (0 off the mask).
It is a sum, not a mean: the weights already normalise over the whole optimiser batch, so
summing the micro-batch losses (and their gradients) gives the batch loss.

What the clipping does to the gradient: L_clip's gradient is zero once the ratio has moved
past 1 + clip_high for A > 0 (or below 1 - clip_low for A < 0), the PPO trust region with an
asymmetric, larger upper bound ("clip-higher", DAPO) so unlikely tokens with positive
advantage can still gain. For A < 0, L_clip = -r * A grows without bound in r; a token that
the policy now likes far more than the behaviour did (stale, off-policy) would dominate the
step. The dual clip (Ye et al. 2020) caps it at -ratio_cap * A, constant, so past ratio_cap
such a token contributes no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F

from harnessrl.trust.packing import MicroBatch


def token_logprobs(model: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """float32 [B, T] log-probs of the batch's tokens under `model` (see the module
    docstring); differentiable. The model is called as
    model(input_ids=..., attention_mask=...) and must return `.logits` [B, T, V]."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return logprobs_from_logits(logits, batch)


def logprobs_from_logits(logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """float32 [B, T] log-probs from the model's logits [B, T, V] (any float dtype)."""
    tau = batch.temperature.to(logits.device)[:, None, None]  # [B, 1, 1]
    scaled = logits[:, :-1].float() / tau  # [B, T-1, V]
    targets = batch.input_ids[:, 1:, None]  # [B, T-1, 1]
    # One fused log_softmax (its backward is a single pass over [B, T-1, V]; gather minus
    # logsumexp measured ~1.6x slower backward for the same memory).
    logp = torch.log_softmax(scaled, dim=-1).gather(-1, targets).squeeze(-1)  # [B, T-1]
    logp = F.pad(logp, (1, 0))  # [B, T] nothing predicts token 0
    return torch.where(batch.attention_mask.bool(), logp, 0.0)  # [B, T]


ENTROPY_CHUNK_ELEMENTS = 1 << 24
"""Logit elements the entropy statistic works on at once (rows of the vocabulary's size):
its peak is ~16 bytes each, 256 MiB, however many tokens the micro-batch has."""


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor, batch: MicroBatch) -> torch.Tensor:
    """float32 [B, T] entropy of the temperature-scaled distribution each trained token was
    drawn from (position t: the distribution predicted at t-1), 0 off the loss mask. For
    monitoring only (no gradient); computed at loss-mask positions only, a chunk of rows at
    a time (ENTROPY_CHUNK_ELEMENTS), so it never holds a float32 copy of all the logits."""
    tau = batch.temperature.to(logits.device)  # [B]
    mask = batch.loss_mask[:, 1:].to(logits.device)  # [B, T-1] positions whose token is trained
    rows, cols = mask.nonzero(as_tuple=True)  # [M] each
    values = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)  # [M]
    step = max(1, ENTROPY_CHUNK_ELEMENTS // logits.shape[-1])
    for start in range(0, rows.numel(), step):
        r, c = rows[start : start + step], cols[start : start + step]
        scaled = logits[r, c].float() / tau[r][:, None]  # [m, V]
        logp = torch.log_softmax(scaled, dim=-1)
        values[start : start + step] = -(logp.exp() * logp).sum(-1)
    entropy = torch.zeros(mask.shape, dtype=torch.float32, device=logits.device)  # [B, T-1]
    entropy[rows, cols] = values
    return F.pad(entropy, (1, 0))  # [B, T]


@dataclass(frozen=True, slots=True)
class LossSettings:
    clip_low: float = 0.2
    """Ratio lower bound 1 - clip_low."""
    clip_high: float = 0.28
    """Ratio upper bound 1 + clip_high (asymmetric: "clip-higher")."""
    ratio_cap: float = 3.0
    """Dual clip for negative advantages: the loss is capped at -ratio_cap * A."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to the frozen reference."""


def _zero() -> torch.Tensor:
    return torch.zeros(())


@dataclass(slots=True)
class LossStats:
    """Sums over loss-mask tokens, as detached 0-d float32 tensors (no device sync until
    `as_dict`). Every field is a sum, so stats of micro-batches and of ranks add up."""

    loss: torch.Tensor = field(default_factory=_zero)
    """Weighted: sum of w * l, the value of the loss."""
    kl: torch.Tensor = field(default_factory=_zero)
    """Weighted: sum of w * k3 (0 without a reference)."""
    tokens: torch.Tensor = field(default_factory=_zero)
    """Loss-mask tokens."""
    clipped: torch.Tensor = field(default_factory=_zero)
    """Tokens whose gradient the PPO clip removed (A > 0 and r > 1 + clip_high, or A < 0
    and r < 1 - clip_low): the clip fraction's numerator."""
    dual_clipped: torch.Tensor = field(default_factory=_zero)
    """Tokens whose gradient the dual clip removed (A < 0 and r > ratio_cap)."""
    abs_logprob_diff: torch.Tensor = field(default_factory=_zero)
    """Sum of |logp - behaviour|: train-inference mismatch (about 0 on a first pass)."""
    entropy: torch.Tensor = field(default_factory=_zero)
    """Sum of the policy's entropy (0 unless policy_loss was given one)."""

    def add(self, other: LossStats) -> None:
        """Accumulate `other` into self."""
        for f in fields(self):
            # A 0-d CPU tensor plus a CUDA one is computed on the GPU: no device sync here.
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_tensor(self) -> torch.Tensor:
        """float32 [K], the fields in order (one all-reduce sums them across ranks)."""
        return torch.stack([getattr(self, f.name) for f in fields(self)])

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> LossStats:
        return cls(*values.unbind())

    def as_dict(self) -> dict[str, float]:
        """The sums, plus clip_fraction, dual_clip_fraction, mean_abs_logprob_diff and
        mean_entropy per loss-mask token."""
        out = {f.name: float(getattr(self, f.name)) for f in fields(self)}
        n = max(out["tokens"], 1.0)
        out["clip_fraction"] = out["clipped"] / n
        out["dual_clip_fraction"] = out["dual_clipped"] / n
        out["mean_abs_logprob_diff"] = out["abs_logprob_diff"] / n
        out["mean_entropy"] = out["entropy"] / n
        return out


def policy_loss(
    logp: torch.Tensor,
    batch: MicroBatch,
    settings: LossSettings,
    ref_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The micro-batch's loss (a scalar: sum of w * l, see the module docstring) and its
    stats. `logp` [B, T] from token_logprobs; `ref_logp` [B, T] from the reference model
    (no grad; required when kl_coef > 0); `entropy` [B, T], optional, only feeds the stats."""
    if settings.kl_coef > 0 and ref_logp is None:
        raise ValueError("policy_loss: kl_coef > 0 needs ref_logp")
    mask = batch.loss_mask  # [B, T]
    A = batch.advantages  # [B, T]
    # Off the mask the log-ratio is set to 0 before exp: any value there (prompt tokens
    # have no behaviour log-prob) must not overflow into inf * 0 = nan.
    log_ratio = torch.where(mask, logp - batch.behavior, 0.0)  # [B, T]
    ratio = log_ratio.exp()  # [B, T]
    clipped_ratio = ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)  # [B, T]
    loss_clip = -torch.minimum(ratio * A, clipped_ratio * A)  # [B, T]
    loss_dual = torch.minimum(loss_clip, -settings.ratio_cap * A)  # [B, T]
    per_token = torch.where(A < 0, loss_dual, loss_clip)  # [B, T] L_pg
    k3 = torch.zeros_like(logp)  # [B, T]
    if ref_logp is not None:
        ref_diff = torch.where(mask, ref_logp - logp, 0.0)  # [B, T]
        k3 = ref_diff.exp() - ref_diff - 1.0  # [B, T]
        per_token = per_token + settings.kl_coef * k3
    loss = (per_token * batch.weights).sum()  # scalar

    with torch.no_grad():
        m = mask.float()  # [B, T]
        clipped = ((A > 0) & (ratio > 1.0 + settings.clip_high)) | (
            (A < 0) & (ratio < 1.0 - settings.clip_low)
        )  # [B, T]
        dual = (A < 0) & (ratio > settings.ratio_cap)  # [B, T]
        stats = LossStats(
            loss=loss.detach().float(),
            kl=(k3 * batch.weights).sum().float(),
            tokens=m.sum(),
            clipped=(clipped.float() * m).sum(),
            dual_clipped=(dual.float() * m).sum(),
            abs_logprob_diff=(log_ratio.abs() * m).sum(),
            entropy=(entropy.float() * m).sum() if entropy is not None else m.new_zeros(()),
        )
    return loss, stats
