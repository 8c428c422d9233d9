"""The trainer's step journal: the lineage of the current weights across crashes."""

from __future__ import annotations

from pathlib import Path

from harnessrl.services.trainer.journal import StepJournal, lineage, read, trained_twice


def test_a_crash_discards_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    first = StepJournal(tmp_path, resumed_from=0)
    for step, samples in enumerate([["a", "b"], ["c"], ["d"], ["e"]], start=1):
        first.record(step, step, samples)
    # Killed after step 4 with the newest checkpoint at step 2: d and e come back.
    second = StepJournal(tmp_path, resumed_from=2)
    second.record(3, 6, ["d", "e"])
    records = read(tmp_path / "steps.jsonl")
    assert [(r.step, r.samples) for r in lineage(records)] == [
        (1, ("a", "b")),
        (2, ("c",)),
        (3, ("d", "e")),
    ]
    assert trained_twice(records) == []
    # A restart with no step since: the weights are the checkpoint's, steps 3.. are gone.
    StepJournal(tmp_path, resumed_from=2)
    assert [r.step for r in lineage(read(tmp_path / "steps.jsonl"))] == [1, 2]


def test_a_sample_in_two_steps_of_the_lineage_is_counted(tmp_path: Path) -> None:
    journal = StepJournal(tmp_path, resumed_from=0)
    journal.record(1, 1, ["a", "b"])
    journal.record(2, 2, ["b", "c"])
    StepJournal(tmp_path, resumed_from=2).record(3, 3, ["a"])
    assert trained_twice(read(tmp_path / "steps.jsonl")) == ["a", "b"]


def test_a_line_cut_short_by_a_crash_is_ignored(tmp_path: Path) -> None:
    StepJournal(tmp_path, resumed_from=0).record(1, 1, ["a"])
    with (tmp_path / "steps.jsonl").open("a") as f:
        f.write('{"step": 2, "version": 2, "samp')
    assert [r.step for r in lineage(read(tmp_path / "steps.jsonl"))] == [1]
    StepJournal(tmp_path, resumed_from=1).record(2, 2, ["b"])
    assert [r.step for r in lineage(read(tmp_path / "steps.jsonl"))] == [1, 2]
    assert read(tmp_path / "missing.jsonl") == []
