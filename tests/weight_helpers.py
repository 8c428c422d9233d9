"""Test helpers for WeightSync: a small state dict, bit-exact comparison, a fault-injecting
proxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import torch

from harnessrl.v1 import weights_pb2 as pb
from harnessrl.v1 import weights_pb2_grpc as pb_grpc
from harnessrl.weights.chunks import GRPC_OPTIONS
from harnessrl.weights.manifest import byte_view


def state_dict(dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A small decoder-like state dict; different seeds give different values."""
    generator = torch.Generator().manual_seed(seed)
    state = {
        "model.embed_tokens.weight": torch.randn(64, 32, generator=generator).to(dtype),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(32, 32, generator=generator).to(
            dtype
        ),
        "model.layers.0.input_layernorm.weight": torch.ones(32, dtype=dtype),
        "model.norm.weight": torch.randn(32, generator=generator).to(dtype),
    }
    if dtype == torch.float32:  # bit patterns that == would not tell apart
        state["model.norm.weight"][:3] = torch.tensor([float("nan"), -0.0, float("inf")])
    return state


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names in the same order, same dtypes and shapes, same bytes."""
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and bytes(byte_view(a[k].contiguous())) == bytes(byte_view(b[k].contiguous()))
        for k in a
    )


class FaultInjector(pb_grpc.WeightSyncServicer):
    """Test-only fault injector: a WeightSync proxy that corrupts the Fetch stream.

    It forwards every call to the real server through the generated stub (so it is also a
    plain protobuf implementation of the contract) and applies `fault` to the chunks.
    """

    def __init__(self, upstream: str, fault: str) -> None:
        self._channel = grpc.aio.insecure_channel(upstream, options=list(GRPC_OPTIONS))
        self._stub = pb_grpc.WeightSyncStub(self._channel)
        self._fault = fault
        self.stalled = asyncio.Event()
        self.cancelled = asyncio.Event()

    async def GetLatest(self, request: Any, context: Any) -> pb.WeightManifest:
        return await self._stub.GetLatest(request)

    async def GetManifest(self, request: Any, context: Any) -> pb.WeightManifest:
        return await self._stub.GetManifest(request)

    async def Fetch(self, request: Any, context: Any) -> AsyncIterator[pb.WeightChunk]:
        chunks = [c async for c in self._stub.Fetch(request)]
        victim = 2  # the third chunk of the first tensor
        if self._fault == "flip":
            data = bytearray(chunks[victim].data)
            data[5] ^= 0x10
            chunks[victim].data = bytes(data)
        elif self._fault == "drop":
            del chunks[victim]
        elif self._fault == "drop-last":
            del chunks[-1]
        elif self._fault == "duplicate":
            chunks.insert(victim, chunks[victim])
        elif self._fault == "rename":
            chunks[victim].tensor = "model.ghost.weight"
        elif self._fault == "out-of-range":
            chunks[victim].offset += 10_000
        for i, chunk in enumerate(chunks):
            if self._fault == "stall" and i == victim:
                self.stalled.set()
                try:
                    await asyncio.Event().wait()  # never sends the rest
                finally:
                    self.cancelled.set()
            yield chunk
