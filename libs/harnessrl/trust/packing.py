"""A batch of samples becomes micro-batches, with loss weights computed over the whole batch.

The loss of a step is  L = sum over batch tokens t of w_t * l_t  (l_t the per-token loss of
harnessrl.trust.loss), with w_t = 0 off the loss mask and, on it:

- token_mean:    w_t = 1 / N                 N: mask tokens in the whole batch;
- episode_mean:  w_t = 1 / (E * N_e)         E: episodes with a mask token in the batch,
                                             N_e: mask tokens of t's episode, all its
                                             segments together;
- constant:      w_t = 1 / constant_tokens.

Because the weights are fixed before the batch is split, L is a plain sum over tokens: the
gradients of the micro-batches (and of the data-parallel ranks) add up to exactly the
gradient of L, with no rescaling by micro-batch sizes. Under episode_mean every episode
carries total weight 1/E whether it made one model call or fifty.

Packing sorts samples by length and fills micro-batches greedily, so that a micro-batch's
padded size B * max_len stays within the token budget and rows of a micro-batch have
similar lengths (little padding). Everything here is deterministic: the same samples, in any
order, give the same micro-batches.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch

from harnessrl.v1 import events_pb2 as pb

Normalization = Literal["token_mean", "episode_mean", "constant"]
Weights = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class SampleArrays:
    """One pb.Sample as arrays, all of length T."""

    sample_id: str
    episode_id: str
    token_ids: npt.NDArray[np.int64]
    """int64 [T]."""
    loss_mask: npt.NDArray[np.bool_]
    """bool [T]; position 0 is always False (nothing predicts the first token)."""
    behavior: npt.NDArray[np.float32]
    """float32 [T]: behaviour log-prob recorded at the gateway, 0 where the mask is False."""
    advantage: float
    temperature: float
    policy_version_min: int
    advantages: npt.NDArray[np.float32] | None = None
    """float32 [T]: per-token advantages (Sample.advantages, 0 where the mask is False), or
    None: `advantage` on every token."""

    @classmethod
    def from_proto(cls, sample: pb.Sample) -> SampleArrays:
        """Raises ValueError naming the field when the arrays disagree in length, the sample
        is empty, its first token is on the loss mask, its temperature is not positive, or
        an advantage (`advantage`, or `advantages` on the loss mask) is not finite."""
        token_ids = np.array(sample.token_ids, dtype=np.int64)  # [T]
        loss_mask = np.array(sample.loss_mask, dtype=np.bool_)  # [T]
        behavior = np.array(sample.behavior_logprobs, dtype=np.float32)  # [T]
        where = f"sample {sample.sample_id!r}"
        if token_ids.size == 0:
            raise ValueError(f"{where}: token_ids is empty")
        if loss_mask.size != token_ids.size or behavior.size != token_ids.size:
            raise ValueError(
                f"{where}: loss_mask ({loss_mask.size}) and behavior_logprobs "
                f"({behavior.size}) must have the length of token_ids ({token_ids.size})"
            )
        if loss_mask[0]:
            raise ValueError(f"{where}: loss_mask[0] is true; the first token has no log-prob")
        if not 0 < sample.temperature < math.inf:
            raise ValueError(f"{where}: temperature must be > 0, got {sample.temperature}")
        if not math.isfinite(sample.advantage):
            raise ValueError(f"{where}: advantage must be finite, got {sample.advantage}")
        if not np.all(np.isfinite(behavior[loss_mask])):
            raise ValueError(f"{where}: behavior_logprobs must be finite on the loss mask")
        per_token = None
        if len(sample.advantages):
            per_token = np.array(sample.advantages, dtype=np.float32)  # [T]
            if per_token.size != token_ids.size:
                raise ValueError(
                    f"{where}: advantages ({per_token.size}) must be empty or have the "
                    f"length of token_ids ({token_ids.size})"
                )
            if not np.all(np.isfinite(per_token[loss_mask])):
                raise ValueError(f"{where}: advantages must be finite on the loss mask")
            per_token = np.where(loss_mask, per_token, np.float32(0.0))  # [T]
        return cls(
            sample_id=sample.sample_id,
            episode_id=sample.episode_id,
            token_ids=token_ids,
            loss_mask=loss_mask,
            behavior=np.where(loss_mask, behavior, np.float32(0.0)),
            advantage=float(sample.advantage),
            temperature=float(sample.temperature),
            policy_version_min=int(sample.policy_version_min),
            advantages=per_token,
        )


def normalization_weights(
    samples: Sequence[SampleArrays], mode: Normalization, *, constant_tokens: int
) -> list[Weights]:
    """Per-sample loss weights, float32 [T] each, 0 where the mask is False (see the module
    docstring). Computed over all of `samples`, which must be the whole optimiser batch.
    Samples of one episode are those with the same episode_id. Raises ValueError for an
    unknown mode or constant_tokens < 1 under "constant"."""
    per_token: list[float]
    if mode == "token_mean":
        total = sum(int(s.loss_mask.sum()) for s in samples)
        per_token = [1.0 / total if total else 0.0] * len(samples)
    elif mode == "episode_mean":
        episode_tokens: dict[str, int] = defaultdict(int)
        for s in samples:
            episode_tokens[s.episode_id] += int(s.loss_mask.sum())
        episodes = sum(1 for n in episode_tokens.values() if n > 0)
        per_token = [
            1.0 / (episodes * episode_tokens[s.episode_id]) if episode_tokens[s.episode_id] else 0.0
            for s in samples
        ]
    elif mode == "constant":
        if constant_tokens < 1:
            raise ValueError(f"constant_tokens must be >= 1, got {constant_tokens}")
        per_token = [1.0 / constant_tokens] * len(samples)
    else:
        raise ValueError(f"normalization: unknown mode {mode!r}")
    return [
        np.where(s.loss_mask, np.float32(w), np.float32(0.0))
        for s, w in zip(samples, per_token, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Rows right-padded to the longest row; padding has attention 0, mask False, weight 0."""

    input_ids: torch.Tensor
    """int64 [B, T], padded with 0."""
    attention_mask: torch.Tensor
    """int64 [B, T]: 1 on real tokens."""
    loss_mask: torch.Tensor
    """bool [B, T]."""
    behavior: torch.Tensor
    """float32 [B, T]: behaviour log-probs, 0 off the loss mask."""
    advantages: torch.Tensor
    """float32 [B, T]: the sample's per-token advantages when it has them, else its advantage
    on each of its real tokens; 0 on padding."""
    weights: torch.Tensor
    """float32 [B, T]: normalization weights over the whole batch, 0 off the loss mask."""
    temperature: torch.Tensor
    """float32 [B]: sampling temperature of each row."""
    sample_ids: tuple[str, ...]
    """Sample id of each row."""

    @property
    def tokens(self) -> int:
        """Real tokens (not padding)."""
        return int(self.attention_mask.sum())

    @property
    def padded_tokens(self) -> int:
        """B * T."""
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        """The same batch with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return MicroBatch(**moved, sample_ids=self.sample_ids)


def pack(
    samples: Sequence[SampleArrays], weights: Sequence[Weights], *, micro_batch_tokens: int
) -> list[MicroBatch]:
    """Micro-batches holding every sample exactly once, with B * max_len <= micro_batch_tokens
    (a sample longer than the budget is a micro-batch alone). Samples are taken longest first
    (ties by sample_id), so the largest micro-batch comes first (memory peaks on the first
    pass, not mid-step) and the result does not depend on the input order. `weights` are
    normalization_weights(samples, ...), in the same order."""
    if len(weights) != len(samples):
        raise ValueError(f"weights: {len(weights)} arrays for {len(samples)} samples")
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    order = sorted(
        range(len(samples)), key=lambda i: (-samples[i].token_ids.size, samples[i].sample_id)
    )
    batches: list[MicroBatch] = []
    rows: list[int] = []
    for i in order:
        # Sorted longest first: the first row of a micro-batch is its longest.
        if rows and (len(rows) + 1) * samples[rows[0]].token_ids.size > micro_batch_tokens:
            batches.append(_collate([samples[j] for j in rows], [weights[j] for j in rows]))
            rows = []
        rows.append(i)
    if rows:
        batches.append(_collate([samples[j] for j in rows], [weights[j] for j in rows]))
    return batches


def _collate(samples: Sequence[SampleArrays], weights: Sequence[Weights]) -> MicroBatch:
    B, T = len(samples), max(s.token_ids.size for s in samples)
    input_ids = np.zeros((B, T), dtype=np.int64)
    attention = np.zeros((B, T), dtype=np.int64)
    loss_mask = np.zeros((B, T), dtype=np.bool_)
    behavior = np.zeros((B, T), dtype=np.float32)
    advantages = np.zeros((B, T), dtype=np.float32)
    row_weights = np.zeros((B, T), dtype=np.float32)
    for b, (s, w) in enumerate(zip(samples, weights, strict=True)):
        n = s.token_ids.size
        if w.shape != (n,):
            raise ValueError(f"weights of {s.sample_id!r}: shape {w.shape}, expected ({n},)")
        input_ids[b, :n] = s.token_ids
        attention[b, :n] = 1
        loss_mask[b, :n] = s.loss_mask
        behavior[b, :n] = s.behavior
        if s.advantages is None:
            advantages[b, :n] = s.advantage
        elif s.advantages.shape == (n,):
            advantages[b, :n] = s.advantages
        else:
            raise ValueError(
                f"advantages of {s.sample_id!r}: shape {s.advantages.shape}, expected ({n},)"
            )
        row_weights[b, :n] = w
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids),  # [B, T]
        attention_mask=torch.from_numpy(attention),  # [B, T]
        loss_mask=torch.from_numpy(loss_mask),  # [B, T]
        behavior=torch.from_numpy(behavior),  # [B, T]
        advantages=torch.from_numpy(advantages),  # [B, T]
        weights=torch.from_numpy(row_weights),  # [B, T]
        temperature=torch.tensor([s.temperature for s in samples], dtype=torch.float32),  # [B]
        sample_ids=tuple(s.sample_id for s in samples),
    )


def padding_fraction(batches: Sequence[MicroBatch]) -> float:
    """Share of the padded positions of `batches` that are padding (0.0 for no batches)."""
    padded = sum(b.padded_tokens for b in batches)
    return 1.0 - sum(b.tokens for b in batches) / padded if padded else 0.0
