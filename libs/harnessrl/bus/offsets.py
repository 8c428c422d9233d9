"""Which consumed offsets are finished, and how far each partition may safely be committed.

A record is finished when its processing and the acknowledgement of its outputs are done. A
stateful consumer can hold a record (its effect is not yet durable elsewhere, e.g. a sample
builder waiting for the rest of a group); the committed offset of its partition then stays
at the held record, so after a restart the consumer reads it again and rebuilds its state.
"""

from __future__ import annotations

from collections.abc import Iterable

TP = tuple[str, int]  # (topic, partition)


class OffsetTracker:
    """Per partition: offsets begun and not finished, and the next offset after those seen."""

    def __init__(self) -> None:
        self._pending: dict[TP, set[int]] = {}
        self._next: dict[TP, int] = {}
        self._committed: dict[TP, int] = {}
        self._epochs: dict[TP, int] = {}

    def begin(self, tp: TP, offset: int) -> None:
        self._pending.setdefault(tp, set()).add(offset)
        self._next[tp] = max(self._next.get(tp, 0), offset + 1)

    def epoch(self, tp: TP) -> int:
        """Incremented each time the partition is forgotten (lost in a rebalance)."""
        return self._epochs.get(tp, 0)

    def finish(self, tp: TP, offset: int, epoch: int | None = None) -> None:
        """Mark an offset finished (idempotent; unknown offsets are ignored). With `epoch`,
        a finish from before the partition was lost and re-assigned is ignored."""
        if epoch is not None and epoch != self.epoch(tp):
            return
        pending = self._pending.get(tp)
        if pending is not None:
            pending.discard(offset)

    def committable(self, tps: Iterable[TP] | None = None) -> dict[TP, int]:
        """Offsets to commit that moved since the last `committed()`: per partition the lowest
        unfinished offset, or the offset after the last one seen when all are finished."""
        result = {}
        for tp in self._next if tps is None else tps:
            if tp not in self._next:
                continue
            pending = self._pending.get(tp)
            position = min(pending) if pending else self._next[tp]
            if self._committed.get(tp) != position:
                result[tp] = position
        return result

    def committed(self, offsets: dict[TP, int]) -> None:
        """Record that `offsets` were committed."""
        self._committed.update(offsets)

    def forget(self, tps: Iterable[TP]) -> None:
        """Drop all state of partitions this member no longer owns."""
        for tp in tps:
            self._pending.pop(tp, None)
            self._next.pop(tp, None)
            self._committed.pop(tp, None)
            self._epochs[tp] = self._epochs.get(tp, 0) + 1

    def held(self, tp: TP) -> int:
        """Number of unfinished offsets of a partition."""
        return len(self._pending.get(tp, ()))
