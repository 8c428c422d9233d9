"""The trainer's tensors on disk: training state through `torch.distributed.checkpoint`,
and a model directory the engines load.

Inside one checkpoint directory (checkpoint.py owns the directory and its atomicity):

    dcp/            model + optimizer state, one file per rank plus `.metadata` (DCP's
                    format): each rank writes its own shards, and a checkpoint written by N
                    ranks loads at any world size (DCP reshards on load)
    scheduler.pt    the LR scheduler's state (the same on every rank)
    config.json, model*.safetensors[, model.safetensors.index.json]
                    the exported model: `from_pretrained(directory)` and vLLM load it

Frozen parameters are not part of the training state: a LoRA checkpoint holds the
adapters' state, and its export is the PEFT adapter directory (adapter_config.json,
adapter_model.safetensors), which PEFT and vLLM load on top of the base. A sharded model is
exported one tensor at a time: each is all-gathered (every rank takes part), the leader
appends it to the current safetensors file, and starts a new file every
`shard_bytes`; no rank ever holds the whole model at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file, save_model
from torch.distributed.checkpoint.api import CheckpointException

from harnessrl.services.trainer.distributed import World
from harnessrl.services.trainer.sharding import full, is_sharded

DCP = "dcp"
SCHEDULER = "scheduler.pt"
INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 << 30
"""Largest exported safetensors file (about 2 GiB, as transformers writes them)."""


def save(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    directory: Path,
    world: World,
) -> None:
    """Collective (every rank, the same `directory`, on storage all ranks share): write the
    training state and export the model (see the module docstring)."""
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    directory.mkdir(parents=True, exist_ok=True)  # every rank: none waits for the leader
    model_state, optimizer_state = _state(model, optimizer)
    try:
        dcp_save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / DCP
        )
    except CheckpointException as err:
        raise _cause(err) from err
    if world.leader and scheduler is not None:
        torch.save(scheduler.state_dict(), directory / SCHEDULER)
    export(model, directory, world)


def load(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, directory: Path
) -> None:
    """Collective: restore the state `save` wrote into `model`, `optimizer` and
    `scheduler` (every trainable key must be in the checkpoint; RuntimeError otherwise).
    Raises ValueError for a directory without DCP state (a checkpoint from before this
    format) or without the scheduler state asked for."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    if not (directory / DCP / ".metadata").is_file():
        raise ValueError(f"{directory}: no {DCP}/ training state (an older checkpoint format)")
    if scheduler is not None and not (directory / SCHEDULER).is_file():
        raise ValueError(f"checkpoint {directory} has no scheduler state to load")
    model_state, optimizer_state = _state(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp_load(state, checkpoint_id=directory / DCP)
    except (CheckpointException, RuntimeError) as err:
        raise RuntimeError(f"checkpoint {directory} does not match the model: {err}") from err
    # Not strict: the state holds no frozen parameter (a LoRA model's whole base), which a
    # strict load would call missing; every key it does hold was required by dcp_load.
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(directory / SCHEDULER, weights_only=True))


def writer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
) -> Callable[[Path], None]:
    """`Checkpoints.save`'s tensor writer for one process."""
    return lambda directory: save(model, optimizer, scheduler, directory, World())


def reader(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None
) -> Callable[[Path], None]:
    """`Checkpoints.load`'s tensor reader for one process."""
    return lambda directory: load(model, optimizer, scheduler, directory)


def export(model: torch.nn.Module, directory: Path, world: World) -> None:
    """Collective: write `model` as a model directory into `directory` (leader only writes;
    under FSDP every rank gathers). A model that is not sharded is saved with its own
    `save_pretrained`."""
    if getattr(model, "peft_config", None) is not None:  # LoRA: a PEFT adapter directory
        from harnessrl.services.trainer.lora import published_name

        adapters = {
            key: full(tensor.detach())  # every rank, in the same order
            for key, tensor in model.state_dict().items()
            if published_name(key) is not None
        }
        if world.leader:
            model.save_pretrained(directory, state_dict=adapters)  # type: ignore[operator]
        return
    if not is_sharded(model):
        save_pretrained = getattr(model, "save_pretrained", None)
        if not world.leader:
            return
        if callable(save_pretrained):
            save_pretrained(directory)  # safetensors, with config.json beside it
        else:  # a plain module; save_model drops aliases of shared tensors
            save_model(model, str(directory / "model.safetensors"))
        return
    writer = _ShardWriter(directory, SHARD_BYTES) if world.leader else None
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied weight (the same parameter): stored once
            continue
        seen.add(id(tensor))
        whole = full(tensor.detach())  # every rank, in the same order
        if writer is not None:
            writer.add(name, whole)
    if writer is not None:
        writer.close()
        config: Any = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(directory)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)


def _cause(err: Any) -> BaseException:
    """What failed inside DCP (it wraps every rank's error in a CheckpointException, a
    BaseException: `except Exception` would not see it): this rank's own error, else a
    RuntimeError with DCP's message."""
    failures = getattr(err, "failures", {}) or {}
    for wrapped in failures.values():
        if isinstance(wrapped, tuple) and wrapped and isinstance(wrapped[0], Exception):
            return wrapped[0]
    return RuntimeError(str(err))


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))


class _ShardWriter:
    """safetensors files of at most `limit` bytes (one tensor over it is a file alone),
    and the index transformers reads when there is more than one."""

    def __init__(self, directory: Path, limit: int) -> None:
        self._directory = directory
        self._limit = limit
        self._pending: dict[str, torch.Tensor] = {}
        self._bytes = 0
        self._count = 0
        self._weight_map: dict[str, str] = {}
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._bytes + size > self._limit:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._bytes += size
        self._total += size

    def _flush(self) -> None:
        self._count += 1
        file = f"model-{self._count:05d}.safetensors"
        save_file(self._pending, str(self._directory / file), metadata={"format": "pt"})
        self._weight_map.update(dict.fromkeys(self._pending, file))
        self._pending, self._bytes = {}, 0

    def close(self) -> None:
        self._flush()
        if self._count == 1:
            (self._directory / "model-00001.safetensors").rename(
                self._directory / "model.safetensors"
            )
            return
        index = {"metadata": {"total_size": self._total}, "weight_map": self._weight_map}
        (self._directory / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
