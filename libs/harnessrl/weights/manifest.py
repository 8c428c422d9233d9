"""Manifests: what a version holds (names, dtypes, shapes, sizes, checksums), and its checks.

Dtypes are written as torch names them without the prefix ("bfloat16", "float32"). Every
tensor is described by the bytes of its contiguous form, so a puller can rebuild it with
`torch.empty(shape, dtype=...)` and fill it byte for byte.

The manifest checksum covers, in manifest order, each tensor's name, dtype, shape and
checksum. Its input is the UTF-8 text of one line per tensor,
`name \\t dtype \\t dim,dim,... \\t checksum \\n`, followed for an adapter version by the
adapter's line (harnessrl.weights.adapter.adapter_line), hashed with the algorithm its own
prefix names, so any language can recompute it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights.adapter import adapter_line, split_name
from harnessrl.weights.checksums import DEFAULT_ALGORITHM, algorithm_of, digest
from harnessrl.weights.errors import WeightSyncError

ALIGNMENT = 64
"""Byte alignment of each tensor inside a version's buffer and shared-memory segment."""


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str, what: str = "manifest") -> torch.dtype:
    """The torch dtype called `name`; WeightSyncError naming `what` if there is none."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"{what}: unknown dtype {name!r}")
    return dtype


def aligned(offset: int) -> int:
    """`offset` rounded up to ALIGNMENT."""
    return -(-offset // ALIGNMENT) * ALIGNMENT


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view sharing its memory."""
    if not tensor.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous tensor")
    return tensor.reshape(-1).view(torch.uint8)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (shares its memory)."""
    return tensor_bytes(tensor).numpy().data


def spec_for(name: str, tensor: torch.Tensor, checksum: str, shm_offset: int = 0) -> pb.TensorSpec:
    """The TensorSpec of `tensor` (its contiguous bytes hash to `checksum`)."""
    return pb.TensorSpec(
        name=name,
        dtype=dtype_name(tensor.dtype),
        shape=list(tensor.shape),
        nbytes=tensor.numel() * tensor.element_size(),
        checksum=checksum,
        shm_offset=shm_offset,
    )


def manifest_checksum(
    tensors: Iterable[pb.TensorSpec],
    algorithm: str = DEFAULT_ALGORITHM,
    adapter: pb.LoraAdapter | None = None,
) -> str:
    """The checksum over the tensors' names, dtypes, shapes and checksums, in order, and
    the adapter's description when the version is one."""
    text = "".join(
        f"{t.name}\t{t.dtype}\t{','.join(map(str, t.shape))}\t{t.checksum}\n" for t in tensors
    )
    if adapter is not None:
        text += adapter_line(adapter)
    return digest(text.encode(), algorithm)


def build_manifest(
    version: int,
    step: int,
    tensors: Iterable[pb.TensorSpec],
    algorithm: str = DEFAULT_ALGORITHM,
    adapter: pb.LoraAdapter | None = None,
) -> pb.WeightManifest:
    """A manifest with total_bytes and manifest_checksum filled in (no shared memory);
    `adapter` set for a version that is a LoRA adapter."""
    specs = list(tensors)
    return pb.WeightManifest(
        version=version,
        step=step,
        tensors=specs,
        total_bytes=sum(t.nbytes for t in specs),
        manifest_checksum=manifest_checksum(specs, algorithm, adapter),
        adapter=adapter,
    )


def verify_manifest(manifest: pb.WeightManifest) -> None:
    """Check that a manifest is internally consistent before any byte is fetched.

    Raises WeightSyncError naming the tensor when a name repeats, a dtype is unknown,
    nbytes disagrees with shape x element size, a checksum is malformed or of an unknown
    algorithm, a shared-memory range falls outside the segment, total_bytes is not the sum,
    or the manifest checksum does not match the tensors listed (and the adapter, for an
    adapter version); for an adapter, also a tensor name that is no LoRA pair's.
    """
    what = f"version {manifest.version}"
    seen: set[str] = set()
    for spec in manifest.tensors:
        where = f"{what}, tensor {spec.name!r}"
        if spec.name in seen:
            raise WeightSyncError(f"{where}: listed twice in the manifest")
        seen.add(spec.name)
        dtype = torch_dtype(spec.dtype, where)
        expected = math.prod(spec.shape) * dtype.itemsize
        if spec.nbytes != expected:
            raise WeightSyncError(
                f"{where}: nbytes {spec.nbytes} does not match shape {list(spec.shape)} "
                f"of {spec.dtype} ({expected} bytes)"
            )
        algorithm_of(spec.checksum, where)
        if manifest.HasField("adapter"):
            split_name(spec.name)
        if manifest.HasField("shm") and spec.shm_offset + spec.nbytes > manifest.shm.size:
            raise WeightSyncError(
                f"{where}: shared-memory range [{spec.shm_offset}, "
                f"{spec.shm_offset + spec.nbytes}) is out of range of segment "
                f"{manifest.shm.name!r} ({manifest.shm.size} bytes)"
            )
    total = sum(spec.nbytes for spec in manifest.tensors)
    if manifest.total_bytes != total:
        raise WeightSyncError(
            f"{what}: total_bytes {manifest.total_bytes} is not the sum of the tensors' "
            f"nbytes ({total})"
        )
    algorithm = algorithm_of(manifest.manifest_checksum, f"{what} manifest")
    adapter = manifest.adapter if manifest.HasField("adapter") else None
    actual = manifest_checksum(manifest.tensors, algorithm, adapter)
    if actual != manifest.manifest_checksum:
        raise WeightSyncError(
            f"{what}: manifest checksum mismatch: it says {manifest.manifest_checksum}, "
            f"its tensors hash to {actual}"
        )


def empty_like_spec(spec: pb.TensorSpec) -> torch.Tensor:
    """An uninitialised CPU tensor of the spec's dtype and shape."""
    return torch.empty(tuple(spec.shape), dtype=torch_dtype(spec.dtype, spec.name))


def destinations(
    manifest: pb.WeightManifest, out: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """A CPU tensor to receive each tensor of `manifest`, in manifest order.

    A tensor of `out` with the same name, dtype and shape that is a contiguous CPU tensor is
    reused (written in place); every other one is allocated.
    """
    result: dict[str, torch.Tensor] = {}
    for spec in manifest.tensors:
        reuse = None if out is None else out.get(spec.name)
        if (
            reuse is not None
            and reuse.device.type == "cpu"
            and reuse.is_contiguous()
            and dtype_name(reuse.dtype) == spec.dtype
            and tuple(reuse.shape) == tuple(spec.shape)
        ):
            result[spec.name] = reuse
        else:
            result[spec.name] = empty_like_spec(spec)
    return result
