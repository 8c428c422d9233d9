"""The trainer's copies of its newest published versions.

`snapshot` copies a state dict into one contiguous buffer per version (each tensor at an
aligned offset; a shared-memory segment when the same-host path is on), so a later trainer
step that changes its parameters cannot change a published version, and checksums the
copy. `VersionStore` keeps the newest K and evicts the rest, except the versions it is told
to protect (a canary rollout's stable and candidate, which engines must be able to pull
however many versions the trainer publishes meanwhile); an evicted version's segment is
unlinked at once and its buffer released when the last Fetch stream reading it ends.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import torch

from harnessrl.logs import get_logger
from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights import shm
from harnessrl.weights.checksums import digest
from harnessrl.weights.manifest import (
    aligned,
    build_manifest,
    empty_like_spec,
    spec_for,
    tensor_bytes,
)

log = get_logger(__name__)


@dataclass(eq=False)
class HeldVersion:
    """One published version: its manifest and the server's own copy of its bytes.

    `data` holds tensor i at `offsets[i]` (which is its shm_offset when `segment` is set).
    """

    manifest: pb.WeightManifest
    data: memoryview
    offsets: tuple[int, ...]
    segment: shared_memory.SharedMemory | None = None
    readers: int = field(default=0)
    evicted: bool = field(default=False)

    def evict(self) -> None:
        """Stop offering the version (idempotent): unlink its segment, release if unread."""
        if self.evicted:
            return
        self.evicted = True
        if self.segment is not None:
            # Already gone only if someone removed /dev/shm entries by hand.
            with contextlib.suppress(FileNotFoundError):
                self.segment.unlink()
        self._release_if_done()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Copies of the version's tensors (CPU), by name in manifest order: what was
        published, byte for byte (a trainer archives its stable version from them)."""
        copies: dict[str, torch.Tensor] = {}
        for spec, offset in zip(self.manifest.tensors, self.offsets, strict=True):
            tensor = empty_like_spec(spec)
            if spec.nbytes:
                source = torch.frombuffer(
                    self.data, dtype=torch.uint8, count=spec.nbytes, offset=offset
                )
                tensor_bytes(tensor).copy_(source)
                del source  # the segment cannot be closed while a tensor exports it
            copies[spec.name] = tensor
        return copies

    def acquire(self) -> None:
        """A Fetch stream starts reading `data`."""
        self.readers += 1

    def release(self) -> None:
        """A Fetch stream stopped reading `data`."""
        self.readers -= 1
        self._release_if_done()

    def _release_if_done(self) -> None:
        if not self.evicted or self.readers:
            return
        self.data.release()
        segment, self.segment = self.segment, None
        if segment is not None:
            try:
                segment.close()
            except BufferError:
                # Something still exports the map (a traceback holding a tensor view): it
                # is unmapped when that goes; the name is unlinked already.
                log.warning("weights segment still referenced", segment=segment.name)


def snapshot(
    version: int,
    step: int,
    state_dict: Mapping[str, torch.Tensor],
    *,
    algorithm: str,
    shared_memory: bool,
    adapter: pb.LoraAdapter | None = None,
) -> HeldVersion:
    """Copy `state_dict` (tensors on any device, any dtype) into a new HeldVersion.

    Runs in a worker thread: copying and hashing release the GIL. A DTensor (a trainer
    sharded with FSDP) is all-gathered when its turn comes, one tensor at a time, so the
    whole model is never gathered at once; every other rank must gather the same tensors
    in the same order meanwhile. `adapter` describes a version that is a LoRA adapter
    (the manifest then carries it). Raises TypeError naming the key of a value that is not
    a tensor.
    """
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor")
        tensors.append((name, value.detach()))
    offsets, end = [], 0
    for _, tensor in tensors:
        offsets.append(aligned(end))
        end = offsets[-1] + tensor.numel() * tensor.element_size()
    segment = shm.create_segment(shm.segment_name(version), end) if shared_memory else None
    buffer = memoryview(bytearray(max(end, 1))) if segment is None else segment.buf
    assert buffer is not None  # SharedMemory.buf is None only after close()
    try:
        specs = []
        for (name, tensor), offset in zip(tensors, offsets, strict=True):
            whole = _whole(tensor)
            source = tensor_bytes(whole.contiguous())
            nbytes = source.numel()
            if nbytes:
                target = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
                target.copy_(source)
                del target  # the segment cannot be closed while a tensor exports it
            checksum = digest(buffer[offset : offset + nbytes], algorithm)
            specs.append(spec_for(name, whole, checksum, offset if segment else 0))
    except BaseException:
        if segment is not None:
            segment.unlink()
            with contextlib.suppress(BufferError):  # a view may live on in the traceback
                segment.close()
        raise
    manifest = build_manifest(version, step, specs, algorithm, adapter)
    if segment is not None:
        manifest.shm.CopyFrom(
            pb.SharedMemoryRef(name=segment.name, size=segment.size, host=socket.gethostname())
        )
    data = buffer if segment is None else buffer[:]
    return HeldVersion(manifest, data, tuple(offsets), segment)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class VersionStore:
    """The newest `keep` versions, by version number, plus the protected ones.

    Versions are published in order, except a protected version not held yet (a trainer
    that restarted re-holds its rollout's stable and candidate beside newer versions).
    """

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self._keep = keep
        self._held: dict[int, HeldVersion] = {}
        self._protected: frozenset[int] = frozenset()

    @property
    def latest(self) -> HeldVersion | None:
        """The newest held version, or None before the first publish."""
        return self._held[max(self._held)] if self._held else None

    @property
    def versions(self) -> list[int]:
        """Held version numbers, oldest first."""
        return sorted(self._held)

    @property
    def protected(self) -> frozenset[int]:
        """The versions never evicted (`protect`)."""
        return self._protected

    def protect(self, versions: frozenset[int] | set[int]) -> None:
        """Never evict `versions` (replacing the previous set); a version that loses its
        protection is evicted at once when it is beyond the newest `keep`."""
        self._protected = frozenset(versions)
        self._evict()

    def check_next(self, version: int) -> None:
        """ValueError unless `version` is newer than every held version, or is protected
        and not held."""
        if version in self._protected and version not in self._held:
            return
        if self._held and version <= max(self._held):
            raise ValueError(
                f"version {version} is not newer than the latest published ({max(self._held)})"
            )

    def add(self, held: HeldVersion) -> None:
        """Hold a version (see `check_next`) and evict the oldest unprotected beyond `keep`."""
        self.check_next(held.manifest.version)
        self._held[held.manifest.version] = held
        self._evict()

    def _evict(self) -> None:
        unprotected = sorted(v for v in self._held if v not in self._protected)
        for version in unprotected[: max(0, len(unprotected) - self._keep)]:
            oldest = self._held.pop(version)
            oldest.evict()
            log.info("weights version evicted", version=version)

    def get(self, version: int) -> HeldVersion | None:
        """The held version `version`, or None when it was evicted or never published."""
        return self._held.get(version)

    def clear(self) -> None:
        """Evict everything (idempotent)."""
        for held in self._held.values():
            held.evict()
        self._held.clear()
