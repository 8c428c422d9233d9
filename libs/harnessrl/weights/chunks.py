"""WeightChunk on the wire, without copies, and the assembly of a Fetch stream.

A chunk message is encoded by hand (it is three fields) so the server joins the field
headers and a memoryview slice of the version's buffer into the one `bytes` gRPC needs, and
the puller takes `data` as a memoryview of the received message instead of having protobuf
copy it twice. The bytes are exactly the protobuf encoding of `harnessrl.v1.WeightChunk`,
and the decoder accepts any valid encoding of it (fields in any order, unknown fields
skipped), so either end may be any other gRPC implementation of the contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from harnessrl.events import varint
from harnessrl.weights.checksums import Verifier
from harnessrl.weights.errors import WeightSyncError

MiB = 1024 * 1024
DEFAULT_CHUNK_BYTES = 4 * MiB
"""Chunk size when a FetchRequest asks for none (the contract's default)."""
MAX_MESSAGE_BYTES = 64 * MiB
"""gRPC message limit set on both ends: room for 16 MiB chunks and more."""
GRPC_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
"""Channel and server options of both ends."""

_TENSOR_TAG = b"\x0a"  # field 1, length-delimited
_OFFSET_TAG = b"\x10"  # field 2, varint
_DATA_TAG = b"\x1a"  # field 3, length-delimited


class Chunk(NamedTuple):
    """A decoded WeightChunk; `data` is a view into the received message."""

    tensor: str
    offset: int
    data: memoryview


def tensor_field(name: str) -> bytes:
    """The encoded `tensor` field of every chunk of tensor `name` (computed once per tensor)."""
    raw = name.encode()
    return _TENSOR_TAG + varint(len(raw)) + raw


def encode_chunk(tensor: bytes, offset: int, data: memoryview) -> bytes:
    """A WeightChunk message; `tensor` comes from tensor_field(). Copies `data` once."""
    head = tensor + (_OFFSET_TAG + varint(offset) if offset else b"")
    return b"".join((head, _DATA_TAG, varint(len(data)), data))


def _read_varint(message: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(message) or shift > 63:
            raise WeightSyncError("malformed WeightChunk: truncated or overlong varint")
        byte = message[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def decode_chunk(message: bytes) -> Chunk:
    """Parse one WeightChunk message; WeightSyncError if it is not a valid encoding."""
    view = memoryview(message)
    tensor, offset, data = "", 0, view[0:0]
    pos, end = 0, len(message)
    while pos < end:
        key, pos = _read_varint(message, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(message, pos)
            if field == 2:
                offset = value
            elif field in (1, 3):
                raise WeightSyncError(f"malformed WeightChunk: field {field} is not a varint")
        elif wire == 2:
            length, pos = _read_varint(message, pos)
            stop = pos + length
            if stop > end:
                raise WeightSyncError("malformed WeightChunk: a field runs past the message")
            if field == 1:
                tensor = bytes(view[pos:stop]).decode("utf-8", errors="replace")
            elif field == 3:
                data = view[pos:stop]
            elif field == 2:
                raise WeightSyncError("malformed WeightChunk: offset is not a varint")
            pos = stop
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise WeightSyncError(f"malformed WeightChunk: unsupported wire type {wire}")
    if pos != end:
        raise WeightSyncError("malformed WeightChunk: a fixed-size field runs past the message")
    return Chunk(tensor, offset, data)


class ChunkAssembler:
    """Writes a Fetch stream's chunks into preallocated tensor buffers and verifies them.

    `targets` maps each tensor of the manifest to a writable view of exactly its nbytes, and
    `checksums` to its manifest checksum. Within a tensor, chunks must be contiguous and
    ascending (the contract), so every corruption a stream can carry shows up as a named
    error: an unknown tensor, a chunk out of the tensor's range, a chunk overlapping bytes
    already received, missing bytes (a gap before a chunk, or a tensor still short when the
    stream ends), or a checksum mismatch. Each chunk is hashed right after it is written,
    while it is still in cache. Tensors may arrive in any order.
    """

    def __init__(self, targets: Mapping[str, memoryview], checksums: Mapping[str, str]) -> None:
        self._targets = targets
        self._received = dict.fromkeys(targets, 0)
        self._verifiers = {name: Verifier(checksums[name], f"tensor {name!r}") for name in targets}
        self.bytes_received = 0

    def add(self, chunk: Chunk) -> None:
        """Write one chunk in place; WeightSyncError (nothing written) if it does not fit."""
        tensor, offset, data = chunk
        target = self._targets.get(tensor)
        if target is None:
            raise WeightSyncError(f"chunk for unknown tensor {tensor!r}: not in the manifest")
        have, end, size = self._received[tensor], offset + len(data), len(target)
        if end > size:
            raise WeightSyncError(
                f"tensor {tensor!r}: chunk bytes [{offset}, {end}) are out of range "
                f"(the tensor has {size} bytes)"
            )
        if offset < have:
            raise WeightSyncError(
                f"tensor {tensor!r}: chunk bytes [{offset}, {end}) overlap bytes already "
                f"received [0, {have})"
            )
        if offset > have:
            raise WeightSyncError(
                f"tensor {tensor!r}: missing bytes [{have}, {offset}) before the chunk at "
                f"offset {offset}"
            )
        written = target[offset:end]
        written[:] = data
        self._verifiers[tensor].update(written)
        self._received[tensor] = end
        self.bytes_received += len(data)

    def finish(self) -> None:
        """At the end of the stream: WeightSyncError naming every tensor still short, else
        the first tensor whose checksum does not match."""
        short = [
            f"tensor {name!r} received {got} of {len(self._targets[name])} bytes"
            for name, got in self._received.items()
            if got < len(self._targets[name])
        ]
        if short:
            more = f" (and {len(short) - 5} more tensors)" if len(short) > 5 else ""
            raise WeightSyncError(
                "missing bytes at the end of the stream: " + "; ".join(short[:5]) + more
            )
        for verifier in self._verifiers.values():
            verifier.check()
