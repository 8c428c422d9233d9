"""The policy versions one engine serves: full weights copied into the model, and LoRA
adapters applied on its base, one or several at once (a canary rollout).

`ServedVersions` maps each version served to its adapter (None: the model's own weights)
and routes every batch row to its version's adapter (lora_hooks.LoraRows). Its threading
rule, kept by engine.py: hooks change only in the thread that runs forwards, between two of
them (`replace` runs while no step does; an `add`ed adapter is hooked by `route`, before the
first forward that can carry a request for it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from harnessrl.services.inference.lora_hooks import LoraOverlay, LoraRows


class ServedVersions:
    """Version -> adapter (None: the model's weights), and the versions being removed."""

    def __init__(self, model: torch.nn.Module, version: int) -> None:
        self._adapters: dict[int, LoraOverlay | None] = {version: None}
        self._retiring: set[int] = set()
        """Refused to new requests, still served to those that have them."""
        self._rows = LoraRows(model)
        self._unhooked: deque[LoraOverlay] = deque()

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions a request may ask for, ascending."""
        return tuple(sorted(set(self._adapters) - self._retiring))

    def held(self, version: int) -> bool:
        """Whether `version` is served, being removed or not."""
        return version in self._adapters

    def replace(self, version: int, overlay: LoraOverlay | None) -> None:
        """Serve `version` alone (no step may run meanwhile)."""
        self._rows.clear()
        self._unhooked.clear()
        if overlay is not None:
            self._rows.hook(overlay)
        self._adapters = {version: overlay}
        self._retiring.clear()

    def add(self, version: int, overlay: LoraOverlay) -> None:
        """Serve `version` beside the others; hooked before the next forward."""
        self._unhooked.append(overlay)
        self._adapters[version] = overlay
        self._retiring.discard(version)

    def retire(self, version: int) -> None:
        """Refuse `version` to new requests (requests holding it are still served)."""
        self._retiring.add(version)

    def forget(self, version: int) -> None:
        """Stop serving a retired `version` (no request may hold it any more)."""
        if version in self._retiring:  # not served again meanwhile
            self._retiring.discard(version)
            del self._adapters[version]

    def route(self, versions: Sequence[int], device: torch.device) -> None:
        """Row i of the next forward gets the adapter of `versions[i]` (forward thread)."""
        while self._unhooked:
            self._rows.hook(self._unhooked.popleft())
        self._rows.route([self._adapters.get(v) for v in versions], device)

    def clear(self) -> None:
        """Remove every hook: the model computes its own weights again."""
        self._rows.clear()


def copy_full_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a full version into `model`. Raises ValueError (unknown, missing or mis-shaped
    tensors) before anything changes."""
    with torch.no_grad():
        current = model.state_dict()
        unknown = sorted(set(state_dict) - set(current))
        missing = sorted(set(current) - set(state_dict) - _tied(model))
        if unknown or missing:
            raise ValueError(
                f"state dict does not fit the model: unknown {unknown[:5]}, missing {missing[:5]}"
            )
        for name, tensor in state_dict.items():
            if tuple(tensor.shape) != tuple(current[name].shape):
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)} does not match the "
                    f"model's {tuple(current[name].shape)}"
                )
        for name, tensor in state_dict.items():
            current[name].copy_(tensor)


def _tied(model: Any) -> set[str]:
    """Parameter names the model ties to others (they need not be in a state dict)."""
    keys = getattr(model, "_tied_weights_keys", None) or ()
    if isinstance(keys, dict):
        return set(keys)
    return set(keys)
