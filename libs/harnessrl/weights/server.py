"""The trainer's WeightSync gRPC server (grpc.aio).

    server = WeightSyncServer(WeightSyncSettings(port=0, shared_memory=True))
    await server.start()
    manifest = await server.publish(version=7, step=700, state_dict=model.state_dict())
    ...
    await server.stop()

Fetch streams each version from the one contiguous buffer the server holds: a chunk is the
encoded field headers joined with a memoryview slice of that buffer (one copy, into the
`bytes` gRPC sends). GetLatest before the first publish answers FAILED_PRECONDITION; an
unknown or evicted version answers NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, NoReturn

import grpc
import torch

from harnessrl.logs import get_logger
from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights.chunks import GRPC_OPTIONS, encode_chunk, tensor_field
from harnessrl.weights.settings import WeightSyncSettings
from harnessrl.weights.store import HeldVersion, VersionStore, snapshot

log = get_logger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["WeightSync"].full_name


def _identity(message: bytes) -> bytes:
    return message


async def _abort(context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the call with `code` (grpc.aio's abort raises; this says so to the type checker)."""
    await context.abort(code, details)
    raise AssertionError("unreachable: ServicerContext.abort raises")


class WeightSyncServer:
    """Serves the newest `settings.keep_versions` published versions, and the protected
    ones, over gRPC.

    `start()` and `stop()` are idempotent; `publish()` may be called before `start()`.
    """

    def __init__(self, settings: WeightSyncSettings | None = None) -> None:
        self._settings = settings or WeightSyncSettings()
        self._store = VersionStore(self._settings.keep_versions)
        self._publish_lock = asyncio.Lock()
        self._server: grpc.aio.Server | None = None
        self._port = self._settings.port

    @property
    def address(self) -> str:
        """host:port pullers connect to (the bound port once started, when port was 0)."""
        return f"{self._settings.host}:{self._port}"

    @property
    def versions(self) -> list[int]:
        """Versions currently served, oldest first."""
        return self._store.versions

    @property
    def protected(self) -> frozenset[int]:
        """Versions never evicted, whatever is published after them (`protect`)."""
        return self._store.protected

    def protect(self, versions: frozenset[int] | set[int]) -> None:
        """Keep serving `versions` (replacing the previous set) however many newer ones are
        published: a canary rollout's stable and candidate, which an engine restarted
        mid-canary pulls again. A protected version not held may be published out of
        order (`publish`); one that loses its protection is evicted once beyond
        `keep_versions`."""
        self._store.protect(versions)

    def manifest(self, version: int) -> pb.WeightManifest | None:
        """A copy of held `version`'s manifest, or None when not held."""
        held = self._store.get(version)
        if held is None:
            return None
        manifest = pb.WeightManifest()
        manifest.CopyFrom(held.manifest)
        return manifest

    def published(self, version: int) -> tuple[pb.WeightManifest, dict[str, torch.Tensor]] | None:
        """A copy of held `version`'s manifest and tensors (CPU), or None when not held."""
        held = self._store.get(version)
        manifest = self.manifest(version)
        if held is None or manifest is None:
            return None
        return manifest, held.tensors()

    async def start(self) -> None:
        """Bind and start serving (idempotent)."""
        if self._server is not None:
            return
        server = grpc.aio.server(options=list(GRPC_OPTIONS))
        handlers = {
            "GetLatest": grpc.unary_unary_rpc_method_handler(
                self._get_latest,
                request_deserializer=pb.GetLatestRequest.FromString,
                response_serializer=pb.WeightManifest.SerializeToString,
            ),
            "GetManifest": grpc.unary_unary_rpc_method_handler(
                self._get_manifest,
                request_deserializer=pb.GetManifestRequest.FromString,
                response_serializer=pb.WeightManifest.SerializeToString,
            ),
            # Chunks are encoded by hand (harnessrl.weights.chunks): no serializer.
            "Fetch": grpc.unary_stream_rpc_method_handler(
                self._fetch,
                request_deserializer=pb.FetchRequest.FromString,
                response_serializer=_identity,
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self._port = server.add_insecure_port(f"{self._settings.host}:{self._settings.port}")
        await server.start()
        self._server = server
        log.info("weight sync serving", address=self.address)

    async def stop(self) -> None:
        """Stop serving and release every held version (idempotent).

        Fetch streams in progress get `stop_grace_s` to finish; shared-memory segments are
        unlinked.
        """
        server, self._server = self._server, None
        if server is not None:
            await server.stop(self._settings.stop_grace_s)
        self._store.clear()

    async def publish(
        self,
        version: int,
        step: int,
        state_dict: Mapping[str, torch.Tensor],
        *,
        adapter: pb.LoraAdapter | None = None,
    ) -> pb.WeightManifest:
        """Copy `state_dict` as `version` and serve it; returns (a copy of) its manifest.

        `adapter` set: the version is a LoRA adapter, `state_dict` only its pairs under
        PEFT's names (harnessrl.weights.adapter), and the manifest says so.

        The copy is taken before this returns, so the caller may change its tensors right
        after. Versions must increase (ValueError otherwise), except a protected version not
        held. The copy and checksums run in a worker thread, so the server keeps serving
        older versions meanwhile. Evicts unprotected versions beyond `keep_versions` (their
        segments are unlinked).
        """
        async with self._publish_lock:
            self._store.check_next(version)
            started = time.perf_counter()
            held = await asyncio.to_thread(
                snapshot,
                version,
                step,
                state_dict,
                algorithm=self._settings.checksum,
                shared_memory=self._settings.shared_memory,
                adapter=adapter,
            )
            self._store.add(held)
        manifest = held.manifest
        log.info(
            "weights version published",
            version=version,
            step=step,
            kind="adapter" if adapter is not None else "full",
            tensors=len(manifest.tensors),
            bytes=manifest.total_bytes,
            shm=manifest.shm.name or None,
            seconds=round(time.perf_counter() - started, 3),
        )
        copy = pb.WeightManifest()
        copy.CopyFrom(manifest)
        return copy

    async def _get_latest(self, request: pb.GetLatestRequest, context: Any) -> pb.WeightManifest:
        held = self._store.latest
        if held is None:
            await _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                "no weights version has been published yet",
            )
        return held.manifest

    async def _get_manifest(
        self, request: pb.GetManifestRequest, context: Any
    ) -> pb.WeightManifest:
        return (await self._held(request.version, context)).manifest

    async def _fetch(self, request: pb.FetchRequest, context: Any) -> AsyncIterator[bytes]:
        held = await self._held(request.version, context)
        chunk = min(
            request.max_chunk_bytes or self._settings.chunk_bytes, self._settings.max_chunk_bytes
        )
        held.acquire()
        try:
            for spec, start in zip(held.manifest.tensors, held.offsets, strict=True):
                field = tensor_field(spec.name)
                for offset in range(0, spec.nbytes, chunk):
                    end = start + min(offset + chunk, spec.nbytes)
                    yield encode_chunk(field, offset, held.data[start + offset : end])
        finally:
            held.release()

    async def _held(self, version: int, context: Any) -> HeldVersion:
        held = self._store.get(version)
        if held is None:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"weights version {version} is not held (held: {self._store.versions}): it "
                "was evicted or never published",
            )
        return held
