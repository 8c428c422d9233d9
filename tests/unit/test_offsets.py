"""Commit positions: never past an unfinished record."""

from __future__ import annotations

from harnessrl.bus.offsets import OffsetTracker

TP = ("hrl.calls", 0)


def test_commit_position_stops_at_the_first_unfinished_offset() -> None:
    t = OffsetTracker()
    for offset in range(10, 15):
        t.begin(TP, offset)
    for offset in (10, 11, 13):
        t.finish(TP, offset)
    assert t.committable() == {TP: 12}
    t.finish(TP, 12)
    assert t.committable() == {TP: 14}
    t.finish(TP, 14)
    assert t.committable() == {TP: 15}


def test_only_moved_positions_are_reported_again() -> None:
    t = OffsetTracker()
    t.begin(TP, 0)
    t.finish(TP, 0)
    t.committed(t.committable())
    assert t.committable() == {}
    t.begin(TP, 1)
    t.finish(TP, 1)
    assert t.committable() == {TP: 2}


def test_a_hold_from_before_a_rebalance_cannot_finish_a_reassigned_offset() -> None:
    t = OffsetTracker()
    t.begin(TP, 5)
    old_epoch = t.epoch(TP)
    t.forget([TP])
    t.begin(TP, 5)  # re-delivered after the partition came back
    t.finish(TP, 5, old_epoch)
    assert t.committable() == {TP: 5}
    t.finish(TP, 5, t.epoch(TP))
    assert t.committable() == {TP: 6}


def test_forgotten_partitions_report_nothing() -> None:
    t = OffsetTracker()
    t.begin(TP, 3)
    t.forget([TP])
    assert t.committable() == {}
    assert t.held(TP) == 0
