"""The trainer's delivery ledger: when a record may be acknowledged, what a re-delivery
does, what is forgotten, and that a long run with restarts stays bounded."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from harnessrl.bus.offsets import OffsetTracker
from harnessrl.services.trainer import checkpoint, delivery
from harnessrl.services.trainer.checkpoint import Checkpoints, TrainerState
from harnessrl.services.trainer.delivery import DeliveryLedger, LedgerState
from harnessrl.trust.batching import Batcher
from harnessrl.v1 import events_pb2 as pb


class S(NamedTuple):
    sample_id: str
    policy_version_min: int = 0


def offer(book: DeliveryLedger[str], record: str, *samples: S, taken: tuple[str, ...] = ()) -> bool:
    return book.offer(samples, taken=taken, hold=lambda: record)


def step(book: DeliveryLedger[str], version: int, *ids: str) -> None:
    book.take(ids, stale=())
    book.trained(version)


def checkpoint_at(book: DeliveryLedger[str], version: int) -> list[str]:
    return book.checkpointed(book.snapshot(version))


def never() -> str:
    raise AssertionError("the record was held")


def test_a_record_is_acknowledged_by_the_first_checkpoint_after_its_samples_trained() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    assert offer(book, "r1", S("a"), S("b"), taken=("a", "b"))
    assert checkpoint_at(book, 0) == []  # pending: not in these weights
    book.take(["a", "b"], stale=())
    snapshot = book.snapshot(0)  # a checkpoint while the step runs holds neither
    assert snapshot.state.trained == {} and book.checkpointed(snapshot) == []
    book.trained(1)
    assert book.unsaved
    snapshot = book.snapshot(1)  # written, not yet durable: nothing is released
    assert snapshot.state == LedgerState({"a": 0, "b": 0}, horizon=0)
    assert book.held == 1
    assert book.checkpointed(snapshot) == ["r1"]
    assert book.held == 0 and not book.unsaved


def test_a_redelivery_of_a_pending_sample_is_skipped_and_held_until_it_is_saved() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    offer(book, "r1", S("a"), taken=("a",))
    assert "a" in book.known  # the batcher skips the copy
    assert offer(book, "r1-again", S("a"))
    step(book, 1, "a")
    assert sorted(checkpoint_at(book, 1)) == ["r1", "r1-again"]


def test_a_redelivery_while_its_step_runs_is_skipped_and_held() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    offer(book, "r1", S("a"), taken=("a",))
    book.take(["a"], stale=())
    assert "a" in book.known
    assert offer(book, "r1-again", S("a"))
    book.trained(1)
    assert sorted(checkpoint_at(book, 1)) == ["r1", "r1-again"]


def test_a_redelivery_of_a_sample_trained_since_the_checkpoint_is_held_until_the_next() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    offer(book, "r1", S("a"), taken=("a",))
    step(book, 1, "a")
    assert offer(book, "r1-again", S("a"))
    assert sorted(checkpoint_at(book, 1)) == ["r1", "r1-again"]


def test_a_redelivery_of_a_saved_sample_is_acknowledged_at_once() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    offer(book, "r1", S("a"), taken=("a",))
    step(book, 1, "a")
    checkpoint_at(book, 1)
    assert not book.offer([S("a")], taken=(), hold=never)
    assert book.held == 0


def test_a_record_whose_samples_went_stale_is_released_by_the_next_checkpoint() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    assert not book.offer([S("old")], taken=(), hold=never)  # stale on arrival: nothing held
    offer(book, "r1", S("a"), taken=("a",))
    book.take([], stale=["a"])  # it grew stale waiting for its batch
    assert "a" not in book.known and book.held == 1
    assert checkpoint_at(book, 0) == ["r1"]


def test_a_saved_sample_is_forgotten_once_more_than_max_staleness_versions_behind() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    offer(book, "r1", S("a", 5), taken=("a",))
    step(book, 6, "a")
    checkpoint_at(book, 6)
    book.trained(7)  # 7 - 5 = 2: a copy would still be trained, so it is remembered
    assert "a" in book.known
    assert book.snapshot(7).state.trained == {"a": 5}
    book.trained(8)  # 3 behind: every copy is dropped as stale from now on
    assert "a" not in book.known and len(book) == 0
    assert book.horizon == 6
    assert book.snapshot(8).state == LedgerState({}, horizon=6)


def test_a_sample_not_yet_checkpointed_is_kept_however_stale() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    offer(book, "r1", S("a", 0), taken=("a",))
    step(book, 1, "a")
    book.trained(10)
    assert "a" in book.known
    assert offer(book, "r1-again", S("a", 0))  # its record is not acknowledged: hold this too
    snapshot = book.snapshot(10)
    assert snapshot.state == LedgerState({}, horizon=8)  # a restart drops any copy as stale
    assert sorted(book.checkpointed(snapshot)) == ["r1", "r1-again"]
    assert len(book) == 0


def test_restore_remembers_the_saved_samples_and_the_horizon() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    offer(book, "r1", S("a", 3), S("b", 4), taken=("a", "b"))
    step(book, 5, "a", "b")
    offer(book, "r2", S("c", 5), taken=("c",))  # pending: a restart re-delivers it
    state = book.snapshot(5).state
    restored: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    restored.restore(state)
    assert set(restored.known) == {"a", "b"} and restored.horizon == 3
    assert not restored.offer([S("a", 3)], taken=(), hold=never)
    assert offer(restored, "r2", S("c", 5), taken=("c",))
    with pytest.raises(RuntimeError, match="fresh ledger"):
        restored.restore(state)


def test_raising_max_staleness_across_a_restart_cannot_revive_a_forgotten_sample() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=1)
    offer(book, "r1", S("g/0", 0), taken=("g/0",))
    step(book, 1, "g/0")
    checkpoint_at(book, 1)
    book.trained(3)  # forgotten: 3 behind
    restored: DeliveryLedger[str] = DeliveryLedger(max_staleness=10)
    restored.restore(book.snapshot(3).state)
    copy = _group("g", 1, version=0)  # the sample builder re-publishes it
    batcher = Batcher(batch_groups=1, batch_tokens=None, max_staleness=10)
    unguarded = Batcher(batch_groups=1, batch_tokens=None, max_staleness=10)
    assert unguarded.add(copy, version=3, trained=restored.known) == ["g/0"]  # would retrain
    assert batcher.add(copy, version=3, trained=restored.known, horizon=restored.horizon) == []
    assert batcher.dropped["stale"] == 1


def test_a_move_outside_the_lifecycle_is_refused() -> None:
    book: DeliveryLedger[str] = DeliveryLedger(max_staleness=2)
    with pytest.raises(RuntimeError, match="cannot go from None to taken"):
        book.take(["never-offered"], stale=())
    offer(book, "r1", S("a"), taken=("a",))
    with pytest.raises(RuntimeError, match="taken again"):
        offer(book, "r2", S("a"), taken=("a",))


def _group(group_id: str, size: int, version: int) -> pb.GroupSamples:
    group = pb.GroupSamples(group_id=group_id)
    for i in range(size):
        group.samples.add(
            sample_id=f"{group_id}/{i}",
            token_ids=[1, 2, 3],
            loss_mask=[False, True, True],
            behavior_logprobs=[0.0, -0.5, -0.5],
            temperature=1.0,
            policy_version_min=version,
            policy_version_max=version,
        )
    return group


STALENESS, GROUP, BATCH_GROUPS, EVERY = 10, 4, 4, 4
BATCH = GROUP * BATCH_GROUPS
GROUPS = 2500  # of GROUP samples: 10,000
TP = ("hrl.samples", 0)


class _Trainer:
    """The service's delivery loop without Kafka: records are read from the committed
    offset on, a hold is the record's offset (released: finished in a real OffsetTracker),
    a step is one SGD step of a Linear(2, 2), checkpoints go through the real Checkpoints."""

    def __init__(self, ckpts: Checkpoints, committed: int, versions_seen: int) -> None:
        self.ckpts = ckpts
        self.model = torch.nn.Linear(2, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.ledger: DeliveryLedger[int] = DeliveryLedger(max_staleness=STALENESS)
        self.batcher = Batcher(
            batch_groups=BATCH_GROUPS, batch_tokens=None, max_staleness=STALENESS
        )
        self.tracker = OffsetTracker()
        self.position = self.committed = committed
        self.step = self.version = 0
        latest = ckpts.latest()
        if latest is not None:
            state = ckpts.load(latest, self._read, restore_rng=False)
            self.ledger.restore(state.ledger)
            self.step = state.step
            self.version = max(state.policy_version, versions_seen + 1)  # lost ones skipped

    def offer(self, offset: int, value: bytes) -> None:
        group = pb.GroupSamples.FromString(value)
        self.tracker.begin(TP, offset)
        taken = self.batcher.add(
            group, version=self.version, trained=self.ledger.known, horizon=self.ledger.horizon
        )
        if not self.ledger.offer(group.samples, taken=taken, hold=lambda: offset):
            self.tracker.finish(TP, offset)
        self.position = offset + 1
        self._commit()

    def train(self) -> list[str]:
        batch = self.batcher.take(self.version)
        trained = [s.sample_id for s in batch.samples]
        self.ledger.take(trained, stale=batch.stale)
        self.model(torch.ones(1, 2)).sum().backward()
        self.optimizer.step()
        self.step += 1
        self.version += 1
        self.ledger.trained(self.version)
        return trained

    def checkpoint(self) -> Path:
        snapshot = self.ledger.snapshot(self.version)
        state = TrainerState(self.step, self.version, snapshot.state)
        path = self.ckpts.save(self._write, state)
        for offset in self.ledger.checkpointed(snapshot):
            self.tracker.finish(TP, offset)
        self._commit()
        return path

    def _commit(self) -> None:
        offsets = self.tracker.committable([TP])
        self.tracker.committed(offsets)
        self.committed = offsets.get(TP, self.committed)

    def _write(self, directory: Path) -> None:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        torch.save(state, directory / "tensors.pt")

    def _read(self, directory: Path) -> None:
        state = torch.load(directory / "tensors.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def _ledger_bytes() -> int:
    """Memory still allocated by delivery.py and checkpoint.py (the restored sample ids)."""
    files = {delivery.__file__, checkpoint.__file__}
    stats = tracemalloc.take_snapshot().statistics("filename")
    return sum(stat.size for stat in stats if stat.traceback[0].filename in files)


class _Topic:
    """One partition of hrl.samples (offset i holds values[i]) and the sample builder
    writing to it: a new group whenever the trainer has read everything."""

    def __init__(self) -> None:
        self.values: list[bytes] = []
        self.originals: list[bytes] = []

    def read(self, trainer: _Trainer) -> bytes:
        if trainer.position == len(self.values):
            lag = len(self.originals) % 3  # engines a version or two behind
            version = max(0, trainer.version - lag)
            group = _group(f"g{len(self.originals):05d}", GROUP, version)
            self.originals.append(group.SerializeToString())
            self.values.append(self.originals[-1])
        return self.values[trainer.position]

    def republish(self, rng: random.Random) -> None:
        """The builder restarted: a recent group and one far out of the window come back,
        byte-identical, at later offsets."""
        self.values += [self.originals[-5], rng.choice(self.originals[:-200])]

    def sample_ids(self) -> list[str]:
        """Every sample id of the original groups."""
        groups = map(pb.GroupSamples.FromString, self.originals)
        return [s.sample_id for group in groups for s in group.samples]


def _checkpoint_measured(trainer: _Trainer) -> tuple[int, int, int, int]:
    """Checkpoints; returns the ledger's entries, its memory (every 4th checkpoint, else 0:
    a snapshot is slow), and the sizes of samples.txt and state.json."""
    path = trainer.checkpoint()
    allocated = _ledger_bytes() if trainer.step % (4 * EVERY) == 0 else 0
    samples, state = (path / checkpoint.SAMPLES).stat(), (path / checkpoint.STATE).stat()
    return len(trainer.ledger), allocated, samples.st_size, state.st_size


def test_ten_thousand_samples_through_restarts_keep_the_ledger_and_checkpoint_flat(
    tmp_path: Path,
) -> None:
    """Crashes at random steps (the tail after the checkpoint is re-delivered, the versions
    announced since are skipped), each followed by a sample builder's re-publication.
    Bounds: a checkpoint stores the samples of the last STALENESS versions (STALENESS
    batches); the ledger also holds up to EVERY batches trained since, and records."""
    entries_bound = (max(STALENESS, EVERY) + 1) * BATCH
    held_bound = (EVERY + 1) * BATCH_GROUPS + 2
    saved_bound = STALENESS * BATCH
    bytes_bound = entries_bound * 256 + held_bound * 512 + 16 * 1024
    rng = random.Random(0)
    ckpts = Checkpoints(tmp_path, keep=2)
    topic = _Topic()
    lineage: list[list[str]] = []  # lineage[k]: what step k+1 of the current weights trained
    dropped: Counter[str] = Counter()
    restarts = versions_seen = 0
    trainer = _Trainer(ckpts, committed=0, versions_seen=0)
    crash_at = rng.randint(20, 120)
    measured: list[tuple[int, int, int, int]] = []  # entries, bytes, samples.txt, state.json
    tracemalloc.start()
    try:
        while len(topic.originals) < GROUPS or trainer.position < len(topic.values):
            trainer.offer(trainer.position, topic.read(trainer))
            if not trainer.batcher.due:
                continue
            lineage.append(trainer.train())
            versions_seen = max(versions_seen, trainer.version)
            assert len(trainer.ledger) <= entries_bound
            assert trainer.ledger.held <= held_bound
            if trainer.step == crash_at:  # killed: nothing after the checkpoint survives
                dropped += trainer.batcher.dropped
                trainer = _Trainer(ckpts, trainer.committed, versions_seen)
                del lineage[trainer.step :]
                crash_at = trainer.step + rng.randint(20, 120)
                topic.republish(rng)
                restarts += 1
            elif trainer.step % EVERY == 0:
                measured.append(_checkpoint_measured(trainer))
        lineage.append(trainer.train())  # what is left, at shutdown
        trainer.checkpoint()
    finally:
        tracemalloc.stop()
    dropped += trainer.batcher.dropped

    trained = Counter(s for ids in lineage for s in ids)
    assert trained == Counter(topic.sample_ids())  # each once: none twice, none skipped
    assert dropped["stale"] >= restarts * GROUP  # the old copies: "stale", not "trained"
    assert trainer.committed == len(topic.values) and trainer.ledger.held == 0  # all acked
    assert len(measured) > 100 and restarts >= 5
    peaks = [max(m[i] for m in measured) for i in range(4)]
    print(f"{restarts} restarts; peak entries, bytes, samples.txt, state.json: {peaks}")
    for entries, allocated, samples_size, state_size in measured:
        assert entries <= (STALENESS + 1) * BATCH  # right after a checkpoint: nothing unsaved
        assert allocated <= bytes_bound
        assert samples_size <= saved_bound * len("99999\tg00000/0\n")
        assert state_size <= 256
