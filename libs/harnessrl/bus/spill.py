"""An append-only on-disk log of records the producer could not keep in memory.

Records are appended in publish order and read back in the same order. A record read from
the log stays "outstanding" until the broker acknowledges it; the acknowledged watermark
(everything before it is acknowledged) is persisted, so after a crash the log replays from
the watermark: nothing is lost, and only records acknowledged after the last persisted
watermark can be sent twice.

Layout of the directory (one per producer; an flock keeps a second process out):

    LOCK                       held while open
    0000000000000001.seg ...   segments of framed records
    ACKED                      "<segment> <offset>": the persisted watermark

Frame: u32 payload length, u32 crc32 of the payload, payload. Payload: u16 topic length,
topic, i32 key length (-1: no key), key, u16 header count, per header (u16 name length, name,
u32 value length, value), then the value to the end. A torn frame at the end of the last
segment (a crash mid-write) is cut off when the log is opened.
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from harnessrl.logs import get_logger

log = get_logger(__name__)

Headers = list[tuple[str, bytes]]
Position = tuple[int, int]  # (segment number, byte offset): ordered like the log

_FRAME = struct.Struct("<II")
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_SEGMENT_BYTES = 64 * 1024 * 1024
_PERSIST_INTERVAL_S = 0.2
_RECENT_BYTES = 8 * 1024 * 1024
"""Records appended by this run are also kept in memory up to this many bytes, so reading
them back (the write-ahead path: every record goes through the log) does not read, check
and decode what was just written. The log on disk is the same either way; only a replay
after a restart reads it."""


@dataclass(frozen=True, slots=True)
class SpilledRecord:
    topic: str
    key: bytes | None
    value: bytes
    headers: Headers


def encode_record(record: SpilledRecord) -> bytes:
    topic = record.topic.encode()
    parts = [_U16.pack(len(topic)), topic]
    if record.key is None:
        parts.append(_I32.pack(-1))
    else:
        parts += [_I32.pack(len(record.key)), record.key]
    parts.append(_U16.pack(len(record.headers)))
    for name, value in record.headers:
        raw = name.encode()
        parts += [_U16.pack(len(raw)), raw, _U32.pack(len(value)), value]
    parts.append(record.value)
    payload = b"".join(parts)
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def decode_payload(payload: bytes) -> SpilledRecord:
    view = memoryview(payload)
    (n,) = _U16.unpack_from(view, 0)
    pos = 2
    topic = bytes(view[pos : pos + n]).decode()
    pos += n
    (klen,) = _I32.unpack_from(view, pos)
    pos += 4
    key = None if klen < 0 else bytes(view[pos : pos + klen])
    pos += max(klen, 0)
    (count,) = _U16.unpack_from(view, pos)
    pos += 2
    headers: Headers = []
    for _ in range(count):
        (n,) = _U16.unpack_from(view, pos)
        name = bytes(view[pos + 2 : pos + 2 + n]).decode()
        pos += 2 + n
        (vlen,) = _U32.unpack_from(view, pos)
        headers.append((name, bytes(view[pos + 4 : pos + 4 + vlen])))
        pos += 4 + vlen
    return SpilledRecord(topic, key, bytes(view[pos:]), headers)


class SpillLog:
    """The spill log of one producer. Not thread-safe: used from one event loop.

    `open()` takes the directory lock (raises BlockingIOError if another process holds it)
    and positions the reader at the persisted watermark, so unacknowledged records of an
    earlier run are read first.
    """

    def __init__(self, directory: Path, *, fsync: bool = False) -> None:
        self.directory = directory
        self._fsync = fsync
        self._lock_fd = -1
        self._write_fd = -1
        self._write_pos: Position = (1, 0)
        self._read_pos: Position = (1, 0)
        self._read_fds: dict[int, int] = {}
        self._outstanding: deque[Position] = deque()  # read, not yet acked, in log order
        self._acked: set[Position] = set()  # acked out of order, ahead of the watermark
        self._watermark: Position = (1, 0)
        self._persisted: Position = (1, 0)
        self._persisted_at = 0.0
        self.replay_end: Position = (1, 0)
        """Write position at open: records before it were written by an earlier run."""
        self._recent: deque[tuple[Position, Position, SpilledRecord, int]] = deque()
        """(start, end, record, frame bytes) of records appended and not yet read."""
        self._recent_bytes = 0

    # -- lifecycle ---------------------------------------------------------------------------

    def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise BlockingIOError(
                f"spill log {self.directory} is used by another process"
            ) from None
        segments = self._segments()
        self._watermark = self._read_acked(segments)
        self._persisted = self._watermark
        for number in segments:
            if number < self._watermark[0]:
                os.unlink(self._segment_path(number))
        segments = [n for n in segments if n >= self._watermark[0]]
        last = segments[-1] if segments else self._watermark[0]
        end = self._valid_end(last)
        self._write_pos = (last, end)
        self._read_pos = self._watermark if segments else (last, end)
        self.replay_end = self._write_pos
        self._write_fd = os.open(self._segment_path(last), os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._write_fd, end)
        os.lseek(self._write_fd, end, os.SEEK_SET)
        if self.unread_bytes:
            log.warning(
                "spill log replays records of an earlier run",
                dir=str(self.directory),
                bytes=self.unread_bytes,
            )

    def close(self) -> None:
        """Persist the watermark and release the directory (idempotent)."""
        if self._lock_fd < 0:
            return
        self._persist(force=True)
        for fd in [self._write_fd, *self._read_fds.values()]:
            if fd >= 0:
                os.close(fd)
        self._read_fds.clear()
        self._write_fd = -1
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = -1

    # -- writing and reading -----------------------------------------------------------------

    def append(self, record: SpilledRecord) -> Position:
        """Append a record; returns its end position. Raises OSError when the disk fails."""
        frame = encode_record(record)
        segment, offset = self._write_pos
        if offset > 0 and offset + len(frame) > _SEGMENT_BYTES:
            os.close(self._write_fd)
            segment, offset = segment + 1, 0
            self._write_fd = os.open(self._segment_path(segment), os.O_WRONLY | os.O_CREAT, 0o644)
        written = os.write(self._write_fd, frame)
        if written != len(frame):
            raise OSError(f"short write to spill log {self.directory}")
        if self._fsync:
            os.fsync(self._write_fd)
        self._write_pos = (segment, offset + len(frame))
        if self._recent_bytes + len(frame) <= _RECENT_BYTES:
            self._recent.append(((segment, offset), self._write_pos, record, len(frame)))
            self._recent_bytes += len(frame)
        return self._write_pos

    @property
    def has_unread(self) -> bool:
        return self._read_pos < self._write_pos

    @property
    def unread_bytes(self) -> int:
        """Bytes appended but not yet read (approximate across segments)."""
        (rs, ro), (ws, wo) = self._read_pos, self._write_pos
        return wo - ro if rs == ws else (ws - rs) * _SEGMENT_BYTES + wo - ro

    def read(self) -> tuple[Position, SpilledRecord]:
        """The next unread record and its end position; it is outstanding until `ack`ed.

        Raises EOFError when there is nothing unread.
        """
        if not self.has_unread:
            raise EOFError("spill log has no unread record")
        while self._recent and self._recent[0][0] < self._read_pos:
            self._recent_bytes -= self._recent.popleft()[3]  # read from disk already
        if self._recent and self._recent[0][0] == self._read_pos:
            _, end, record, size = self._recent.popleft()
            self._recent_bytes -= size
            self._read_pos = end
            self._outstanding.append(end)
            return end, record
        segment, offset = self._read_pos
        fd = self._read_fd(segment)
        header = os.pread(fd, _FRAME.size, offset)
        if len(header) < _FRAME.size:  # end of a finished segment: continue in the next
            self._close_read_fd(segment)
            self._read_pos = (segment + 1, 0)
            return self.read()
        length, crc = _FRAME.unpack(header)
        payload = os.pread(fd, length, offset + _FRAME.size)
        if len(payload) != length or zlib.crc32(payload) != crc:
            raise OSError(f"spill log {self.directory}: corrupt frame at {segment}:{offset}")
        end = (segment, offset + _FRAME.size + length)
        self._read_pos = end
        self._outstanding.append(end)
        return end, decode_payload(payload)

    def ack(self, position: Position) -> None:
        """Mark the record ending at `position` as delivered (or given up on)."""
        self._acked.add(position)
        advanced = False
        while self._outstanding and self._outstanding[0] in self._acked:
            self._watermark = self._outstanding.popleft()
            self._acked.discard(self._watermark)
            advanced = True
        if advanced:
            self._persist(force=False)

    def roll(self) -> None:
        """Write further records to a fresh segment, so that every record written so far
        leaves the disk as soon as it is acknowledged (its segment is deleted then), not
        when the segment fills up: what a deletion or a retention bound asks of the log."""
        if self._write_pos[1] > 0:
            os.close(self._write_fd)
            segment = self._write_pos[0] + 1
            self._write_fd = os.open(self._segment_path(segment), os.O_WRONLY | os.O_CREAT, 0o644)
            if self._read_pos == self._write_pos:  # caught up: nothing to read in the old one
                self._read_pos = (segment, 0)
            self._write_pos = (segment, 0)
        self._persist(force=True)

    @property
    def drained(self) -> bool:
        """True when every appended record has been read and acknowledged."""
        return not self.has_unread and not self._outstanding

    # -- internals ---------------------------------------------------------------------------

    def _persist(self, *, force: bool) -> None:
        if self.drained:  # everything written was read and acknowledged
            self._watermark = self._write_pos
        if self._watermark == self._persisted:
            return
        now = time.monotonic()
        if (
            not force
            and now - self._persisted_at < _PERSIST_INTERVAL_S
            and (self._watermark[0] == self._persisted[0])
        ):
            return
        if self.drained and self._write_pos[1] > 0:
            self._roll_empty()
        tmp = self.directory / "ACKED.tmp"
        tmp.write_text(f"{self._watermark[0]} {self._watermark[1]}\n")
        os.replace(tmp, self.directory / "ACKED")
        for number in self._segments():
            if number < self._watermark[0]:
                self._close_read_fd(number)
                os.unlink(self._segment_path(number))
        self._persisted = self._watermark
        self._persisted_at = now

    def _roll_empty(self) -> None:
        # Everything is delivered: start a fresh segment so the old one can be deleted.
        os.close(self._write_fd)
        segment = self._write_pos[0] + 1
        self._write_fd = os.open(self._segment_path(segment), os.O_WRONLY | os.O_CREAT, 0o644)
        self._write_pos = self._read_pos = self._watermark = (segment, 0)

    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.directory.glob("*.seg") if p.stem.isdigit())

    def _segment_path(self, number: int) -> Path:
        return self.directory / f"{number:016d}.seg"

    def _read_acked(self, segments: list[int]) -> Position:
        path = self.directory / "ACKED"
        if path.exists():
            segment, offset = (int(x) for x in path.read_text().split())
            return segment, offset
        return (segments[0], 0) if segments else (1, 0)

    def _valid_end(self, segment: int) -> int:
        """Length of the segment's prefix made of whole, intact frames (cuts a torn tail)."""
        path = self._segment_path(segment)
        if not path.exists():
            return 0
        data = path.read_bytes()
        offset = 0
        while offset + _FRAME.size <= len(data):
            length, crc = _FRAME.unpack_from(data, offset)
            payload = data[offset + _FRAME.size : offset + _FRAME.size + length]
            if len(payload) != length or zlib.crc32(payload) != crc:
                break
            offset += _FRAME.size + length
        if offset != len(data):
            log.warning(
                "spill log segment had a torn tail; cut",
                segment=str(path),
                kept=offset,
                cut=len(data) - offset,
            )
        return offset

    def _read_fd(self, segment: int) -> int:
        fd = self._read_fds.get(segment)
        if fd is None:
            fd = os.open(self._segment_path(segment), os.O_RDONLY)
            self._read_fds[segment] = fd
        return fd

    def _close_read_fd(self, segment: int) -> None:
        fd = self._read_fds.pop(segment, None)
        if fd is not None:
            os.close(fd)
