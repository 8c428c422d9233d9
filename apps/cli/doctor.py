"""`harnessrl doctor`: run a harness's episodes through the stack and say whether training
through it will work (merging, tokens, tool calls, wire, outcome), before any GPU hour."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from harnessrl.command import CliError, add_config_option, read_tasks


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "doctor",
        help="run N episodes of the harness and report whether it will train well",
        description="Start the stack without its trainer (`harnessrl up --config FILE "
        "--without trainer --without sample-builder`, bodies captured) or use a running one "
        "(--stack), run --episodes episodes of the tasks through the configured harness, and "
        "report from the captured events alone: how calls merge into chains and why chains "
        "break, where the completion tokens go, tool calls that did not parse, what the wire "
        "carried (routes, errors, clamped budgets, sampling fields train mode overrides, "
        "context growth) and the outcome (statuses, rewards, groups without a signal). Each "
        "check gets ok/warn/fail with its threshold. Writes DIR/doctor.json and "
        "DIR/doctor.html; prints the summary. Exit code 0 unless a check fails (1).",
    )
    add_config_option(parser)
    parser.add_argument(
        "--stack", type=Path, metavar="FILE", help="stack.json of a running `harnessrl up`"
    )
    parser.add_argument("--tasks", type=Path, required=True, metavar="FILE", help="task file")
    parser.add_argument(
        "--episodes", type=int, default=16, metavar="N", help="episodes to run (16)"
    )
    parser.add_argument(
        "--mode",
        choices=["train", "val"],
        default="train",
        help="sampling of train episodes (the gateway's train overrides) or the harness's own "
        "(val); either way the report says what training would make of them (train)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=4,
        metavar="N",
        help="episodes per task when the task line names none (4)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="DIR", help="where the report goes (default runs/doctor-<time>)"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="stop waiting for episodes after this and report what arrived (1800)",
    )
    parser.add_argument(
        "--tool-markup",
        action="append",
        default=[],
        metavar="TEXT",
        help="text that starts a tool call in the model's output, beside the known formats "
        "(hermes <tool_call>, <function=, [TOOL_CALLS], ...); repeatable",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.apps.doctor.diagnose import DoctorError, DoctorOptions, run_doctor

    if args.config is None and args.stack is None:
        raise CliError("give --config (start a stack) or --stack (use a running one)")
    for name in ("episodes", "group_size"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')}: must be at least 1")
    tasks = read_tasks(args.tasks)
    if not tasks:
        raise CliError(f"{args.tasks}: no tasks")
    out = args.out or Path("runs") / time.strftime("doctor-%Y%m%d-%H%M%S")
    options = DoctorOptions(
        out=out,
        tasks=tasks,
        tasks_file=args.tasks,
        episodes=args.episodes,
        mode=args.mode,
        group_size=args.group_size,
        config=args.config,
        stack_file=args.stack,
        timeout_s=args.timeout,
        markups=tuple(args.tool_markup),
    )
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        report = asyncio.run(run_doctor(options, sys.stderr))
    except DoctorError as err:
        raise CliError(str(err)) from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("harnessrl doctor: interrupted", file=sys.stderr)
        return 130
    from harnessrl.apps.doctor.report_text import summary

    print(summary(report), flush=True)
    print(f"report: {out / 'doctor.html'}\njson: {out / 'doctor.json'}", flush=True)
    return 1 if report["verdict"] == "fail" else 0
