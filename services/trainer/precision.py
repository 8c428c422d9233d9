"""The dtype the trainer's forward runs in (its weights stay float32 for the optimizer)."""

from __future__ import annotations

import torch

from harnessrl.services.trainer.config import TrainerSection


def compute_dtype(settings: TrainerSection, device: torch.device) -> torch.dtype:
    """What the forward runs in: bf16 for dtype bfloat16, or auto on CUDA; else float32."""
    dtype = settings.dtype
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32
