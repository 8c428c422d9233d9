"""Manifests, checksums and the WeightChunk codec: everything a puller checks, without gRPC."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
import torch
import xxhash

from harnessrl.events import varint
from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights import WeightSyncError, build_manifest, digest, verify_manifest
from harnessrl.weights.checksums import ALGORITHMS, hasher, verify
from harnessrl.weights.chunks import (
    Chunk,
    ChunkAssembler,
    decode_chunk,
    encode_chunk,
    tensor_field,
)
from harnessrl.weights.manifest import byte_view, destinations, manifest_checksum
from harnessrl.weights.store import snapshot


def _state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "layer.0.q.weight": torch.randn(4, 6, generator=generator),
        "layer.0.norm": torch.randn(6, generator=generator).half(),
        "ids": torch.arange(5, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(0.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }


def _manifest(algorithm: str = "xxh3_64") -> pb.WeightManifest:
    return snapshot(3, 30, _state(), algorithm=algorithm, shared_memory=False).manifest


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_digest_names_its_algorithm_and_changes_with_one_flipped_bit(algorithm: str) -> None:
    data = bytearray(range(256)) * 64
    before = digest(data, algorithm)
    data[1000] ^= 0x01
    assert before.startswith(f"{algorithm}:")
    assert digest(data, algorithm) != before


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_incremental_hashing_matches_the_one_shot_digest(algorithm: str) -> None:
    data = bytes(range(256)) * 1000
    incremental = hasher(algorithm)
    for start in range(0, len(data), 3001):
        incremental.update(data[start : start + 3001])
    assert f"{algorithm}:{incremental.hexdigest()}" == digest(data, algorithm)


def test_checksums_are_xxh3_64_and_crc32_as_everyone_computes_them() -> None:
    data = b"weights" * 100
    assert digest(data) == f"xxh3_64:{xxhash.xxh3_64_hexdigest(data)}"
    assert digest(data, "crc32") == f"crc32:{zlib.crc32(data):08x}"


def test_verify_rejects_a_mismatch_naming_what_was_checked() -> None:
    with pytest.raises(WeightSyncError, match="tensor 'w': checksum mismatch"):
        verify(b"abc", digest(b"abd"), "tensor 'w'")


def test_manifest_round_trips_dtype_shape_and_bytes_including_bfloat16() -> None:
    state = _state()
    held = snapshot(3, 30, state, algorithm="xxh3_64", shared_memory=False)
    manifest = held.manifest
    verify_manifest(manifest)
    assert [spec.name for spec in manifest.tensors] == list(state)
    assert manifest.total_bytes == sum(t.numel() * t.element_size() for t in state.values())
    rebuilt = destinations(manifest)
    for spec, offset in zip(manifest.tensors, held.offsets, strict=True):
        byte_view(rebuilt[spec.name])[:] = held.data[offset : offset + spec.nbytes]
    for name, tensor in state.items():
        assert rebuilt[name].dtype == tensor.dtype
        assert rebuilt[name].shape == tensor.shape
        assert torch.equal(rebuilt[name], tensor)
    assert {spec.dtype for spec in manifest.tensors} >= {"bfloat16", "float32", "float16", "bool"}


def test_tensor_offsets_are_aligned_for_any_mix_of_sizes() -> None:
    held = snapshot(1, 1, _state(), algorithm="crc32", shared_memory=False)
    assert all(offset % 64 == 0 for offset in held.offsets)


def test_manifest_checksum_is_the_documented_text_encoding() -> None:
    manifest = _manifest()
    text = "".join(
        f"{t.name}\t{t.dtype}\t{','.join(map(str, t.shape))}\t{t.checksum}\n"
        for t in manifest.tensors
    )
    assert manifest.manifest_checksum == f"xxh3_64:{xxhash.xxh3_64_hexdigest(text.encode())}"
    assert manifest_checksum(manifest.tensors, "crc32") == digest(text.encode(), "crc32")


def _rename(m: pb.WeightManifest) -> None:
    m.tensors[1].name = "layer.0.k.weight"


def _retype(m: pb.WeightManifest) -> None:
    m.tensors[1].dtype = "int32"  # same itemsize: nbytes still agrees


def _reshape(m: pb.WeightManifest) -> None:
    m.tensors[1].shape[:] = [6, 4]


def _rechecksum(m: pb.WeightManifest) -> None:
    m.tensors[1].checksum = digest(b"other bytes")


def _reorder(m: pb.WeightManifest) -> None:
    first, second = pb.TensorSpec(), pb.TensorSpec()
    first.CopyFrom(m.tensors[0])
    second.CopyFrom(m.tensors[1])
    m.tensors[0].CopyFrom(second)
    m.tensors[1].CopyFrom(first)


@pytest.mark.parametrize("tamper", [_rename, _retype, _reshape, _rechecksum, _reorder])
def test_manifest_checksum_covers_names_dtypes_shapes_checksums_and_order(
    tamper: Callable[[pb.WeightManifest], None],
) -> None:
    manifest = _manifest()
    tamper(manifest)
    with pytest.raises(WeightSyncError, match="manifest checksum mismatch"):
        verify_manifest(manifest)


def _spec(**fields: object) -> pb.TensorSpec:
    base: dict[str, object] = {
        "name": "w",
        "dtype": "bfloat16",
        "shape": [2, 3],
        "nbytes": 12,
        "checksum": digest(bytes(12)),
    }
    return pb.TensorSpec(**(base | fields))  # type: ignore[arg-type]  # protobuf kwargs


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (_spec(nbytes=10), "tensor 'w': nbytes 10 does not match shape"),
        (_spec(dtype="bfloat17"), "tensor 'w': unknown dtype 'bfloat17'"),
        (_spec(checksum="md5:00"), "tensor 'w': checksum algorithm 'md5' is not supported"),
        (_spec(checksum="deadbeef"), "tensor 'w': checksum 'deadbeef' is not"),
    ],
)
def test_verify_manifest_names_the_tensor_with_a_bad_spec(
    spec: pb.TensorSpec, message: str
) -> None:
    with pytest.raises(WeightSyncError, match=message):
        verify_manifest(build_manifest(1, 1, [spec]))


def test_verify_manifest_rejects_a_name_listed_twice() -> None:
    with pytest.raises(WeightSyncError, match="tensor 'w': listed twice"):
        verify_manifest(build_manifest(1, 1, [_spec(), _spec()]))


def test_verify_manifest_rejects_a_wrong_total() -> None:
    manifest = build_manifest(1, 1, [_spec()])
    manifest.total_bytes += 1
    with pytest.raises(WeightSyncError, match="total_bytes 13 is not the sum"):
        verify_manifest(manifest)


def test_verify_manifest_rejects_a_shared_memory_range_outside_the_segment() -> None:
    manifest = build_manifest(1, 1, [_spec(shm_offset=64)])
    manifest.shm.CopyFrom(pb.SharedMemoryRef(name="seg", size=70, host="h"))
    with pytest.raises(WeightSyncError, match=r"tensor 'w': shared-memory range \[64, 76\)"):
        verify_manifest(manifest)


@pytest.mark.parametrize("offset", [0, 1, 300, 2**40])
def test_encoded_chunks_are_the_protobuf_encoding_of_weight_chunk(offset: int) -> None:
    data = memoryview(bytes(range(200)))
    encoded = encode_chunk(tensor_field("model.layers.0.mlp.up_proj.weight"), offset, data)
    parsed = pb.WeightChunk.FromString(encoded)
    assert (parsed.tensor, parsed.offset, parsed.data) == (
        "model.layers.0.mlp.up_proj.weight",
        offset,
        bytes(data),
    )
    assert encoded == parsed.SerializeToString()


def test_decoder_reads_any_valid_encoding_fields_in_any_order_unknown_fields_skipped() -> None:
    data = b"\x00\x01" * 100
    standard = pb.WeightChunk(tensor="t", offset=7, data=data).SerializeToString()
    unknown = b"\x48\x05" + b"\x52\x03abc" + b"\x5d\x00\x00\x00\x00" + b"\x61" + bytes(8)
    reordered = b"\x1a" + varint(len(data)) + data + unknown + b"\x10\x07" + b"\x0a\x01t"
    for message in (standard, reordered):
        chunk = decode_chunk(message)
        assert (chunk.tensor, chunk.offset, bytes(chunk.data)) == ("t", 7, data)


@pytest.mark.parametrize(
    "message",
    [b"\x0a\x05ab", b"\x10", b"\x10\xff", b"\x1a\x10" + bytes(4), b"\x0b", b"\x0d\x00"],
)
def test_decoder_rejects_truncated_or_malformed_messages(message: bytes) -> None:
    with pytest.raises(WeightSyncError, match="malformed WeightChunk"):
        decode_chunk(message)


_SOURCES = {"a": bytes(range(100)), "b": bytes(range(50, 90)), "empty": b""}


def _assembler() -> tuple[ChunkAssembler, dict[str, memoryview]]:
    targets = {name: memoryview(bytearray(len(data))) for name, data in _SOURCES.items()}
    checksums = {name: digest(data) for name, data in _SOURCES.items()}
    return ChunkAssembler(targets, checksums), targets


def _chunks(sources: dict[str, bytes], size: int = 30) -> list[Chunk]:
    return [
        Chunk(name, offset, memoryview(data)[offset : offset + size])
        for name, data in sources.items()
        for offset in range(0, len(data), size)
    ]


def test_assembler_writes_every_byte_and_accepts_tensors_in_any_order() -> None:
    assembler, targets = _assembler()
    for chunk in _chunks({"b": _SOURCES["b"]}) + _chunks({"a": _SOURCES["a"]}):
        assembler.add(chunk)
    assembler.finish()
    assert assembler.bytes_received == 140
    assert {name: bytes(view) for name, view in targets.items()} == _SOURCES


def _flip(chunks: list[Chunk]) -> list[Chunk]:
    name, offset, data = chunks[1]
    flipped = bytearray(data)
    flipped[3] ^= 0x80
    return [*chunks[:1], Chunk(name, offset, memoryview(flipped)), *chunks[2:]]


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda c: [*c[:2], Chunk("ghost", 0, c[2].data), *c[3:]], "unknown tensor 'ghost'"),
        (lambda c: [*c[:2], c[1], *c[2:]], r"tensor 'a': chunk bytes \[30, 60\) overlap"),
        (lambda c: [c[0], *c[2:]], r"tensor 'a': missing bytes \[30, 60\) before"),
        (lambda c: c[:3] + c[4:], "missing bytes at the end of the stream: tensor 'a' received 90"),
        (
            lambda c: [*c[:3], Chunk("a", 90, memoryview(bytes(20))), *c[4:]],
            r"tensor 'a': chunk bytes \[90, 110\) are out of range",
        ),
        (_flip, "tensor 'a': checksum mismatch"),
    ],
    ids=["unknown-tensor", "overlap", "gap", "short", "out-of-range", "flipped-bit"],
)
def test_assembler_names_the_tensor_and_the_corruption(
    corrupt: Callable[[list[Chunk]], list[Chunk]], message: str
) -> None:
    assembler, _ = _assembler()
    with pytest.raises(WeightSyncError, match=message):
        for chunk in corrupt(_chunks(_SOURCES)):
            assembler.add(chunk)
        assembler.finish()


def test_assembler_checks_the_checksum_of_an_empty_tensor_too() -> None:
    targets = {"empty": memoryview(bytearray())}
    assembler = ChunkAssembler(targets, {"empty": digest(b"not empty")})
    with pytest.raises(WeightSyncError, match="tensor 'empty': checksum mismatch"):
        assembler.finish()


def test_destinations_reuse_matching_tensors_and_allocate_the_rest() -> None:
    manifest = _manifest()
    reusable = torch.empty(7, 5, dtype=torch.bfloat16)
    wrong_dtype = torch.empty(4, 6, dtype=torch.float16)
    out = destinations(manifest, {"embed.weight": reusable, "layer.0.q.weight": wrong_dtype})
    assert out["embed.weight"] is reusable
    assert out["layer.0.q.weight"] is not wrong_dtype
    assert out["layer.0.q.weight"].dtype == torch.float32
    assert list(out) == [spec.name for spec in manifest.tensors]
