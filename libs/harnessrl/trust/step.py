"""One optimiser step over a batch: everything a gradient is made of, in one function.

    stats = step(model, optimizer, scheduler, samples, settings)

The normalisation weights are computed over the whole batch (packing.py: every rank passes
the same samples, so every rank weighs a token the same), the batch is packed into
micro-batches, this rank's share of them runs forward and backward (gradients accumulate),
gradients and statistics are summed across ranks, the gradient norm is clipped, and the
optimiser and its schedule take one step. How ranks share the work is behind `Ranks`: one
process needs nothing; the trainer's data-parallel and FSDP worlds are one each
(services/trainer/policy.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

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
    padding_fraction,
)


@dataclass(frozen=True, slots=True)
class StepSettings:
    normalization: Normalization
    """How token losses are weighed (packing.normalization_weights)."""
    constant_tokens: int
    """The token budget the loss is divided by under "constant"."""
    micro_batch_tokens: int
    """Most tokens (rows x longest row) one forward pass holds."""
    grad_clip: float
    """Largest gradient norm; larger ones are scaled down to it."""
    loss: LossSettings


@dataclass(frozen=True, slots=True)
class StepStats:
    loss: float
    clip_fraction: float
    dual_clip_fraction: float
    kl: float
    entropy: float
    mismatch: float
    """Mean |current - behaviour log-prob| per trained token: the train-inference mismatch
    on a first pass (0 up to numerical noise when trainer and engine agree)."""
    grad_norm: float
    lr: float
    tokens: int
    """Trained (loss-mask) tokens of the batch."""
    sequence_tokens: int
    """All tokens of the batch's sequences."""
    samples: int
    padding: float
    seconds: float


class Ranks(Protocol):
    """How the processes that train one model share a step."""

    def share(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches (each micro-batch is run by exactly one rank)."""

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Sum the parameters' gradients across ranks."""

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of `values` across ranks."""

    def whole(self, value: torch.Tensor) -> torch.Tensor:
        """A value some ranks hold in shards, whole."""


class OneRank:
    """A single process: it runs every micro-batch, and nothing is summed."""

    def share(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        return batches

    def sum_gradients(self, model: torch.nn.Module) -> None:
        return None

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def whole(self, value: torch.Tensor) -> torch.Tensor:
        return value


def step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    samples: Sequence[SampleArrays],
    settings: StepSettings,
    *,
    device: torch.device,
    reference: torch.nn.Module | None = None,
    autocast: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ranks: Ranks | None = None,
) -> StepStats:
    """One optimiser step on `samples`, the whole batch (every rank passes the same);
    `reference` is the frozen model the KL penalty measures against, if any."""
    started = time.perf_counter()
    ranks = ranks or OneRank()
    weights = normalization_weights(
        samples, settings.normalization, constant_tokens=settings.constant_tokens
    )
    batches = pack(samples, weights, micro_batch_tokens=settings.micro_batch_tokens)
    stats = LossStats()
    optimizer.zero_grad(set_to_none=True)
    for share in ranks.share(batches):
        batch = share.to(device)
        with autocast():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp = logprobs_from_logits(logits, batch)  # [B, T]
        entropy = entropy_from_logits(logits.detach(), batch)  # [B, T]
        ref = None
        if reference is not None:
            with torch.no_grad(), autocast():
                ref = token_logprobs(reference, batch)  # [B, T]
        loss, micro = policy_loss(logp, batch, settings.loss, ref, entropy)
        loss.backward()  # type: ignore[no-untyped-call]
        stats.add(micro)
        del logits, logp, loss
    ranks.sum_gradients(model)
    stats = LossStats.from_tensor(ranks.sum(stats.as_tensor().to(device)))
    grad_norm = ranks.whole(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip))
    lr = float(scheduler.get_last_lr()[0])
    optimizer.step()
    scheduler.step()
    summary = stats.as_dict()
    return StepStats(
        loss=summary["loss"],
        clip_fraction=summary["clip_fraction"],
        dual_clip_fraction=summary["dual_clip_fraction"],
        kl=summary["kl"],
        entropy=summary["mean_entropy"],
        mismatch=summary["mean_abs_logprob_diff"],
        grad_norm=float(grad_norm),
        lr=lr,
        tokens=int(summary["tokens"]),
        sequence_tokens=sum(len(s.token_ids) for s in samples),
        samples=len(samples),
        padding=padding_fraction(batches),
        seconds=time.perf_counter() - started,
    )
