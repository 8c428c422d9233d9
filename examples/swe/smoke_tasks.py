"""The CPU smoke run's task files: the planted task of examples/swe-coder, from a real
`swe synth` + `swe clean --validate` of six.

    python examples/swe/smoke_tasks.py CLEAN_TASKS.jsonl OUT_DIR

reads the harnessrl task file `swe clean --tasks-out` wrote and writes OUT_DIR/train.jsonl
(the planted task, split train) and OUT_DIR/val.jsonl (the same task, split val, its own
task id). The smoke model (examples/swe-coder) writes that task's fix or submits nothing,
each half of the time: a val score measures how often the policy now writes the fix, not
coding skill, and val is the train task on purpose (the smoke run checks the loop, not
generalisation).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PLANTED = "six-1.17.0__arguments-07bbae18cf"
"""The task whose fix examples/swe-coder/build.py plants (FIX_COMMAND there)."""


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.stderr.write(__doc__ or "")
        return 2
    source, out = Path(argv[0]), Path(argv[1])
    lines = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    planted = [line for line in lines if line["task_id"] == PLANTED]
    if not planted:
        found = ", ".join(line["task_id"] for line in lines) or "none"
        sys.stderr.write(f"{source}: no task {PLANTED} (found: {found})\n")
        return 1
    (task,) = planted
    out.mkdir(parents=True, exist_ok=True)
    train = dict(task, split="train")
    val = dict(task, split="val", task_id=f"{PLANTED}-val")
    (out / "train.jsonl").write_text(json.dumps(train) + "\n")
    (out / "val.jsonl").write_text(json.dumps(val) + "\n")
    sys.stderr.write(f"{out}/train.jsonl and val.jsonl: {PLANTED}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
