"""The model being trained: loaded, sharded, stepped, saved and published.

    policy = Policy.load(settings, world)
    stats = policy.step(batch.samples)       # every rank, the same samples

The step itself is harnessrl.trust.step (weights, packing, forward and backward, clip, one
AdamW step); this module gives it the model, the optimiser, and the ranks' way of sharing
the work. The weights stay float32; on CUDA the forward runs under bf16 autocast.
"""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harnessrl.logs import get_logger
from harnessrl.services.trainer import tensors
from harnessrl.services.trainer.config import TrainerSection
from harnessrl.services.trainer.distributed import World
from harnessrl.services.trainer.lora import adapter_tensors, apply_lora, copy_exactly
from harnessrl.services.trainer.memory_plan import check_fits
from harnessrl.services.trainer.precision import compute_dtype
from harnessrl.services.trainer.sharding import full, is_sharded, shard
from harnessrl.trust.loss import LossSettings
from harnessrl.trust.packing import MicroBatch, SampleArrays
from harnessrl.trust.step import StepSettings, StepStats, step

log = get_logger(__name__)


class Policy:
    def __init__(
        self,
        settings: TrainerSection,
        model: torch.nn.Module,
        world: World,
        device: torch.device,
        reference: torch.nn.Module | None = None,
    ) -> None:
        self.settings = settings
        self.model = model
        self.world = world
        self.device = device
        self.reference = reference
        self.optimizer, self.scheduler = self._fresh_optimizer()
        loss = settings.loss
        self.step_settings = StepSettings(
            normalization=loss.normalization,
            constant_tokens=loss.constant_tokens,
            micro_batch_tokens=settings.micro_batch_tokens,
            grad_clip=settings.grad_clip,
            loss=LossSettings(
                clip_low=loss.clip_low,
                clip_high=loss.clip_high,
                ratio_cap=loss.ratio_cap,
                kl_coef=loss.kl_coef,
            ),
        )

    def _fresh_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        """AdamW over the trainable parameters, no state yet, and its warm-up schedule."""
        settings = self.settings
        optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
        )
        warmup = settings.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        return optimizer, scheduler

    @property
    def vocab_size(self) -> int:
        """Rows of the input embedding: every token id trained on must be below it."""
        embedding: Any = self.model.get_input_embeddings()  # type: ignore[operator]
        return int(embedding.num_embeddings)

    @classmethod
    def load(cls, settings: TrainerSection, world: World | None = None) -> Policy:
        """The initial policy from `settings.model` (resume from a checkpoint separately)."""
        from transformers import AutoModelForCausalLM

        device = device_for(settings.device)
        world = world or World.from_env(device)
        check_fits(settings, world.size, device)
        seed_everything(settings.seed)
        loaded = AutoModelForCausalLM.from_pretrained(settings.model, dtype=torch.float32)
        if settings.lora is not None:  # adapters only, on a frozen base
            loaded = apply_lora(loaded, settings.lora, device=device)
        if settings.gradient_checkpointing:
            loaded.gradient_checkpointing_enable()  # type: ignore[no-untyped-call]
        model: torch.nn.Module = loaded
        model.to(device)
        model.train()
        fsdp = world.size > 1 and settings.sharding.strategy == "fsdp"
        if fsdp:
            shard(model, settings.sharding, compute_dtype(settings, device))
        reference: torch.nn.Module | None = None
        if settings.loss.kl_coef > 0:
            frozen: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
                settings.reference_model or settings.model, dtype=torch.float32
            )
            reference = frozen.to(device)
            reference.eval().requires_grad_(False)
            if fsdp:
                shard(reference, settings.sharding, compute_dtype(settings, device))
        return cls(settings, model, world, device, reference)

    def step(self, samples: list[SampleArrays]) -> StepStats:
        """One optimiser step on `samples` (the whole batch; every rank passes the same)."""
        return step(
            self.model,
            self.optimizer,
            self.scheduler,
            samples,
            self.step_settings,
            device=self.device,
            reference=self.reference,
            autocast=self._autocast,
            ranks=_WorldRanks(self),
        )

    @property
    def sharded(self) -> bool:
        """The model is split across the ranks (FSDP2): parameters are DTensors."""
        return is_sharded(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors a version publishes, by name (DTensors when sharded: gather each with
        `full`, on every rank in the same order, see `gather`); under trainer.lora only the
        adapter pairs, under PEFT's file names (lora.published_name)."""
        state = self.model.state_dict()
        return state if self.settings.lora is None else adapter_tensors(state)

    def gather(self) -> None:
        """A follower's part of a publication: all-gather every published tensor, in
        `state_dict()` order, alongside the leader (which copies them as they come)."""
        for tensor in self.state_dict().values():
            full(tensor)

    def follow(self, command: tuple[str, Any]) -> None:
        """Run a command the leader shared (see `everywhere`) on a follower rank."""
        name, argument = command
        if name not in _COMMANDS:
            raise ValueError(f"unknown trainer command {name!r}")
        getattr(self, name)(*argument)

    def everywhere(self, name: str, *argument: Any) -> Any:
        """Leader: run method `name(*argument)` on every rank (followers first hear of it
        through `World.share`, then all run it together); returns the leader's result."""
        if self.world.size > 1:
            self.world.share((name, argument))
        return getattr(self, name)(*argument)

    def save_tensors(self, directory: Path) -> None:
        """Collective: write the model's and optimizer's state (this rank's shards) under
        `directory`/dcp, and on the leader the scheduler and an exported model directory
        (`directory` itself loads with `from_pretrained`). See checkpoint.py."""
        tensors.save(self.model, self.optimizer, self.scheduler, directory, self.world)

    def load_tensors(self, directory: Path) -> None:
        """Collective: restore what `save_tensors` wrote, at any world size."""
        tensors.load(self.model, self.optimizer, self.scheduler, directory)

    def rewind(self, weights: Path) -> None:
        """Collective: load a published version's tensors (a safetensors file under their
        published names, services/trainer/archive.py) into the model, and start a fresh
        optimiser and warm-up: a canary rollback returns training to the stable version, and
        the moments the retired line accumulated must not steer it. Raises ValueError naming
        the tensors when the file's are not exactly what this model publishes (before any
        is changed); NotImplementedError for a sharded model (FSDP)."""
        from safetensors.torch import load_file

        if self.sharded:
            raise NotImplementedError(
                "rewinding a sharded (FSDP) trainer is not supported under production.canary"
            )
        copy_exactly(load_file(str(weights)), self.state_dict(), str(weights))
        self.optimizer, self.scheduler = self._fresh_optimizer()

    def _autocast(self) -> Any:
        if compute_dtype(self.settings, self.device) == torch.bfloat16:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


_COMMANDS = frozenset({"step", "gather", "save_tensors", "load_tensors", "rewind"})


class _WorldRanks:
    """The trainer's ranks, for the step (trust/step.py): data-parallel, where each rank
    holds the whole model and gradients are all-reduced after the backward passes, or FSDP2,
    where parameters are sharded and reduce-scattered during them."""

    def __init__(self, policy: Policy) -> None:
        self.world = policy.world
        self.sharded = policy.sharded

    def share(self, batches: list[MicroBatch]) -> list[MicroBatch]:
        """This rank's micro-batches. Under FSDP every rank must run as many forward and
        backward passes as the others (each one is a collective), so the short ranks add
        idle passes: a real row with every weight 0, which adds 0 to gradients and stats."""
        mine = batches[self.world.rank :: self.world.size]
        if not self.sharded or not batches:
            return mine
        rounds = -(-len(batches) // self.world.size)
        return mine + [idle(batches[-1])] * (rounds - len(mine))

    def sum_gradients(self, model: torch.nn.Module) -> None:
        if not self.sharded:  # FSDP reduce-scattered them during the backward passes
            self.world.sum_gradients(model.parameters())

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return self.world.sum(values)

    def whole(self, value: torch.Tensor) -> torch.Tensor:
        return full(value)


def idle(batch: MicroBatch) -> MicroBatch:
    """One row of `batch` that trains nothing: no loss mask, weight 0."""
    row = slice(0, 1)
    return replace(
        batch,
        input_ids=batch.input_ids[row],
        attention_mask=batch.attention_mask[row],
        loss_mask=torch.zeros_like(batch.loss_mask[row]),
        behavior=torch.zeros_like(batch.behavior[row]),
        advantages=torch.zeros_like(batch.advantages[row]),
        weights=torch.zeros_like(batch.weights[row]),
        temperature=batch.temperature[row],
        sample_ids=(),
    )


def device_for(choice: str) -> torch.device:
    """The device `choice` names. Under torchrun each rank takes the GPU of its LOCAL_RANK
    (made current, so NCCL and every later allocation use it), never all of them GPU 0."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            return torch.device("cuda", 0)  # fails, with torch's own message, on first use
        local = os.environ.get("LOCAL_RANK")
        if local is not None:
            torch.cuda.set_device(int(local))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # libraries below draw from numpy's global state
    torch.manual_seed(seed)
