"""`harnessrl chaos`: train through the stack while killing services; count what was lost."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harnessrl.apps.chaos import KILLABLE
from harnessrl.command import CliError, read_tasks

DEMO_CONFIG = Path("examples/calculator/demo.yaml")
DEMO_TASKS = Path("examples/calculator/tasks.py")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "chaos",
        help="train while services are killed and the broker frozen; count losses",
        description="Start the stack (as `harnessrl up --config FILE`; by default the "
        "calculator demo's) and train on it while, every ~--kill-every seconds, a service "
        "drawn at random is SIGKILLed with its process group and restarted, and the broker is "
        "frozen (SIGSTOP) --freezes times for --freeze seconds. Then stop submitting, let the "
        "groups in flight finish, and reconcile from the topics and the trainer's step "
        "journal: calls the harnesses were answered vs ModelCalls captured, samples trained "
        "twice, episodes neither finished nor retried. The last line is one JSON object.",
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEMO_CONFIG,
        metavar="FILE",
        help=f"the stack's config (default {DEMO_CONFIG})",
    )
    parser.add_argument(
        "--tasks",
        type=Path,
        metavar="FILE",
        help=f"train task file (default: 200 calculator tasks from {DEMO_TASKS})",
    )
    parser.add_argument("--minutes", type=float, default=5.0, metavar="M", help="faults for (5)")
    parser.add_argument(
        "--kill-every", type=float, default=20.0, metavar="S", help="seconds between kills (20)"
    )
    parser.add_argument("--freezes", type=int, default=2, metavar="N", help="broker freezes (2)")
    parser.add_argument(
        "--freeze", type=float, default=10.0, metavar="S", help="seconds per freeze (10)"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the services to kill (0)")
    parser.add_argument(
        "--sessions",
        type=float,
        default=0.5,
        metavar="PER_S",
        help="production sessions opened per second beside the episodes, their feedback "
        "sent later (0.5; 0: none)",
    )
    parser.add_argument(
        "--services",
        metavar="A,B",
        help="the services that may be killed (default: " + ",".join(KILLABLE) + ")",
    )
    parser.add_argument(
        "--workdir", type=Path, metavar="DIR", help="the stack's state (default runs/chaos-<time>)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print only the JSON line on stdout (progress: stderr)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.apps.chaos.trial import ChaosError, ChaosOptions, run_chaos
    from harnessrl.apps.up.plan import UpError

    if args.minutes <= 0 or args.kill_every <= 0 or args.freeze < 0 or args.freezes < 0:
        raise CliError("--minutes and --kill-every must be positive, --freeze(s) not negative")
    services = tuple(s.strip() for s in (args.services or ",".join(KILLABLE)).split(","))
    unknown = [s for s in services if s not in KILLABLE]
    if unknown or not services:
        raise CliError(f"--services: {unknown or 'none given'}; choose from {', '.join(KILLABLE)}")
    if not args.config.is_file():
        raise CliError(f"--config: {args.config} is not a file")
    workdir = args.workdir or Path("runs") / time.strftime("chaos-%Y%m%d-%H%M%S")
    workdir.mkdir(parents=True, exist_ok=True)
    tasks_file = args.tasks or _demo_tasks(workdir)
    tasks = [t for t in read_tasks(tasks_file) if t.split == "train"]
    if not tasks:
        raise CliError(f"{tasks_file}: no train tasks")
    options = ChaosOptions(
        config=args.config,
        tasks=tasks,
        workdir=workdir,
        minutes=args.minutes,
        kill_every_s=args.kill_every,
        freezes=args.freezes,
        freeze_s=args.freeze,
        seed=args.seed,
        services=services,
        sessions_per_s=args.sessions,
    )
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    log_path = workdir / "stack.log"
    try:
        with log_path.open("a", buffering=1) as log_file:
            figures = asyncio.run(run_chaos(options, sys.stderr, log_file))
    except (ChaosError, UpError) as err:
        raise CliError(f"{err}\n(the stack's log: {log_path})") from None
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("harnessrl chaos: interrupted; the stack was stopped", file=sys.stderr)
        return 130
    (workdir / "chaos.json").write_text(json.dumps(figures, indent=1) + "\n")
    if not args.json:
        for fault in figures["faults"]:
            print(f"  {fault}", file=sys.stderr)
    summary = {k: v for k, v in figures.items() if k != "faults"}
    print(json.dumps(summary), flush=True)
    balanced = (
        figures["calls_lost"] == 0
        and figures["samples_trained_twice"] == 0
        and figures["episodes_unaccounted"] == 0
        and figures["calls_conflicting"] == 0
        and figures.get("sessions_calls_lost", 0) == 0
        and figures.get("signals_missing", 0) == 0
        and figures.get("signals_doubled", 0) == 0
        and figures.get("rewards_conflicting", 0) == 0
    )
    return 0 if balanced else 1


def _demo_tasks(workdir: Path) -> Path:
    """200 train tasks of the calculator demo, written by its own generator."""
    if not DEMO_TASKS.is_file():
        raise CliError(f"--tasks: give a task file ({DEMO_TASKS} is not here to make one)")
    path = workdir / "train.jsonl"
    with path.open("w") as out:
        subprocess.run(
            [sys.executable, str(DEMO_TASKS), "--split", "train", "--n", "200", "--seed", "7"],
            stdout=out,
            check=True,
        )
    return path
