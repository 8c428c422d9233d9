"""LoRA versions in the project's engine: adapters applied on the pristine base, exactly as
the trainer's PEFT model computes them.

The base weights are never changed. Each adapted linear layer gets a forward hook that adds
(alpha / rank) * B (A x) to its output with the operations, order and dtypes of PEFT's
`lora.Linear` (x cast to the adapters' dtype, `out + B(A(x)) * scale`, the sum cast back to
the layer's output dtype), so the engine's log-probs equal the trainer's. `LoraOverlay.build`
checks a whole version against the model (every module a linear layer named in the target
modules, both halves of every pair, the shapes) before anything is attached, and the engine
swaps overlays only between steps (engine.py), so a refused version changes nothing.

An engine serving several versions at once (a canary rollout) routes per batch ROW with
`LoraRows`: before each forward it is told which overlay each row gets, and each adapted
module's one hook adds scale * B_v(A_v x) to version v's rows only; rows without an overlay
get the base. A batch whose rows all share one overlay is computed on the whole tensor with
exactly `LoraOverlay`'s operations, so single-version results do not change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.nn import functional

from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights.adapter import split_name


class LoraOverlay:
    """One adapter version: per module path, its (A [r, in], B [out, r]) on the model's
    device, and the scale alpha / r. `attach` hooks it onto a model, `detach` removes it."""

    def __init__(self, pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.pairs = dict(pairs)
        self.scale = scale
        self._handles: list[Any] = []

    @classmethod
    def build(
        cls, model: torch.nn.Module, adapter: pb.LoraAdapter, tensors: Mapping[str, torch.Tensor]
    ) -> LoraOverlay:
        """The overlay of `tensors` (published adapter names) for `model`. Touches nothing.

        Raises ValueError naming the module when it is missing, not linear or not a
        target, a pair is incomplete, or a shape is not [rank, in_features] /
        [out_features, rank]; WeightSyncError for a name that is no LoRA pair's.
        """
        if adapter.rank < 1:
            raise ValueError(f"adapter rank must be at least 1, got {adapter.rank}")
        modules = dict(model.named_modules())
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors.items():
            module, piece = split_name(name)
            halves.setdefault(module, {})[piece] = tensor
        device = next(model.parameters()).device
        pairs = {}
        for path, found in halves.items():
            layer = modules.get(path)
            if not isinstance(layer, torch.nn.Linear):
                kind = "missing" if layer is None else f"a {type(layer).__name__}"
                raise ValueError(f"adapter module {path!r}: {kind} in the model, not a Linear")
            if path.rpartition(".")[2] not in adapter.target_modules:
                raise ValueError(
                    f"adapter module {path!r}: not one of the target modules "
                    f"{list(adapter.target_modules)}"
                )
            if set(found) != {"A", "B"}:
                raise ValueError(f"adapter module {path!r}: has lora_{''.join(found)} only")
            a, b = found["A"], found["B"]
            want_a = (adapter.rank, layer.in_features)
            want_b = (layer.out_features, adapter.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise ValueError(
                    f"adapter module {path!r}: lora_A {tuple(a.shape)} / lora_B "
                    f"{tuple(b.shape)}, expected {want_a} / {want_b}"
                )
            pairs[path] = (a.to(device), b.to(device))
        return cls(pairs, adapter.alpha / adapter.rank)

    def attach(self, model: torch.nn.Module) -> None:
        """Hook every pair onto its module of `model` (which `build` checked)."""
        modules = dict(model.named_modules())
        for path, (a, b) in self.pairs.items():
            self._handles.append(modules[path].register_forward_hook(_adds(a, b, self.scale)))

    def detach(self) -> None:
        """Remove the hooks (idempotent): the model computes the base again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _adds(a: torch.Tensor, b: torch.Tensor, scale: float) -> Any:
    def hook(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> Any:
        x = inputs[0] if inputs[0].dtype == a.dtype else inputs[0].to(a.dtype)
        result = out + functional.linear(functional.linear(x, a), b) * scale  # PEFT's order
        return result.to(out.dtype)

    return hook


class LoraRows:
    """Several overlays on one model, each applied to the batch rows it is routed to.

    Not thread-safe: `hook` and `clear` run between forwards, `route` before each forward in
    the thread that runs it (engine.py keeps both rules).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._modules = dict(model.named_modules())
        self._handles: dict[str, Any] = {}
        self._plan: list[tuple[LoraOverlay, torch.Tensor | None]] = []
        """(overlay, its row indices; None: every row) for the next forward."""

    def hook(self, overlay: LoraOverlay) -> None:
        """Hook every module `overlay` adapts (once per module; a `build`-checked overlay)."""
        for path in overlay.pairs:
            if path not in self._handles:
                module = self._modules[path]
                self._handles[path] = module.register_forward_hook(self._adds(path))

    def route(self, rows: Sequence[LoraOverlay | None], device: torch.device) -> None:
        """Route the next forward's rows: row i gets `rows[i]` (None: the base)."""
        groups: dict[int, tuple[LoraOverlay, list[int]]] = {}
        for index, overlay in enumerate(rows):
            if overlay is not None:
                groups.setdefault(id(overlay), (overlay, []))[1].append(index)
        if len(groups) == 1 and len(next(iter(groups.values()))[1]) == len(rows):
            self._plan = [(next(iter(groups.values()))[0], None)]
            return
        self._plan = [
            (overlay, torch.tensor(indices, dtype=torch.long, device=device))
            for overlay, indices in groups.values()
        ]

    def clear(self) -> None:
        """Remove every hook (idempotent): the model computes the base again."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._plan = []

    def _adds(self, path: str) -> Any:
        def hook(
            module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor
        ) -> Any:
            result = out
            for overlay, rows in self._plan:
                pair = overlay.pairs.get(path)
                if pair is None:
                    continue
                a, b = pair
                x = inputs[0] if inputs[0].dtype == a.dtype else inputs[0].to(a.dtype)
                if rows is None:  # every row: exactly LoraOverlay's hook
                    delta = functional.linear(functional.linear(x, a), b) * overlay.scale
                    return (out + delta).to(out.dtype)
                if result is out:
                    result = out.clone()
                # x, out: [batch, seq, features]; only this version's rows change
                delta = functional.linear(functional.linear(x[rows], a), b) * overlay.scale
                result[rows] = (out[rows] + delta).to(out.dtype)
            return result

        return hook
