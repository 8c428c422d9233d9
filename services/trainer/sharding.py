"""FSDP2 across the trainer's `torchrun` ranks: parameters, gradients and optimizer state
split, one FSDP unit per transformer block.

    model = shard(model, settings.sharding, compute_dtype)   # before the optimizer exists

Each rank holds 1/N of every parameter (a DTensor sharded on dim 0); a block's full
parameters are all-gathered just before its forward (and again for its backward) and
freed after. Gradients are reduce-scattered as they are produced, in `reduce_dtype`, and
summed (divide factor 1), not averaged: the loss weights are computed over the whole batch
(packing.normalization_weights), so the sum over ranks is the one-process gradient. The
optimizer then updates only the local shard. Everything not in a block (embeddings, the
final norm, an untied LM head) is the root unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from harnessrl.services.trainer.config import ShardingSection


def shard(
    model: torch.nn.Module, settings: ShardingSection, compute_dtype: torch.dtype
) -> torch.nn.Module:
    """Apply `fully_shard` to every transformer block of `model` and to `model` itself
    (in place; returns it). Call after the process group is initialised and before the
    optimizer is built (it must see the sharded parameters). Raises ValueError when no
    block can be found."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    reduce_dtype = torch.float32 if settings.reduce_dtype == "float32" else torch.bfloat16
    precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)
    found = list(blocks(model))
    if not found:
        raise ValueError(
            f"sharding: no transformer blocks found in {type(model).__name__} "
            "(looked for its _no_split_modules classes); use sharding.strategy=replicate"
        )
    for block in found:
        fully_shard(
            block, mp_policy=precision, reshard_after_forward=settings.reshard_after_forward
        )
    # The root is used first in the backward pass: keeping it gathered saves an all-gather.
    fully_shard(model, mp_policy=precision, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def blocks(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model's transformer blocks: modules whose class transformers lists in
    `_no_split_modules` (the unit it never splits across devices), outermost only."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    inner: Any = getattr(model, "base_model", model)  # a PEFT wrapper names them on its model
    names |= set(getattr(getattr(inner, "model", inner), "_no_split_modules", None) or [])
    seen: set[int] = set()
    for module in model.modules():
        if type(module).__name__ in names and not _inside(module, seen):
            seen.update(id(m) for m in module.modules())
            yield module


def _inside(module: torch.nn.Module, seen: set[int]) -> bool:
    return id(module) in seen


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: all-gathered from every rank when it is a DTensor (a collective:
    every rank must call it, in the same order), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
