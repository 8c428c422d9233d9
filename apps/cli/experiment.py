"""`harnessrl experiment`: evaluate, train for a fixed number of steps, evaluate, report."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from harnessrl.command import CliError, add_config_option, read_tasks


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "experiment",
        help="measure on val, train N steps, measure again, write a report",
        description="Start the stack (`harnessrl up --config FILE`) or use a running one "
        "(--stack), run the val tasks through the harness with the base policy, train on the "
        "train tasks until the trainer has taken --steps steps, run the val tasks again with "
        "the trained policy, and write RUN_DIR/report.html, report.png and metrics.json. The "
        'last line printed is JSON: {"val_before", "val_after", "episodes", "steps", '
        '"minutes"}.',
    )
    add_config_option(parser)
    parser.add_argument(
        "--stack", type=Path, metavar="FILE", help="stack.json of a running `harnessrl up`"
    )
    parser.add_argument("--train", type=Path, required=True, metavar="FILE", help="train tasks")
    parser.add_argument("--val", type=Path, required=True, metavar="FILE", help="val tasks")
    parser.add_argument("--steps", type=int, required=True, metavar="N", help="training steps")
    parser.add_argument(
        "--run-dir", type=Path, metavar="DIR", help="where results go (default runs/<run-id>)"
    )
    parser.add_argument(
        "--group-size", type=int, metavar="N", help="episodes per train task (default: task's)"
    )
    parser.add_argument(
        "--val-group-size", type=int, default=1, metavar="N", help="episodes per val task (1)"
    )
    parser.add_argument(
        "--backlog", type=int, default=2, metavar="N", help="train groups kept submitted (2)"
    )
    parser.add_argument(
        "--max-train-minutes",
        type=float,
        default=30.0,
        metavar="M",
        help="stop training after M minutes even short of --steps (30)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.apps.experiment.driver import ExperimentError, ExperimentOptions, run_experiment
    from harnessrl.apps.experiment.report import write_report

    if (args.config is None) == (args.stack is None):
        raise CliError("give exactly one of --config (start a stack) and --stack (use one)")
    for name in ("steps", "val_group_size", "backlog"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')}: must be at least 1")
    train, val = read_tasks(args.train), read_tasks(args.val)
    run_dir = args.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    options = ExperimentOptions(
        run_dir=run_dir,
        train=train,
        val=val,
        steps=args.steps,
        config=args.config,
        stack_file=args.stack,
        group_size=args.group_size,
        val_group_size=args.val_group_size,
        backlog=args.backlog,
        max_train_minutes=args.max_train_minutes,
    )
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        metrics = asyncio.run(run_experiment(options, sys.stderr))
    except ExperimentError as err:
        raise CliError(str(err)) from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("harnessrl experiment: interrupted; the stack was stopped", file=sys.stderr)
        return 130
    metrics["trace_hint"] = _trace_hint(metrics.pop("sampled_episodes"), run_dir)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    html, png = write_report(metrics, run_dir)
    print(f"report: {html}\nfigure: {png}", file=sys.stderr)
    if metrics["trace_hint"]:
        print(metrics["trace_hint"], file=sys.stderr)
    print(json.dumps(metrics["summary"]), flush=True)
    return 0


def _trace_hint(candidates: list[str], run_dir: Path) -> str:
    """The `harnessrl trace` command for a trained episode whose spans reach a step."""
    from harnessrl.telemetry.jsonl import read_spans
    from harnessrl.telemetry.tracetree import episode_path, from_otlp

    traces = run_dir / "stack" / "traces.jsonl"
    if not traces.is_file():
        return ""
    spans = [from_otlp(s) for s in read_spans(traces)]
    for episode_id in candidates:
        path = episode_path(spans, episode_id)
        if path is not None and path.steps:
            return (
                f"follow episode {episode_id} from its calls to the step that trained it: "
                f"harnessrl trace {episode_id} --spans {traces}"
            )
    return ""
