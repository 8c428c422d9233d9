"""Data parallelism across `torchrun` processes: the same batch, split, gradients summed.

Rank 0 owns Kafka, checkpoints and publication; it hands every rank the whole batch, each
rank trains on its share of the micro-batches, and the gradients are summed across ranks
(one all-reduce of the flattened gradients, after the last micro-batch). The loss weights
are computed over the whole batch (see packing.normalization_weights), so the summed
gradient is exactly the one-process gradient, as with DDP — without DDP's requirement that
every rank run the same number of backward passes. gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import distributed as dist


class World:
    """This process's place among the trainer's processes (a single process by default)."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank = rank
        self.size = size

    @classmethod
    def from_env(cls, device: torch.device) -> World:
        """Joins the process group `torchrun` describes in the environment (WORLD_SIZE,
        RANK, MASTER_ADDR, ...); a plain process is a world of one."""
        size = int(os.environ.get("WORLD_SIZE", "1"))
        if size == 1:
            return cls()
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, items: Any) -> Any:
        """Every rank gets the leader's `items` (others pass anything)."""
        if self.size == 1:
            return items
        box = [items if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's gradient across ranks (missing gradients count as 0)."""
        if self.size == 1:
            return
        params = [p for p in parameters if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # [P] one all-reduce for all
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(params, grads, strict=True):
            p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of `values` across ranks."""
        if self.size > 1:
            dist.all_reduce(values)
        return values

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()
