"""How much accelerator memory a trainer configuration needs per rank, before loading it.

Parameters are counted exactly on the model built on the meta device (model_shape.py).
Memory is estimated for the step as policy.py and sharding.py run it:

- weights: fp32 master weights, or with LoRA the frozen base in its base dtype plus fp32
  adapters; gradients fp32 and AdamW's two fp32 moments per trainable parameter. Under
  FSDP (strategy fsdp, more than one rank) these three divide by the ranks.
- working parameters: under FSDP, the gathered compute-dtype parameters of two blocks (the
  one computing, the one prefetched) and of the root unit (embeddings, final norm, head:
  kept gathered from forward to backward), and one block's unsharded gradient before its
  reduce-scatter. Replicated under bf16 autocast: the bf16 copy of every fp32 linear
  weight, which autograd holds from the forward to the backward.
- activations: what autograd saves for one micro-batch (see _block_bytes), the attention
  masks and the logits; with gradient checkpointing, each block's input and one block.
- the optimizer step (after the backward: activations freed) needs one more fp32 copy per
  trainable parameter (foreach AdamW), so the peak is the larger of the two phases.

memory_plan.py puts the figures in words and refuses a configuration that cannot fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harnessrl.services.trainer.config import TrainerSection
from harnessrl.services.trainer.model_shape import ModelShape, model_shape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GiB = 1024**3

CONTEXT_BYTES = 1 * GiB
"""Device memory outside PyTorch's allocator: CUDA context, cuBLAS and NCCL workspaces."""

FRAGMENTATION = 0.05
"""Share of the device the caching allocator loses to fragmentation."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Per-rank memory of one configuration, in bytes (see the module docstring)."""

    model: str
    shape: ModelShape
    world_size: int
    sharded: bool
    """FSDP in effect (strategy fsdp and more than one rank)."""
    lora_rank: int | None
    compute_dtype: str
    base_dtype: str
    """Storage of the LoRA base (float32 for full weights)."""
    micro_batch_tokens: int
    gradient_checkpointing: bool
    trainable_params: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    """The frozen KL reference (loss.kl_coef > 0): fp32, sharded like the weights."""
    working: int
    activations_full: int
    activations_checkpointed: int
    logits: int
    """Part of both activation figures."""
    masks: int
    """The blocks' attention masks, part of activations_full."""
    step_temporaries: int
    gpu_memory: int | None
    """Device memory per rank the verdict is against (None: no verdict)."""

    @property
    def activations(self) -> int:
        """Activations at the configured gradient checkpointing."""
        if self.gradient_checkpointing:
            return self.activations_checkpointed
        return self.activations_full

    @property
    def total(self) -> int:
        """Peak: held state plus the larger of the backward pass and the optimizer step."""
        held = self.weights + self.gradients + self.optimizer + self.reference
        return held + max(self.working + self.activations, self.step_temporaries)

    @property
    def usable(self) -> int | None:
        """gpu_memory less the CUDA context and the allocator's fragmentation."""
        if self.gpu_memory is None:
            return None
        return int(self.gpu_memory * (1 - FRAGMENTATION)) - CONTEXT_BYTES

    @property
    def fits(self) -> bool | None:
        usable = self.usable
        return None if usable is None else self.total <= usable

    def as_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("activations", "total", "usable", "fits"):
            data[name] = getattr(self, name)
        return data


def plan(
    config_or_model_dir: PretrainedConfig | Path | str,
    settings: TrainerSection,
    world_size: int,
    gpu_memory_bytes: int | None,
    *,
    device_type: str = "cuda",
) -> MemoryPlan:
    """The per-rank memory of training the model (a config, a model directory or the path
    of its config.json) under `settings` on `world_size` ranks of `device_type` (which
    decides what dtype "auto" means). Raises ValueError when the model cannot be built."""
    import torch

    from harnessrl.services.trainer.lora import base_dtype
    from harnessrl.services.trainer.precision import compute_dtype

    shape = model_shape(config_or_model_dir, settings.lora)
    sharded = world_size > 1 and settings.sharding.strategy == "fsdp"
    device = torch.device(device_type)
    compute = 2 if compute_dtype(settings, device) == torch.bfloat16 else 4
    lora = settings.lora
    base = 4 if lora is None or base_dtype(lora, device) == torch.float32 else 2
    trainable = shape.total_params if lora is None else shape.lora_params
    weights = 4 * trainable if lora is None else base * shape.total_params + 4 * trainable
    ranks = world_size if sharded else 1
    full, checkpointed, logits, masks = _activation_bytes(
        shape, settings.micro_batch_tokens, compute
    )
    reference = 0
    if settings.loss.kl_coef > 0:
        reference = _shard(4 * shape.total_params, ranks)
        if sharded:  # its root unit stays gathered after its forward, too
            reference += compute * shape.root_params
    return MemoryPlan(
        model=str(config_or_model_dir) if isinstance(config_or_model_dir, Path | str) else "",
        shape=shape,
        world_size=world_size,
        sharded=sharded,
        lora_rank=None if lora is None else lora.rank,
        compute_dtype="bfloat16" if compute == 2 else "float32",
        base_dtype="bfloat16" if base == 2 else "float32",
        micro_batch_tokens=settings.micro_batch_tokens,
        gradient_checkpointing=settings.gradient_checkpointing,
        trainable_params=trainable,
        weights=_shard(weights, ranks),
        gradients=_shard(4 * trainable, ranks),
        optimizer=_shard(8 * trainable, ranks),
        reference=reference,
        working=_working_bytes(shape, settings, sharded, compute, base),
        activations_full=full,
        activations_checkpointed=checkpointed,
        logits=logits,
        masks=masks,
        step_temporaries=_shard(4 * trainable, ranks),
        gpu_memory=gpu_memory_bytes,
    )


