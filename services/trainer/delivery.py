"""The trainer's delivery ledger: which samples it has seen, trained and checkpointed, and
when the record that carried them may be acknowledged.

A GroupSamples record is offered; each new sample the batcher takes is pending, then taken
into a step, trained (in the weights), and saved (a checkpoint holds the step). The record
is acknowledged (its hold released, so the consumer may commit past it) only at the first
checkpoint after all of its samples are saved or dropped: a crash before that re-delivers
it, and the restored ledger skips what the checkpoint's weights hold already.

An incoming record's samples are, each:

- new: the batcher took it (pending); the record is held.
- a re-delivery (after a rebalance, or a sample builder's restart) of a sample pending, in
  the step running now, or trained since the last checkpoint: skipped, and the record is
  held too. Acknowledging it now would lose the sample in a crash before the checkpoint
  (the first copy's hold dies with a rebalance).
- a re-delivery of a saved sample, or a sample the batcher dropped as stale: skipped, with
  nothing to wait for.

Pruning. A rebuilt sample is byte-identical, and the sample builder may re-publish a group
after its own crash at a LATER offset, so committed offsets cannot prove that a copy will
never arrive again. Staleness can: the batcher drops any sample whose policy_version_min is
more than `max_staleness` versions behind the trainer's version, and that version only
grows (a restart resumes at the checkpoint's version or above). So a saved sample is kept
while `version - policy_version_min <= max_staleness`; after that every copy is dropped as
stale and can never be trained twice. A sample not yet saved is kept however old: its
record is not acknowledged, and a re-delivery of it must be held. `horizon` records the
promise: every trained sample with policy_version_min >= horizon is remembered. It is
stored with the checkpoint, and the batcher drops samples below it, so raising
max_staleness across a restart cannot revive a copy of a forgotten sample.

What a checkpoint stores is the horizon and the trained samples (id, policy_version_min) at
or above it. Every sample trains with policy_version_min >= version - max_staleness, and
policy_version_min never exceeds the version (versions lost in a crash are skipped), so the
ledger and the checkpoint hold the samples of the last max_staleness+1 versions plus those
in flight (pending, in the step, trained since the last checkpoint) — not every sample ever
trained. Consumed offsets are not stored: a copy is recognised by its sample ids, not its
offset, and the group's committed offsets already say where a restart reads from; a held
record is forgotten once it is acknowledged.

One accounting consequence: a copy that arrives after the window is counted as dropped
"stale" (with its loss-mask tokens), not "trained", though its first copy was trained.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Set
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Protocol, TypeVar

H = TypeVar("H")
"""A hold: what keeps a record unacknowledged (the bus's `Hold`); the ledger only stores it."""


class SampleRef(Protocol):
    """What the ledger reads from a sample (a pb.Sample or SampleArrays)."""

    @property
    def sample_id(self) -> str: ...

    @property
    def policy_version_min(self) -> int: ...


class Stage(Enum):
    PENDING = "pending"  # taken by the batcher, waiting for a step
    TAKEN = "taken"  # in the step running now
    TRAINED = "trained"  # in the weights, not in a checkpoint yet
    SAVED = "saved"  # in the weights of the newest checkpoint


_TRANSITIONS: Mapping[tuple[Stage | None, Stage | None], str] = {
    (None, Stage.PENDING): "offered, and the batcher took it",
    (Stage.PENDING, Stage.TAKEN): "taken into a step",
    (Stage.PENDING, None): "dropped as stale when its batch was taken",
    (Stage.TAKEN, Stage.TRAINED): "its step finished",
    (Stage.TRAINED, Stage.SAVED): "a checkpoint holds its step",
    (Stage.SAVED, None): "pruned: every copy is stale now",
    (None, Stage.SAVED): "restored from a checkpoint",
}
"""The allowed moves of a sample (None: not in the ledger), checked in `_move`."""


@dataclass(frozen=True, slots=True)
class LedgerState:
    """What a checkpoint stores of the ledger."""

    trained: Mapping[str, int]
    """Sample id -> policy_version_min of the trained samples at or above `horizon`."""
    horizon: int = 0
    """Every trained sample with policy_version_min >= horizon is in `trained`."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A checkpoint in the making: what it stores, and the trained samples it covers."""

    state: LedgerState
    covers: tuple[str, ...]
    """Ids trained since the last checkpoint (all in the weights being saved)."""


@dataclass(slots=True)
class _Entry:
    stage: Stage
    version_min: int


@dataclass(frozen=True, slots=True)
class _Held(Generic[H]):
    hold: H
    waiting: frozenset[str]
    """Sample ids of the record that were not saved when it arrived."""


class DeliveryLedger(Generic[H]):
    """The delivery bookkeeping of one trainer (see the module docstring). Not thread-safe:
    call it from the event loop (or before consuming starts)."""

    def __init__(self, *, max_staleness: int) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self._max_staleness = max_staleness
        self._samples: dict[str, _Entry] = {}
        self._held: list[_Held[H]] = []
        self._taken: list[str] = []
        self._unsaved: list[str] = []
        self._horizon = 0

    def __len__(self) -> int:
        """Samples remembered (pending, in a step, trained and not yet pruned)."""
        return len(self._samples)

    @property
    def known(self) -> Set[str]:
        """Ids the batcher must skip (a live view): pending, in the step, or trained."""
        return self._samples.keys()

    @property
    def horizon(self) -> int:
        """The batcher drops samples with a policy_version_min below this as stale."""
        return self._horizon

    @property
    def held(self) -> int:
        """Records held: not acknowledged until a checkpoint covers their samples."""
        return len(self._held)

    @property
    def unsaved(self) -> bool:
        """True when samples were trained since the last checkpoint."""
        return bool(self._unsaved)

    def restore(self, state: LedgerState) -> None:
        """Start from a checkpoint's state: its samples are saved. Raises RuntimeError on a
        ledger already in use."""
        if self._samples or self._held:
            raise RuntimeError("restore() needs a fresh ledger")
        for sample_id, version_min in state.trained.items():
            self._move(sample_id, Stage.SAVED, version_min)
        self._horizon = state.horizon

    def offer(
        self, samples: Iterable[SampleRef], *, taken: Collection[str], hold: Callable[[], H]
    ) -> bool:
        """One record arrived with `samples`, of which the batcher took `taken` (the rest it
        skipped as known or dropped as stale). Calls `hold()` once, and keeps the hold until
        `checkpointed` returns it, when the record carries a sample not saved yet; returns
        whether it did. Raises RuntimeError if a taken id is known already."""
        known = [sample_id for sample_id in taken if sample_id in self._samples]
        if known:
            raise RuntimeError(f"samples taken again: {known[:5]} ({len(known)})")
        waiting = set()
        for sample in samples:
            sample_id = sample.sample_id
            entry = self._samples.get(sample_id)
            if entry is None and sample_id in taken:
                entry = self._move(sample_id, Stage.PENDING, sample.policy_version_min)
            if entry is not None and entry.stage is not Stage.SAVED:
                waiting.add(sample_id)
        if waiting:
            self._held.append(_Held(hold(), frozenset(waiting)))
        return bool(waiting)

    def take(self, trained: Iterable[str], stale: Iterable[str]) -> None:
        """A batch was taken: `trained` go into the step, `stale` were dropped from it."""
        for sample_id in trained:
            self._move(sample_id, Stage.TAKEN)
            self._taken.append(sample_id)
        for sample_id in stale:
            self._move(sample_id, None)

    def trained(self, version: int) -> None:
        """The step on the taken samples finished and made `version`; saved samples more
        than max_staleness versions behind it are forgotten."""
        for sample_id in self._taken:
            self._move(sample_id, Stage.TRAINED)
        self._unsaved += self._taken
        self._taken = []
        self._prune(version - self._max_staleness)

    def snapshot(self, version: int) -> Snapshot:
        """What a checkpoint of the weights at `version` stores; changes nothing (a save
        that fails leaves the ledger as it was)."""
        horizon = max(self._horizon, version - self._max_staleness)
        trained = {
            sample_id: entry.version_min
            for sample_id, entry in self._samples.items()
            if entry.stage in (Stage.TRAINED, Stage.SAVED) and entry.version_min >= horizon
        }
        return Snapshot(LedgerState(trained, horizon), tuple(self._unsaved))

    def checkpointed(self, snapshot: Snapshot) -> list[H]:
        """The checkpoint of `snapshot` is durable: its samples are saved. Returns the holds
        of the records it settles (every sample saved or dropped), to release, and forgets
        them."""
        for sample_id in snapshot.covers:
            self._move(sample_id, Stage.SAVED)
        covered = set(snapshot.covers)
        self._unsaved = [s for s in self._unsaved if s not in covered]
        self._prune(snapshot.state.horizon)
        released: list[_Held[H]] = []
        kept: list[_Held[H]] = []
        for record in self._held:
            settled = all(self._settled(sample_id) for sample_id in record.waiting)
            (released if settled else kept).append(record)
        self._held = kept
        return [record.hold for record in released]

    def _settled(self, sample_id: str) -> bool:
        entry = self._samples.get(sample_id)
        return entry is None or entry.stage is Stage.SAVED

    def _prune(self, horizon: int) -> None:
        self._horizon = max(self._horizon, horizon)
        stale = [
            sample_id
            for sample_id, entry in self._samples.items()
            if entry.stage is Stage.SAVED and entry.version_min < self._horizon
        ]
        for sample_id in stale:
            self._move(sample_id, None)

    def _move(self, sample_id: str, to: Stage | None, version_min: int | None = None) -> _Entry:
        """Moves a sample along `_TRANSITIONS` (RuntimeError for any other move); returns
        its entry (the last one, when it leaves the ledger)."""
        entry = self._samples.get(sample_id)
        frm = None if entry is None else entry.stage
        if (frm, to) not in _TRANSITIONS:
            raise RuntimeError(
                f"sample {sample_id!r}: cannot go from {frm and frm.value} to {to and to.value}"
            )
        if entry is None:
            assert to is not None and version_min is not None
            entry = self._samples[sample_id] = _Entry(to, version_min)
        elif to is None:
            del self._samples[sample_id]
        else:
            entry.stage = to
        return entry
