"""`harnessrl swe ...`: coding tasks for training coding agents (harnessrl.swe).

    harnessrl swe clean TASKS.jsonl --out CLEAN.jsonl [--report REPORT.json]

`clean` reads SWE-bench-format tasks (JSON lines or one JSON array, in the public datasets'
field names), drops those that fail the checks that need no environment (see
harnessrl.swe.clean), splits the rest by project, and writes them in the same format with a
`split` field ("train" or "val"). The report (read, kept, dropped by reason, examples) is
the last line printed, and written to --report when given.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harnessrl.cli.common import CliError, Progress


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "swe",
        help="make and clean coding tasks (SWE-bench format)",
        description="Coding tasks for training coding agents.",
    )
    stages = parser.add_subparsers(title="stages", metavar="STAGE")
    clean = stages.add_parser(
        "clean",
        help="check, deduplicate and split SWE-bench-format tasks",
        description="Read SWE-bench-format tasks, drop those that fail a check (schema, "
        "empty or leaking problem statement, gold patch empty or touching tests, too many "
        "tests, duplicates), split the rest by project and write them with a `split` field. "
        "Prints the report (counts by drop reason) as the last line.",
    )
    clean.add_argument("file", type=Path, metavar="TASKS", help="JSON lines or a JSON array")
    clean.add_argument("--out", type=Path, required=True, help="where the kept tasks go")
    clean.add_argument("--report", type=Path, help="also write the report (JSON) here")
    defaults = _defaults()
    for name, help_text in (
        ("min_statement_chars", "shortest problem statement kept"),
        ("max_fail_to_pass", "most FAIL_TO_PASS tests"),
        ("max_tests", "most FAIL_TO_PASS + PASS_TO_PASS tests"),
        ("near_duplicate", "statement similarity (word 3-gram Jaccard) that is a duplicate"),
        ("val_fraction", "share of tasks (whole projects) put in val"),
    ):
        value = defaults[name]
        clean.add_argument(
            "--" + name.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"{help_text} (default {value})",
        )
    clean.set_defaults(run=run_clean)
    parser.set_defaults(run=lambda _args: parser.print_help() or 2)


def _defaults() -> dict[str, Any]:
    from dataclasses import asdict

    from harnessrl.swe.clean import CleanSettings

    return asdict(CleanSettings())


def run_clean(args: argparse.Namespace) -> int:
    import orjson

    from harnessrl.swe.clean import CleanSettings, clean, split_by_project
    from harnessrl.swe.tasks import read_records, to_record

    if not args.file.is_file():
        raise CliError(f"{args.file}: no such file")
    settings = CleanSettings(**{name: getattr(args, name) for name in _defaults()})
    if not 0.0 <= settings.val_fraction < 1.0:
        raise CliError(f"--val-fraction: must be in [0, 1), not {settings.val_fraction}")
    progress = Progress("swe clean", None)

    def counted(records: Any) -> Any:
        for done, record in enumerate(records, 1):
            progress.update(done, "records read")
            yield record

    kept, report = clean(counted(read_records(args.file)), settings)
    progress.close()
    splits = split_by_project(kept, settings.val_fraction)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("wb") as out:
        for task in kept:
            out.write(orjson.dumps(to_record(task) | {"split": splits[task.project]}) + b"\n")
    summary = report.as_json() | {
        "projects": {
            split: sum(1 for s in splits.values() if s == split) for split in ("train", "val")
        },
        "out": str(args.out),
    }
    line = orjson.dumps(summary).decode()
    if args.report is not None:
        args.report.write_text(line + "\n")
    print(line, file=sys.stdout)
    return 0
