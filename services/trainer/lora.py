"""Low-rank adapters on a frozen base (trainer.lora), with PEFT.

    model = apply_lora(model, settings.lora, device=device)   # in Policy.load
    published = adapter_tensors(model.state_dict())          # what a version publishes

Only the adapter pairs train (the optimizer takes the parameters that require grad) and only
they are published: under the names PEFT writes into adapter_model.safetensors
(`published_name`), with a `LoraAdapter` in the manifest (`adapter_spec`), so a directory
written from them (`write_adapter_dir`) loads with PEFT's own loader and with vLLM's
/v1/load_lora_adapter. PEFT initialises B to zero, so the first policy is exactly the base
model and the first pass's log-probs equal the engine's.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from harnessrl.services.trainer.config import LoraSection
from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights.adapter import base_checksum, peft_config, read_peft_dir, write_peft_dir
from harnessrl.weights.checksums import DEFAULT_ALGORITHM

ADAPTER = "default"
"""PEFT's name for the one adapter; it appears in the model's state-dict keys only."""


def base_dtype(settings: LoraSection, device: torch.device) -> torch.dtype:
    """What the frozen base is stored in: base_dtype, auto meaning bf16 on CUDA, else fp32."""
    if settings.base_dtype == "bfloat16" or (
        settings.base_dtype == "auto" and device.type == "cuda"
    ):
        return torch.bfloat16
    return torch.float32


def apply_lora(model: Any, settings: LoraSection, *, device: torch.device | str = "cpu") -> Any:
    """`model` (a transformers causal LM) wrapped as a PEFT model: every base weight frozen
    and cast to the base dtype, an adapter pair on each target module, float32, B zero.

    Raises ValueError (PEFT's) when no module matches `settings.target_modules`.
    """
    from peft import LoraConfig, get_peft_model

    model.to(dtype=base_dtype(settings, torch.device(device)))
    config = LoraConfig(
        r=settings.rank,
        # PEFT annotates int, yet only divides by it (scaling = alpha / r): a float is fine.
        lora_alpha=settings.alpha,  # type: ignore[arg-type]
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, config, adapter_name=ADAPTER)
    for parameter in wrapped.parameters():
        if parameter.requires_grad:  # only the adapters: AdamW keeps float32 state for them
            parameter.data = parameter.data.to(torch.float32)
    return wrapped


def published_name(state_key: str) -> str | None:
    """The name a state-dict key is published under, or None when it is not published.

    Only adapter tensors are: `base_model.model.<module>.lora_A.default.weight` is published
    as `base_model.model.<module>.lora_A.weight` (likewise lora_B), PEFT's own file names.
    """
    for piece in ("lora_A", "lora_B"):
        marker = f".{piece}.{ADAPTER}."
        if marker in state_key and state_key.endswith(f"{marker}weight"):
            return state_key.replace(marker, f".{piece}.")
    return None


def adapter_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The published tensors of a LoRA model's state dict, under their published names, in
    state-dict order (the tensors themselves, not copies)."""
    published = {}
    for key, tensor in state.items():
        name = published_name(key)
        if name is not None:
            published[name] = tensor
    return published


def adapter_spec(
    settings: LoraSection, base_model_dir: Path, *, algorithm: str = DEFAULT_ALGORITHM
) -> pb.LoraAdapter:
    """The manifest's description of the adapters. Reads every weight file of the base
    model once (its checksum); "" as the checksum when the directory has none."""
    return _described(settings, base_model_dir, base_checksum(base_model_dir, algorithm))


def adapter_config(settings: LoraSection, base_model_dir: Path) -> dict[str, Any]:
    """The adapter_config.json of these adapters (PEFT's LoraConfig fields)."""
    return peft_config(_described(settings, base_model_dir), settings.dropout)


def write_adapter_dir(
    directory: Path, model: torch.nn.Module, settings: LoraSection, base_model_dir: Path
) -> Path:
    """Write the LoRA `model`'s adapters as a PEFT adapter directory (atomically, replacing
    one there): `PeftModel.from_pretrained(base, directory)` and vLLM load it."""
    spec = _described(settings, base_model_dir)
    tensors = adapter_tensors(model.state_dict())
    return write_peft_dir(directory, spec, tensors, dropout=settings.dropout)


def read_adapter_dir(directory: Path, model: torch.nn.Module) -> None:
    """Load a PEFT adapter directory's tensors into the LoRA `model`'s adapters (in place).

    Raises ValueError naming the tensors when the directory's adapters are not exactly the
    model's (missing, unknown or mis-shaped), before anything is changed.
    """
    _, tensors = read_peft_dir(directory)
    copy_exactly(tensors, adapter_tensors(model.state_dict()), str(directory))


def copy_exactly(
    tensors: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], what: str
) -> None:
    """Copy `tensors` into the live `targets` of the same names. Raises ValueError naming
    the tensors, before any is changed, unless the names, shapes and dtypes are exactly the
    targets'."""
    unknown = sorted(set(tensors) - set(targets))
    missing = sorted(set(targets) - set(tensors))
    wrong = sorted(
        n
        for n in set(tensors) & set(targets)
        if tensors[n].shape != targets[n].shape or tensors[n].dtype != targets[n].dtype
    )
    if unknown or missing or wrong:
        raise ValueError(
            f"{what}: tensors do not fit the model: unknown {unknown[:3]}, missing "
            f"{missing[:3]}, mis-shaped or of another dtype {wrong[:3]}"
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            targets[name].copy_(tensor)


def _described(settings: LoraSection, base_model_dir: Path, checksum: str = "") -> pb.LoraAdapter:
    return pb.LoraAdapter(
        rank=settings.rank,
        alpha=settings.alpha,
        target_modules=sorted(settings.target_modules),
        base_model=str(base_model_dir),
        base_checksum=checksum,
    )