def _activation_bytes(shape: ModelShape, tokens: int, compute: int) -> tuple[int, int, int, int]:
    """(without checkpointing, with it, the logits part, the masks part of the first) for
    a micro-batch of `tokens` tokens."""
    block = _block_bytes(shape, compute)
    h = shape.hidden
    # The final norm's fp32 input and output, and the head's input (a bf16 cast or shared).
    head = 8 * h + (2 * h if compute == 2 else 4 * h)
    # fp32 forward, log_softmax and grad; beside them, the entropy statistic's chunk (~16
    # bytes an element: the gathered rows, scaled, log-probs, their product).
    from harnessrl.trust.loss import ENTROPY_CHUNK_ELEMENTS

    rows = max(1, ENTROPY_CHUNK_ELEMENTS // shape.vocab)
    logits = 3 * 4 * tokens * shape.vocab + 16 * min(tokens, rows) * shape.vocab
    common = tokens * (8 + head) + logits  # 8: the int64 input ids
    # Padded rows make transformers pass SDPA a [B, 1, T, T] boolean mask, which SDPA
    # converts to the compute dtype in every block (and saves). B * T * T is at most
    # tokens**2 / 2: two rows of half the tokens (a single row has no padding, no mask).
    pairs = tokens * tokens // 2
    masks = shape.blocks * compute * pairs
    full = tokens * shape.blocks * block + masks + common
    # A checkpointed block keeps its fp32 input (and the boolean mask); one block at a
    # time is recomputed.
    checkpointed = tokens * (shape.blocks * 4 * h + block) + pairs + compute * pairs + common
    return full, checkpointed, logits, masks


def _block_bytes(shape: ModelShape, compute: int) -> int:
    """Bytes autograd saves per token in one decoder block: counted with
    saved_tensors_hooks on transformers' Llama-family blocks (the residual stream is fp32,
    as the embedding output is). Under bf16 autocast each linear casts its input apart
    (26h: each RMSNorm's fp32 input and output, then bf16 copies for q, k, v, gate and up);
    with a padding mask SDPA takes no grouped keys, so k and v are saved repeated to the
    query width. LoRA saves about as much: a frozen linear saves no input, its adapter
    does. Per-head scalars (norm factors, log-sum-exp) are left out."""
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_width, shape.kv_width
    norm = 1 if shape.qk_norm else 0
    if compute == 2:
        # q: its norm (fp32 in, bf16 out); bf16 q, repeated k and v, and the output
        return 26 * h + (8 + 6 * norm) * q + 6 * norm * kv + 8 * i
    return 24 * h + (16 + 8 * norm) * q + 8 * norm * kv + 16 * i


def _working_bytes(
    shape: ModelShape, settings: TrainerSection, sharded: bool, compute: int, base: int
) -> int:
    if sharded:
        trained = shape.block_params if settings.lora is None else shape.block_lora_params
        reduce = 4 if settings.sharding.reduce_dtype == "float32" else 2
        block = shape.block_params + shape.block_lora_params
        return compute * (2 * block + shape.root_params) + (compute + reduce) * trained
    if compute == 4:
        return 0
    copied = shape.linear_params if base == 4 else 0  # a bf16 LoRA base is used as it is
    return 2 * (copied + shape.lora_params)


def _shard(nbytes: int, ranks: int) -> int:
    return math.ceil(nbytes / ranks)
