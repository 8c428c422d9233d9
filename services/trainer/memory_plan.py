"""The plan in words, and the trainer's start-up refusal: the table `harnessrl trainer
plan` prints, its JSON line, and `check_fits`, which refuses a configuration that cannot fit
(the figures come from memory_estimate.py's `plan`).

    result = plan(Path("examples/tiny-model"), settings, 8, gpu_memory_bytes=None)  # estimate
    print(format_plan(result))
    check_fits(settings, world.size, device)       # Policy.load: ValueError when it cannot
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from harnessrl.services.trainer.config import TrainerSection
from harnessrl.services.trainer.memory_estimate import (
    CONTEXT_BYTES,
    FRAGMENTATION,
    GiB,
    MemoryPlan,
    plan,
)

if TYPE_CHECKING:
    import torch

__all__ = ["check_fits", "format_json", "format_plan"]


def check_fits(settings: TrainerSection, world_size: int, device: torch.device) -> None:
    """Refuse a configuration that cannot fit: ValueError naming the per-rank figures and
    the memory available. The memory is settings.gpu_memory_gib, else (CUDA) what the
    device reports; on CPU without gpu_memory_gib nothing is checked (nothing is built)."""
    if settings.gpu_memory_gib is not None:
        memory = int(settings.gpu_memory_gib * GiB)
    elif device.type == "cuda":
        import torch

        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        return
    result = plan(settings.model, settings, world_size, memory, device_type=device.type)
    if not result.fits:
        raise ValueError(
            f"trainer: {settings.model} does not fit: {_summary(result)}; use more ranks "
            "(sharding.strategy=fsdp), lora, gradient_checkpointing or a smaller "
            "micro_batch_tokens (`harnessrl trainer plan` shows the figures)"
        )


def format_plan(result: MemoryPlan) -> str:
    """The plan as a table for a terminal (GiB per rank; * marks the activations counted)."""
    shape = result.shape
    ranks = f"{result.world_size} rank{'s' if result.world_size > 1 else ''}"
    layout = f"fsdp over {ranks}" if result.sharded else f"replicated on {ranks}"
    if result.lora_rank is None:
        mode, weights = "full weights", "fp32 master"
    else:
        mode = f"LoRA rank {result.lora_rank}"
        weights = f"{_short(result.base_dtype)} frozen base + fp32 adapters"
    working = (
        f"FSDP, {_short(result.compute_dtype)}: 2 blocks + root, 1 block's grads"
        if result.sharded
        else "bf16 autocast copies of fp32 linears"
    )
    on, off = (" *", "") if result.gradient_checkpointing else ("", " *")
    reference = [("KL reference: fp32 (+ gathered root)", result.reference)]
    rows = [
        (f"weights: {weights}", result.weights),
        ("gradients: fp32", result.gradients),
        ("optimizer: AdamW, 2 x fp32", result.optimizer),
        *(reference if result.reference else []),
        (f"working parameters: {working}", result.working),
        (f"activations, {result.micro_batch_tokens:,} tokens{off}", result.activations_full),
        ("  of which logits: fp32 forward, log_softmax, grad", result.logits),
        ("  of which attention masks (padded rows)", result.masks),
        (f"activations, gradient checkpointing{on}", result.activations_checkpointed),
        ("optimizer step temporaries (after backward)", result.step_temporaries),
        ("total (peak)", result.total),
    ]
    width = max(len(label) for label, _ in rows) + 2
    checkpointing = "on" if result.gradient_checkpointing else "off"
    return "\n".join(
        [
            f"model       {result.model} ({shape.architecture}, {shape.blocks} blocks)",
            f"parameters  {shape.total_params:,} total, {result.trainable_params:,} "
            f"trainable ({mode})",
            f"layout      {layout}, {result.compute_dtype} compute, "
            f"gradient checkpointing {checkpointing}",
            "",
            f"{'per rank':<{width + 2}}{'GiB':>8}",
            *(f"  {label:<{width}}{_gib(value):>8}" for label, value in rows),
            "",
            _verdict(result),
        ]
    )


def format_json(result: MemoryPlan) -> str:
    """The plan as one JSON line (bytes; parameters as counts)."""
    return json.dumps(result.as_dict(), separators=(",", ":"))


def _verdict(result: MemoryPlan) -> str:
    if result.gpu_memory is None or result.usable is None:
        return "fits        unknown (give --gpu-memory GIB)"
    return (
        f"fits        {'yes' if result.fits else 'NO'}: needs {_gib(result.total)} GiB of "
        f"{_gib(result.usable)} GiB usable ({_gib(result.gpu_memory)} GiB less "
        f"{_gib(CONTEXT_BYTES)} GiB CUDA context and {FRAGMENTATION:.0%} allocator headroom)"
    )


def _summary(result: MemoryPlan) -> str:
    return (
        f"needs {_gib(result.total)} GiB per rank on {result.world_size} rank(s) (weights "
        f"{_gib(result.weights)}, gradients {_gib(result.gradients)}, optimizer "
        f"{_gib(result.optimizer)}, reference {_gib(result.reference)}, working parameters "
        f"{_gib(result.working)}, activations {_gib(result.activations)} at "
        f"micro_batch_tokens {result.micro_batch_tokens}), {_gib(result.usable or 0)} GiB "
        f"usable of {_gib(result.gpu_memory or 0)} GiB"
    )


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f}"
