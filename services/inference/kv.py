"""A running batch of sequences sharing one transformers KV cache, for continuous batching.

Sequences of different lengths share the cache by left-padding: row i's cached positions
that are padding have mask 0. New sequences are prefilled on their own and merged into the
batch between decode steps; finished ones are dropped; leading columns that are padding in
every row are trimmed. Every operation here touches the cache's per-layer `keys`/`values`
tensors ([batch, kv_heads, length, head_dim]); tests/unit/test_inference_kv.py checks that
batched decoding gives the same logits as decoding each sequence alone, so a change in
transformers' cache layout fails loudly.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F


def cache_argument(model: Any) -> str:
    """Name of the forward argument (and output field) carrying the KV cache: "cache" in
    transformers 5, "past_key_values" before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position id of each column of a left-padded [B, L] mask (padding gets 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


class RunningBatch:
    """The KV cache and attention mask of the sequences currently decoding.

    Rows are addressed by index; the caller keeps its own per-row bookkeeping aligned with
    them (merge appends rows, keep() reorders/filters rows in the order given).
    """

    def __init__(self) -> None:
        self.cache: Any = None
        self.mask = torch.zeros(0, 0, dtype=torch.long)  # [B, L]: 1 real token, 0 padding

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def next_positions(self) -> torch.Tensor:
        """[B, 1] position id of each row's next token."""
        return self.mask.sum(-1, keepdim=True)

    def merge(self, cache: Any, mask: torch.Tensor) -> None:
        """Append the rows of a freshly prefilled (cache, mask) to the batch."""
        if self.cache is None or self.size == 0:
            self.cache, self.mask = cache, mask
            return
        length = max(self.length, int(mask.shape[1]))
        self._pad_left(self.cache, self.length, length)
        self._pad_left(cache, int(mask.shape[1]), length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
            mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat(
            [F.pad(self.mask, (length - self.length, 0)), F.pad(mask, (length - mask.shape[1], 0))]
        )

    def extend_mask(self) -> torch.Tensor:
        """Account for one more token per row; returns the mask to pass for this step."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        return self.mask

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order), then trim columns that are padding in all rows."""
        if not rows:
            self.cache, self.mask = None, torch.zeros(0, 0, dtype=torch.long)
            return
        if rows != list(range(self.size)):
            index = torch.tensor(rows, device=self.mask.device)
            for layer in self.cache.layers:
                layer.keys = layer.keys[index]
                layer.values = layer.values[index]
            self.mask = self.mask[index]
        real = self.mask.any(dim=0).nonzero()
        start = int(real[0]) if real.numel() else self.length
        if start > 0:
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]
            self.mask = self.mask[:, start:]

    @staticmethod
    def _pad_left(cache: Any, current: int, length: int) -> None:
        if length > current:
            for layer in cache.layers:
                layer.keys = F.pad(layer.keys, (0, 0, length - current, 0))
                layer.values = F.pad(layer.values, (0, 0, length - current, 0))
