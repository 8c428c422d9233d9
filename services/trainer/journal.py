"""The trainer's step journal: which samples each optimiser step trained on, for audits.

`<checkpoint_dir>/steps.jsonl` gets one line per step, appended (and flushed) before the
step's version is announced:

    {"step": 7, "version": 9, "resumed_from": 5, "samples": ["ep-1/0/0", ...], "at": 1.7e9}

A trainer killed after step m resumes from its newest checkpoint (step k <= m) and takes
steps k+1, ... again: the lines for k+1..m written before the crash belong to a lineage
whose weights were thrown away. So each start writes a line `{"resume": k, "at": ...}`, and
`lineage()` drops every step above k when it meets one (and, for every step, keeps only the
line written last): what it returns is the history of the weights the trainer holds now.
A sample in two steps of that history was trained twice; one in steps of a discarded
lineage only was not.

Under a canary rollout, a rollback retires the versions trained after the stable one, and
the trainer rewinds its weights to the stable version's (service.py). It writes
`{"rewind": k, "version": s, "at": ...}` (at step k, to version s), and `lineage()` drops
every step whose version is above s when it meets one: along a lineage versions increase,
so what remains is the history of version s, which the trainer's weights now are. Samples
trained into the retired versions stay trained (by those versions), but not in this
history.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

JOURNAL = "steps.jsonl"


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    version: int
    resumed_from: int
    samples: tuple[str, ...]
    at: float


class StepJournal:
    """Appends one line per step to `root/steps.jsonl`."""

    def __init__(self, root: Path, *, resumed_from: int) -> None:
        """Writes the resume line: the weights are now those of step `resumed_from`."""
        self.path = Path(root) / JOURNAL
        self._resumed_from = resumed_from
        if self.path.exists() and self.path.stat().st_size:
            with self.path.open("rb+") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    f.write(b"\n")  # end the line a crash cut short: it stays unreadable alone
        self._append({"resume": resumed_from, "at": time.time()})

    def rewind(self, step: int, version: int) -> None:
        """After step `step`, the weights were rewound to version `version`'s."""
        self._append({"rewind": step, "version": version, "at": time.time()})

    def record(self, step: int, version: int, samples: Iterable[str]) -> None:
        self._append(
            {
                "step": step,
                "version": version,
                "resumed_from": self._resumed_from,
                "samples": list(samples),
                "at": time.time(),
            }
        )

    def _append(self, line: dict[str, object]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")


@dataclass(frozen=True, slots=True)
class Resume:
    step: int
    at: float


@dataclass(frozen=True, slots=True)
class Rewind:
    step: int
    version: int
    at: float


Record = StepRecord | Resume | Rewind


def read(path: Path) -> list[Record]:
    """Every complete line of a journal, in file order (a line cut short by a crash while
    it was written is ignored)."""
    if not path.exists():
        return []
    records: list[Record] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "resume" in data:
            records.append(Resume(step=int(data["resume"]), at=float(data["at"])))
            continue
        if "rewind" in data:
            records.append(
                Rewind(step=int(data["rewind"]), version=int(data["version"]), at=float(data["at"]))
            )
            continue
        records.append(
            StepRecord(
                step=int(data["step"]),
                version=int(data["version"]),
                resumed_from=int(data["resumed_from"]),
                samples=tuple(str(s) for s in data["samples"]),
                at=float(data["at"]),
            )
        )
    return records


def lineage(records: Sequence[Record]) -> list[StepRecord]:
    """The steps behind the current weights, in step order (see the module docstring)."""
    kept: dict[int, StepRecord] = {}
    for record in records:
        if isinstance(record, Rewind):
            for step in [s for s, r in kept.items() if r.version > record.version]:
                del kept[step]  # retired: trained into versions the weights left behind
            continue
        newest = record.step if isinstance(record, Resume) else record.step - 1
        for step in [s for s in kept if s > newest]:
            del kept[step]  # thrown away with a crash: a restart goes on from `newest`
        if isinstance(record, StepRecord):
            kept[record.step] = record
    return [kept[s] for s in sorted(kept)]


def trained(records: Sequence[Record]) -> list[StepRecord]:
    """The steps whose samples count as trained in the token books, in step order: those
    of `lineage`, and those of versions a rewind retired (trained, by a version no user is
    served any more); not those a crash threw away."""
    kept = {record.step: record for record in lineage(records)}
    without_rewinds = [r for r in records if not isinstance(r, Rewind)]
    retired = {r.step: r for r in lineage(without_rewinds) if r.step not in kept}
    return sorted([*kept.values(), *retired.values()], key=lambda r: (r.step, r.version))


def trained_twice(records: Sequence[Record]) -> list[str]:
    """Sample ids that appear in more than one step of the lineage (or twice in one)."""
    counts = Counter(s for record in lineage(records) for s in record.samples)
    return sorted(s for s, n in counts.items() if n > 1)
