"""Test helpers for WeightSync: a fault-injecting proxy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from harnessrl.v1 import weights_pb2 as pb
from harnessrl.v1 import weights_pb2_grpc as pb_grpc
from harnessrl.weights.chunks import GRPC_OPTIONS


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
