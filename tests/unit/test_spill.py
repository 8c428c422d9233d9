"""The spill log: order, acknowledgement watermark, replay after a crash, torn tails."""

from __future__ import annotations

from pathlib import Path

import pytest

from harnessrl.bus import spill as spill_module
from harnessrl.bus.spill import SpilledRecord, SpillLog


def _record(i: int) -> SpilledRecord:
    key = None if i % 3 == 0 else f"g{i % 5}".encode()
    return SpilledRecord(
        "hrl.calls",
        key,
        f"value-{i}".encode() * (i % 7 + 1),
        [("traceparent", b"00-ab"), ("n", str(i).encode())],
    )


def test_records_come_back_in_order_and_intact(tmp_path: Path) -> None:
    log = SpillLog(tmp_path)
    log.open()
    for i in range(50):
        log.append(_record(i))
    read = [log.read()[1] for _ in range(50)]
    assert read == [_record(i) for i in range(50)]
    assert not log.has_unread
    with pytest.raises(EOFError):
        log.read()
    log.close()


def test_reopen_replays_from_the_acknowledged_watermark(tmp_path: Path) -> None:
    log = SpillLog(tmp_path)
    log.open()
    for i in range(10):
        log.append(_record(i))
    positions = [log.read()[0] for _ in range(10)]
    for p in positions[:4] + positions[5:7]:  # 4 is outstanding: the watermark stops there
        log.ack(p)
    log.close()  # a crash loses nothing more: close only persists what ack already knew

    again = SpillLog(tmp_path)
    again.open()
    replayed = []
    while again.has_unread:
        replayed.append(again.read()[1])
    assert replayed == [_record(i) for i in range(4, 10)]
    again.close()


def test_a_torn_last_frame_is_cut_and_the_rest_kept(tmp_path: Path) -> None:
    log = SpillLog(tmp_path)
    log.open()
    for i in range(3):
        log.append(_record(i))
    log.close()
    segment = sorted(tmp_path.glob("*.seg"))[-1]
    data = segment.read_bytes()
    segment.write_bytes(data + spill_module.encode_record(_record(3))[:-5])  # crash mid-write

    again = SpillLog(tmp_path)
    again.open()
    assert [again.read()[1] for _ in range(3)] == [_record(i) for i in range(3)]
    assert not again.has_unread
    again.append(_record(4))
    assert again.read()[1] == _record(4)
    again.close()


def test_a_second_process_cannot_open_the_same_log(tmp_path: Path) -> None:
    first = SpillLog(tmp_path)
    first.open()
    with pytest.raises(BlockingIOError, match="used by another process"):
        SpillLog(tmp_path).open()
    first.close()
    second = SpillLog(tmp_path)
    second.open()
    second.close()


def test_delivered_segments_are_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill_module, "_SEGMENT_BYTES", 200)
    log = SpillLog(tmp_path)
    log.open()
    for i in range(30):
        log.append(_record(i))
    assert len(list(tmp_path.glob("*.seg"))) > 3
    while log.has_unread:
        log.ack(log.read()[0])
    log.close()
    assert log.drained
    assert len(list(tmp_path.glob("*.seg"))) == 1
    assert sorted(tmp_path.glob("*.seg"))[0].stat().st_size == 0


def test_records_of_this_run_are_after_replay_end(tmp_path: Path) -> None:
    log = SpillLog(tmp_path)
    log.open()
    log.append(_record(0))
    log.close()
    again = SpillLog(tmp_path)
    again.open()
    again.append(_record(1))
    old, _ = again.read()
    new, _ = again.read()
    assert old <= again.replay_end < new
    again.close()


@pytest.mark.parametrize(("segment_bytes", "recent_bytes"), [(200, 10_000), (10_000, 150)])
def test_records_read_from_memory_or_disk_are_the_same_in_the_same_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, segment_bytes: int, recent_bytes: int
) -> None:
    """This run's records come back from memory while they fit its budget and from disk
    past it, across segment ends, in append order either way, and the log on disk holds
    them all for a replay."""
    monkeypatch.setattr(spill_module, "_SEGMENT_BYTES", segment_bytes)
    monkeypatch.setattr(spill_module, "_RECENT_BYTES", recent_bytes)
    spill = SpillLog(tmp_path)
    spill.open()
    written = [SpilledRecord("hrl.calls", f"k{i}".encode(), bytes([i]) * 40, []) for i in range(12)]
    for record in written[:5]:
        spill.append(record)
    got = [spill.read()[1] for _ in range(3)]
    for record in written[5:]:
        spill.append(record)
    while spill.has_unread:
        got.append(spill.read()[1])
    assert got == written
    spill.close()
    again = SpillLog(tmp_path)
    again.open()  # nothing acknowledged: a replay reads every record from disk
    replayed = []
    while again.has_unread:
        replayed.append(again.read()[1])
    assert replayed == written
    again.close()


def test_after_a_roll_every_record_written_leaves_the_disk_once_acknowledged(
    tmp_path: Path,
) -> None:
    """A deletion asks for it: records sitting acknowledged in a half-full segment are gone
    at once, and those still in flight as soon as they are acknowledged."""
    log = SpillLog(tmp_path)
    log.open()
    for i in range(3):
        log.append(_record(i))
    first = log.read()[0]
    log.ack(first)
    second, third = log.read()[0], log.read()[0]
    log.roll()  # two records still in flight
    assert any(p.stat().st_size for p in tmp_path.glob("*.seg"))
    log.ack(second)
    log.ack(third)
    assert all(p.stat().st_size == 0 for p in tmp_path.glob("*.seg"))
    log.append(_record(9))  # the log goes on in the fresh segment
    assert log.read()[1] == _record(9)
    log.roll()  # nothing acknowledged yet: the record stays until it is
    assert log.has_unread is False and not log.drained
    log.close()
    again = SpillLog(tmp_path)
    again.open()
    assert again.read()[1] == _record(9)  # unacknowledged: replayed after a restart
    again.close()
