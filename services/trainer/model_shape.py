"""What the memory plan knows of a model: its parameters and widths, measured on a build on
the meta device (no weights read, any architecture transformers knows; tied weights once).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl.services.trainer.config import LoraSection

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the memory plan needs to know of a model (from its meta-device build)."""

    architecture: str
    total_params: int
    lora_params: int
    """Adapter parameters (rank * (in + out) per targeted linear); 0 without LoRA."""
    linear_params: int
    """Weights of the nn.Linear layers (what bf16 autocast copies)."""
    block_params: int
    """Parameters of the largest transformer block (one FSDP unit)."""
    block_lora_params: int
    root_params: int
    """Parameters outside every block (the FSDP root unit)."""
    blocks: int
    hidden: int
    intermediate: int
    q_width: int
    """Query heads * head dim."""
    kv_width: int
    """Key/value heads * head dim."""
    vocab: int
    qk_norm: bool
    """Blocks normalise queries and keys per head (Qwen3)."""


def model_shape(source: PretrainedConfig | Path | str, lora: LoraSection | None) -> ModelShape:
    """Build the model on the meta device and measure it (no weights are read). Raises
    ValueError for a path that is not a model directory or config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    from harnessrl.services.trainer.sharding import blocks

    if isinstance(source, PretrainedConfig):
        config = source
    else:
        if not Path(source).exists():  # else transformers would look it up on the Hub
            raise ValueError(f"{source}: no such model directory or config.json")
        try:
            config = AutoConfig.from_pretrained(source)
        except (OSError, ValueError) as err:
            raise ValueError(f"{source}: not a model directory or config.json ({err})") from err
    with torch.device("meta"):
        # transformers leaves from_config untyped
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    found = list(blocks(model))
    if not found:
        raise ValueError(f"{type(model).__name__}: no transformer blocks (_no_split_modules)")
    sizes = [_count(b) for b in found]
    biggest = found[sizes.index(max(sizes))]
    prefix = next(n for n, m in model.named_modules() if m is biggest) + "."
    adapters = _adapters(model, lora)
    linears = {
        id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
    }
    text = config.get_text_config()
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    return ModelShape(
        architecture=type(model).__name__,
        total_params=_count(model),
        lora_params=sum(adapters.values()),
        linear_params=sum(linears.values()),  # a tied head's weight once
        block_params=max(sizes),
        block_lora_params=sum(n for name, n in adapters.items() if name.startswith(prefix)),
        root_params=_count(model) - sum(sizes),
        blocks=len(found),
        hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        q_width=heads * head_dim,
        kv_width=int(getattr(text, "num_key_value_heads", None) or heads) * head_dim,
        vocab=int(text.vocab_size),
        qk_norm=any(n.rsplit(".", 1)[-1] == "q_norm" for n, _ in biggest.named_modules()),
    )


def _adapters(model: torch.nn.Module, lora: LoraSection | None) -> dict[str, int]:
    """Adapter parameters by linear module name (rank * (in + out) each)."""
    import torch

    if lora is None:
        return {}
    targets = set(lora.target_modules)
    return {
        name: lora.rank * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied one once
