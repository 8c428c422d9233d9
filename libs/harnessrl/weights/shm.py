"""POSIX shared-memory segments for the same-host path.

The trainer creates one segment per version (multiprocessing.shared_memory, mode 0600, so
only the same user can open it) and unlinks it when the version is evicted. A puller opens
it read-only by name, copies out what it needs and unmaps it at once. A mapping outlives an
unlink, so a puller that opened the segment before eviction still reads intact bytes; one
that comes later finds no segment and falls back to gRPC.

The puller copies a version out with read_segment, which verifies checksums as it copies.
It does not attach through multiprocessing.shared_memory: on Python < 3.13 every
attach registers the segment with the puller's resource tracker, which unlinks the
trainer's segment when the puller exits. It maps /dev/shm/<name> itself (Linux), so on a
system without /dev/shm the same-host path is simply never used.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights.checksums import Verifier
from harnessrl.weights.errors import WeightSyncError
from harnessrl.weights.manifest import tensor_bytes

SHM_DIR = Path("/dev/shm")
MAX_COPY_THREADS = 4
"""Most threads that copy a version out of its segment (copies are memory-bound)."""
COPY_BLOCK_BYTES = 256 * 1024
"""Copy-then-hash block: small enough to be hashed from L2 right after it is written."""


def segment_name(version: int) -> str:
    """A fresh segment name for `version`, unique to this process and call."""
    return f"hrl-weights-{os.getpid()}-{secrets.token_hex(4)}-v{version}"


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """Create a segment of `size` bytes (at least 1); the caller closes and unlinks it."""
    return shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))


def open_segment(name: str, size: int) -> mmap.mmap:
    """Map segment `name` for reading; the caller closes the map when done.

    The map is private copy-on-write (never written), so tensors can wrap it without
    torch's warning about read-only buffers. Raises OSError when the segment does not exist
    (evicted, other host or namespace) or cannot be opened, and WeightSyncError naming the
    segment when it is smaller than `size`.
    """
    if not name or "/" in name or name.startswith("."):
        raise FileNotFoundError(f"not a shared-memory segment name: {name!r}")
    fd = os.open(SHM_DIR / name, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            raise WeightSyncError(
                f"shared-memory segment {name!r} holds {actual} bytes, the manifest says {size}"
            )
        return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def read_segment(
    name: str,
    size: int,
    specs: Sequence[pb.TensorSpec],
    targets: Mapping[str, torch.Tensor],
    what: str,
) -> None:
    """Copy each spec's bytes from segment `name` into its target tensor, and verify them.

    Tensors are spread over a few threads (largest first); each copies its tensor in
    L2-sized blocks and hashes every block right after copying it, while it is in cache.
    Mapping a segment costs about as much as copying it (page-table set-up for 4 KiB
    pages), and the threads overlap that too. The segment is unmapped before this returns.
    Raises OSError if the segment cannot be opened, WeightSyncError naming the tensor on a
    checksum mismatch (`what` prefixes the message).
    """
    mapping = open_segment(name, size)
    try:
        source = np.frombuffer(mapping, dtype=np.uint8)
        try:
            jobs = sorted(specs, key=lambda spec: -spec.nbytes)
            workers = max(1, min(MAX_COPY_THREADS, os.cpu_count() or 1, len(jobs)))
            with ThreadPoolExecutor(workers, thread_name_prefix="shm-copy") as pool:
                copies = pool.map(
                    _copy_tensor,
                    repeat(source),
                    jobs,
                    [targets[spec.name] for spec in jobs],
                    repeat(what),
                )
                for _ in copies:  # re-raises the first error
                    pass
        finally:
            del source  # the map cannot close while an array exports it
    finally:
        mapping.close()


def _copy_tensor(source: np.ndarray, spec: pb.TensorSpec, target: torch.Tensor, what: str) -> None:
    verifier = Verifier(spec.checksum, f"{what}, tensor {spec.name!r}")
    into = tensor_bytes(target).numpy()
    start = spec.shm_offset
    for offset in range(0, spec.nbytes, COPY_BLOCK_BYTES):
        end = min(offset + COPY_BLOCK_BYTES, spec.nbytes)
        block = into[offset:end]
        np.copyto(block, source[start + offset : start + end])  # releases the GIL
        verifier.update(block.data)
    verifier.check()
