"""Settings of the trainer's WeightSync server (a section a service config can embed)."""

from __future__ import annotations

from pydantic import Field

from harnessrl.config import MiB, Section
from harnessrl.weights.checksums import DEFAULT_ALGORITHM
from harnessrl.weights.chunks import DEFAULT_CHUNK_BYTES


class WeightSyncSettings(Section):
    """Where the trainer serves weights and how much of them it keeps."""

    host: str = "127.0.0.1"
    """Interface the gRPC server listens on ("0.0.0.0" for replicas on other hosts)."""
    port: int = Field(default=50061, ge=0, le=65535)
    """TCP port; 0 picks a free one (see WeightSyncServer.address)."""
    keep_versions: int = Field(default=2, ge=1)
    """How many of the newest versions stay fetchable; older ones are evicted, except the
    protected ones (a canary rollout's stable and candidate), held besides these."""
    chunk_bytes: int = Field(default=DEFAULT_CHUNK_BYTES, ge=1024)
    """Chunk size of a Fetch whose request asks for none."""
    max_chunk_bytes: int = Field(default=16 * MiB, ge=1024, le=48 * MiB)
    """Largest chunk served, whatever a request asks for (below the 64 MiB message limit)."""
    shared_memory: bool = False
    """Also offer each version in a POSIX shared-memory segment, for pullers on this host.
    The segment then holds the server's copy of the version (in /dev/shm, which must have
    room for `keep_versions` versions) and gRPC serves from it too."""
    checksum: str = DEFAULT_ALGORITHM
    """Checksum algorithm of tensors and manifests ("xxh3_64" or "crc32")."""
    stop_grace_s: float = Field(default=2.0, ge=0)
    """On stop, how long Fetch streams in progress get to finish."""
