"""`harnessrl up`: every service on this machine, started in order, one merged log."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from harnessrl.apps.up.stackfile import DEFAULT_WORKDIR, STACK_FILE
from harnessrl.command import CliError, add_config_option


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "up",
        help="run the whole stack here: broker, engine, gateway, reward, builder, trainer, "
        "controller",
        description="Start the embedded broker, a local OTLP trace receiver, and every "
        "service as child processes, in order, each once the previous one is ready; print "
        f"their logs merged. Once all are ready, WORKDIR/{STACK_FILE} (mode 0600) says where "
        "each listens and holds the gateway's secrets, for `harnessrl episode` and "
        "`harnessrl experiment --stack`. Ctrl-C stops them in reverse order.",
    )
    add_config_option(parser)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=DEFAULT_WORKDIR,
        help="state of this run: traces, episodes, checkpoints, spill, the stack file "
        f"(default {DEFAULT_WORKDIR})",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=180.0,
        metavar="SECONDS",
        help="longest each service may take to answer /healthz (default 180)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="time between SIGTERM and SIGKILL when stopping each service (default 30)",
    )
    parser.add_argument(
        "--without",
        action="append",
        default=[],
        choices=["trainer", "sample-builder"],
        metavar="SERVICE",
        help="leave a service out: trainer or sample-builder (repeatable); episodes still run, "
        "are captured and rewarded (what `harnessrl doctor` starts)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from pydantic import ValidationError

    from harnessrl.apps.up.plan import UpError
    from harnessrl.apps.up.stack import run_stack

    # The trace receiver runs gRPC threads in this process while it forks the children;
    # they exec at once, so gRPC's fork handlers (and their warning) are not needed.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    color = sys.stdout.isatty() and "NO_COLOR" not in os.environ

    def out(text: str) -> None:
        print(text, flush=True)

    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.config is not None:
        args.config = args.config.resolve()
        home = project_dir(args.config, Path.cwd())
        if home != Path.cwd():
            out(f"up: the relative paths in {args.config} resolve from {home}; running there")
            os.chdir(home)
    try:
        return asyncio.run(
            run_stack(
                args.config,
                args.workdir,
                out=out,
                color=color,
                ready_timeout_s=args.ready_timeout,
                grace_s=args.grace,
                without=frozenset(args.without),
            )
        )
    except (UpError, FileNotFoundError) as err:
        raise CliError(str(err)) from None
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        raise CliError(f"invalid configuration: {problems}") from None


def project_dir(config: Path, cwd: Path) -> Path:
    """The directory a config's relative paths resolve from: the working directory, unless
    the config file's own directory or one of its parents holds more of the relative paths
    it names (the model, the tokenizer, the harness's script, ...); then the nearest such.
    So `harnessrl up --config /repo/examples/up.yaml` works from anywhere, and a config that
    names paths relative to where it is run keeps working there."""
    import yaml

    try:
        settings = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return cwd  # the config's own loading says what is wrong with it
    named = [s for s in _strings(settings) if _maybe_relative_path(s)]

    def held(directory: Path) -> int:
        return sum((directory / s).exists() for s in named)

    best, most = cwd, held(cwd)
    for directory in (config.parent, *config.parent.parents):
        if (count := held(directory)) > most:
            best, most = directory, count
    return best


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _maybe_relative_path(text: str) -> bool:
    return (
        "/" in text
        and "://" not in text
        and not text.startswith(("/", "~"))
        and "\n" not in text
        and len(text) < 512
    )
