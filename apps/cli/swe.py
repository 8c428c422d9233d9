"""`harnessrl swe ...`: coding tasks for training coding agents (harnessrl.apps.swe).

    harnessrl swe synth --out DIR [--projects six,tabulate] [--jobs 2] [--candidates 150] ...
    harnessrl swe clean TASKS.jsonl --out CLEAN.jsonl [--validate] [--tasks-out TASKS.jsonl]

`synth` makes tasks from the pinned projects (see harnessrl.apps.swe.synth): DIR/tasks.jsonl in
the SWE-bench format, DIR/report.json; a rerun with the same DIR resumes where it stopped.

`clean` reads SWE-bench-format tasks (JSON lines or one JSON array, in the public datasets'
field names), drops those that fail the checks that need no environment (see
harnessrl.apps.swe.clean), with --validate also those that do not behave in their environment
(harnessrl.apps.swe.validate), splits the rest by project, and writes them in the same format
with a `split` field ("train" or "val"); --tasks-out also writes them as a harnessrl task
file for `harnessrl submit` (input for the harness, metadata for builtin:tests), and each
split beside it (TASKS.train.jsonl, TASKS.val.jsonl) for `harnessrl experiment`. The report
(read, kept, dropped by reason, examples, seconds) is the last line printed, and written to
--report when given.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harnessrl.command import CliError, Progress

if TYPE_CHECKING:
    from harnessrl.apps.swe.swebench import SweTask


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "swe",
        help="make and clean coding tasks (SWE-bench format)",
        description="Coding tasks for training coding agents.",
    )
    stages = parser.add_subparsers(title="stages", metavar="STAGE")
    _register_synth(stages)
    _register_clean(stages)
    parser.set_defaults(run=lambda _args: parser.print_help() or 2)


def _register_synth(stages: Any) -> None:
    from harnessrl.apps.swe.synth_settings import SynthSettings

    synth = stages.add_parser(
        "synth",
        help="make coding tasks from the pinned projects by injecting bugs",
        description="For each pinned project: fetch its sdist from the package index, build "
        "its test environment, find the tests that pass reliably, inject AST-mutation bugs "
        "and keep those that break 1..N tests. Writes DIR/tasks.jsonl (SWE-bench format) and "
        "DIR/report.json; resumable. Prints the report's summary as the last line.",
    )
    synth.add_argument("--out", type=Path, required=True, help="output directory (resumable)")
    synth.add_argument("--projects", help="comma-separated names (default: every pinned project)")
    defaults = SynthSettings()
    for name, help_text in (
        ("runs", "baseline runs a test must pass in every one of"),
        ("candidates", "most candidate bugs checked per project"),
        ("per_project", "most tasks kept per project"),
        ("max_fail_to_pass", "most tests one bug may break"),
        ("seed", "which candidates are drawn"),
        ("jobs", "candidates checked at once"),
        ("timeout_factor", "a candidate's run is cut at this times the baseline (+30 s)"),
        ("full_suite_s", "tasks run the whole suite when its baseline takes at most this (s)"),
    ):
        value = getattr(defaults, name)
        synth.add_argument(
            "--" + name.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"{help_text} (default {value})",
        )
    synth.add_argument(
        "--no-hold-back",
        dest="hold_back",
        action="store_false",
        help="keep every failing test in the task's repository (default: half of the failing "
        "test functions are held back from the harness, restored in the reward's copy)",
    )
    synth.set_defaults(run=run_synth)


def _register_clean(stages: Any) -> None:
    clean = stages.add_parser(
        "clean",
        help="check, validate, deduplicate and split SWE-bench-format tasks",
        description="Read SWE-bench-format tasks, drop those that fail a check (schema, "
        "empty or leaking problem statement, gold patch empty or touching tests, too many "
        "tests, duplicates; with --validate, misbehaving in their environment), split the "
        "rest by project and write them with a `split` field. Prints the report (counts by "
        "drop reason) as the last line.",
    )
    clean.add_argument("file", type=Path, metavar="TASKS", help="JSON lines or a JSON array")
    clean.add_argument("--out", type=Path, required=True, help="where the kept tasks go")
    clean.add_argument("--report", type=Path, help="also write the report (JSON) here")
    clean.add_argument(
        "--tasks-out", type=Path, help="also write the kept tasks as a harnessrl task file"
    )
    clean.add_argument(
        "--group-size", type=int, help="episodes per task in --tasks-out (default: the stack's)"
    )
    clean.add_argument(
        "--validate",
        action="store_true",
        help="run each task's tests before and after its gold patch in its environment",
    )
    clean.add_argument(
        "--validate-runs", type=int, default=2, help="rounds a task must pass (default 2)"
    )
    clean.add_argument("--jobs", type=int, default=2, help="tasks validated at once")
    clean.add_argument(
        "--test-command",
        help="for imported tasks without one: the test command (shell words, "
        "{junit_xml} where the JUnit report goes), run in the repository's root",
    )
    clean.add_argument(
        "--environment", help="for imported tasks without one: their environment (a venv)"
    )
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


def _defaults() -> dict[str, Any]:
    from dataclasses import asdict

    from harnessrl.apps.swe.clean import CleanSettings

    return asdict(CleanSettings())


def run_synth(args: argparse.Namespace) -> int:
    import orjson

    from harnessrl.apps.swe.projects import pinned
    from harnessrl.apps.swe.synth import synthesize
    from harnessrl.apps.swe.synth_settings import SynthSettings

    try:
        projects = pinned([p.strip() for p in args.projects.split(",")] if args.projects else None)
    except ValueError as err:
        raise CliError(f"--projects: {err}") from None
    settings = SynthSettings(
        **{name: getattr(args, name) for name in SynthSettings.__dataclass_fields__}
    )
    for name in ("runs", "candidates", "per_project", "max_fail_to_pass", "jobs"):
        if getattr(settings, name) < 1:
            raise CliError(f"--{name.replace('_', '-')}: must be at least 1")
    progress: dict[str, Progress] = {}

    def on_progress(project: str, done: int, total: int) -> None:
        if project not in progress:
            for bar in progress.values():
                bar.close()
            progress.clear()
            progress[project] = Progress(f"swe synth {project}", total)
        progress[project].update(done, "candidates checked")

    print(f"swe synth: {len(projects)} projects into {args.out}", file=sys.stderr)
    report = synthesize(projects, args.out, settings, on_progress)
    for bar in progress.values():
        bar.close()
    summary = {k: v for k, v in report.items() if k not in ("projects", "settings")}
    for project in report["projects"]:
        print(orjson.dumps(project).decode(), file=sys.stderr)
    print(orjson.dumps(summary).decode(), file=sys.stdout)
    return 1 if report["errors"] and not report["tasks"] else 0


def run_clean(args: argparse.Namespace) -> int:
    import orjson

    from harnessrl.apps.swe.clean import CleanSettings, clean, split_by_project
    from harnessrl.apps.swe.swebench import read_records, to_harnessrl, to_record
    from harnessrl.apps.swe.validate import ValidateSettings, validate_all

    if not args.file.is_file():
        raise CliError(f"{args.file}: no such file")
    settings = CleanSettings(**{name: getattr(args, name) for name in _defaults()})
    if not 0.0 <= settings.val_fraction < 1.0:
        raise CliError(f"--val-fraction: must be in [0, 1), not {settings.val_fraction}")
    if args.validate_runs < 1 or args.jobs < 1:
        raise CliError("--validate-runs and --jobs: must be at least 1")
    started = time.monotonic()
    progress = Progress("swe clean", None)

    def counted(records: Any) -> Any:
        for done, record in enumerate(records, 1):
            progress.update(done, "records read")
            yield record

    kept, report = clean(counted(read_records(args.file)), settings)
    progress.close()
    if args.validate:
        kept = [_with_defaults(task, args) for task in kept]
        checking = Progress("swe clean --validate", len(kept))
        verdicts: list[tuple[SweTask, str | None]] = []

        def on_done(task: SweTask, reason: str | None) -> None:
            verdicts.append((task, reason))
            checking.update(len(verdicts), f"{sum(r is None for _, r in verdicts)} valid")

        results = validate_all(
            kept, ValidateSettings(runs=args.validate_runs, jobs=args.jobs), on_done
        )
        checking.close()
        kept = []
        for task, reason in results:
            if reason is None:
                kept.append(task)
            else:
                report.drop(reason, task.instance_id)
        report.kept = len(kept)
    splits = split_by_project(kept, settings.val_fraction)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("wb") as out:
        for task in kept:
            out.write(orjson.dumps(to_record(task) | {"split": splits[task.project]}) + b"\n")
    if args.tasks_out is not None:
        args.tasks_out.parent.mkdir(parents=True, exist_ok=True)
        lines = [to_harnessrl(task, splits[task.project], args.group_size) for task in kept]
        with args.tasks_out.open("wb") as out:
            out.writelines(orjson.dumps(line) + b"\n" for line in lines)
        for split in ("train", "val"):  # for `harnessrl experiment --train ... --val ...`
            path = args.tasks_out.with_suffix(f".{split}.jsonl")
            with path.open("wb") as out:
                out.writelines(orjson.dumps(x) + b"\n" for x in lines if x["split"] == split)
    summary = report.as_json() | {
        "validated": bool(args.validate),
        **({"hidden_cases": _case_counts(kept)} if args.validate else {}),
        "projects": {
            split: sum(1 for s in splits.values() if s == split) for split in ("train", "val")
        },
        "tasks": {
            split: sum(1 for t in kept if splits[t.project] == split) for split in ("train", "val")
        },
        "seconds": round(time.monotonic() - started, 1),
        "out": str(args.out),
        **({"tasks_out": str(args.tasks_out)} if args.tasks_out else {}),
    }
    text = orjson.dumps(summary).decode()
    if args.report is not None:
        args.report.write_text(text + "\n")
    print(text, file=sys.stdout)
    return 0


def _case_counts(tasks: list[SweTask]) -> dict[str, Any]:
    """How many kept tasks hold hidden cases, how many each holds (median, min, max), and
    the tasks without any, by the reason none could be made."""
    import statistics
    from collections import Counter

    counts = [
        len(cases["cases"])
        for task in tasks
        if isinstance(cases := task.extra.get("hidden_cases"), dict)
    ]
    missing = Counter(str(t.extra["hidden_cases_missing"]) for t in tasks
                      if "hidden_cases_missing" in t.extra)  # fmt: skip
    summary: dict[str, Any] = {"tasks": len(counts), "without": dict(missing)}
    if counts:
        summary |= {"median": statistics.median(counts), "min": min(counts), "max": max(counts)}
    return summary


def _with_defaults(task: SweTask, args: argparse.Namespace) -> SweTask:
    """The task with --test-command / --environment where its record has none."""
    import shlex
    from dataclasses import replace

    extra = dict(task.extra)
    if "test_command" not in extra and args.test_command:
        extra["test_command"] = shlex.split(args.test_command)
    if "environment" not in extra and args.environment:
        extra["environment"] = args.environment
    return replace(task, extra=extra) if extra != task.extra else task
