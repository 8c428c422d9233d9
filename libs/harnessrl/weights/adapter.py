"""LoRA adapters on the wire and on disk: what a version that is an adapter carries.

A trainer that trains low-rank adapters on a frozen base (trainer.lora) publishes only the
adapter pairs, under the names PEFT writes into adapter_model.safetensors:

    base_model.model.<module path>.lora_A.weight    [rank, in_features]
    base_model.model.<module path>.lora_B.weight    [out_features, rank]

and its manifest carries a `LoraAdapter` (rank, alpha, target modules, the base model's name
and checksum). From these an engine applies the version: the project's engine in process
(services/inference/lora_hooks.py), vLLM from a PEFT adapter directory written here
(`write_peft_dir`: adapter_config.json + adapter_model.safetensors), which PEFT's own
`PeftModel.from_pretrained` and vLLM's `/v1/load_lora_adapter` both read.

`base_checksum` identifies the base by its weight files: an adapter applied to another base
would serve nonsense, so engines that can read their base compare it first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights.checksums import DEFAULT_ALGORITHM, digest, hasher
from harnessrl.weights.errors import WeightSyncError

PREFIX = "base_model.model."
"""What PEFT puts before a module path in an adapter's tensor names."""
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PIECES = ((".lora_A.weight", "A"), (".lora_B.weight", "B"))
_READ_BYTES = 16 << 20


def split_name(name: str) -> tuple[str, str]:
    """("model.layers.0.self_attn.q_proj", "A" | "B") of a published adapter tensor name.

    Raises WeightSyncError naming `name` when it is not `base_model.model.<module>.lora_A.
    weight` or `....lora_B.weight`.
    """
    body = name.removeprefix(PREFIX)
    for suffix, piece in _PIECES:
        if name.startswith(PREFIX) and body.endswith(suffix) and len(body) > len(suffix):
            return body.removesuffix(suffix), piece
    raise WeightSyncError(
        f"adapter tensor {name!r}: not a LoRA pair name "
        f"({PREFIX}<module>.lora_A.weight or .lora_B.weight)"
    )


def adapter_line(adapter: pb.LoraAdapter) -> str:
    """The adapter's line in the manifest checksum's input (harnessrl.weights.manifest):
    `adapter \\t rank \\t alpha \\t target,target,... \\t base_model \\t base_checksum \\n`,
    alpha as C's "%.17g" writes it."""
    targets = ",".join(adapter.target_modules)
    return (
        f"adapter\t{adapter.rank}\t{adapter.alpha:.17g}\t{targets}\t{adapter.base_model}\t"
        f"{adapter.base_checksum}\n"
    )


def base_checksum(model_dir: Path, algorithm: str = DEFAULT_ALGORITHM) -> str:
    """A checksum of the model directory's weight files ("" if it has none, or is no
    directory): each `*.safetensors` file is hashed, then the lines `name \\t checksum \\n`
    in name order are. Reads every byte of them (once, in 16 MiB pieces)."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return ""
    lines = []
    for path in files:
        state = hasher(algorithm)
        with path.open("rb") as handle:
            while piece := handle.read(_READ_BYTES):
                state.update(piece)
        lines.append(f"{path.name}\t{algorithm}:{state.hexdigest()}\n")
    return digest("".join(lines).encode(), algorithm)


def check_base(adapter: pb.LoraAdapter, served_checksum: str, what: str) -> None:
    """WeightSyncError naming `what` when the adapter was trained on another base than the
    one served (both checksums known and different)."""
    if adapter.base_checksum and served_checksum and adapter.base_checksum != served_checksum:
        raise WeightSyncError(
            f"{what}: the adapter is for base model {adapter.base_model!r} "
            f"({adapter.base_checksum}), this engine serves another ({served_checksum})"
        )


def peft_config(adapter: pb.LoraAdapter, dropout: float = 0.0) -> dict[str, Any]:
    """The adapter_config.json PEFT (LoraConfig) and vLLM (PEFTHelper) read for `adapter`."""
    alpha = adapter.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": adapter.base_model,
        "r": adapter.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(adapter.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_peft_dir(
    directory: Path,
    adapter: pb.LoraAdapter,
    tensors: Mapping[str, torch.Tensor],
    *,
    dropout: float = 0.0,
) -> Path:
    """Write a PEFT adapter directory at `directory` (replacing one there) and return it.

    Written into a temporary sibling and renamed, so a reader sees the whole directory or
    none. Raises WeightSyncError for a tensor name that is no adapter pair's.
    """
    from safetensors.torch import save_file

    for name in tensors:
        split_name(name)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        weights = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        config = json.dumps(peft_config(adapter, dropout), indent=2, sort_keys=True)
        (tmp / CONFIG_FILE).write_text(config + "\n", encoding="utf-8")
        if directory.exists():
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def read_peft_dir(directory: Path) -> tuple[pb.LoraAdapter, dict[str, torch.Tensor]]:
    """(the adapter's description, its tensors) from a PEFT adapter directory. The base
    checksum is not stored there: it comes back "". Raises OSError, ValueError (bad JSON or
    safetensors) or WeightSyncError (a tensor that is no adapter pair)."""
    from safetensors.torch import load_file

    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    tensors = load_file(str(directory / WEIGHTS_FILE))
    for name in tensors:
        split_name(name)
    targets = config["target_modules"]
    adapter = pb.LoraAdapter(
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        target_modules=sorted([targets] if isinstance(targets, str) else targets),
        base_model=str(config.get("base_model_name_or_path") or ""),
    )
    return adapter, tensors
