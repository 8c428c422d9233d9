"""The `harnessrl` command line.

Sub-commands live in sibling modules; each registers its parser and imports what it needs
only when it runs, so `harnessrl --help` never loads aiokafka, torch or OpenTelemetry.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from harnessrl import __version__, registry
from harnessrl.apps.cli import (
    bench,
    chaos,
    config_cmd,
    doctor,
    episode,
    events_cmd,
    experiment,
    feedback,
    policy,
    sessions,
    submit,
    swe,
    trace,
    up,
)
from harnessrl.command import CliError

_TOOLS = (
    submit,
    events_cmd,
    config_cmd,
    bench,
    trace,
    up,
    episode,
    experiment,
    doctor,
    chaos,
    swe,
    feedback,
    sessions,
    policy,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harnessrl",
        description="Reinforcement learning through the real agent harness.",
    )
    parser.add_argument("--version", action="version", version=f"harnessrl {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name in registry.command_modules():  # the services, as the registry lists them
        importlib.import_module(name).register(commands)
    for module in _TOOLS:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        code: int = args.run(args)
        return code
    except CliError as err:
        print(f"harnessrl: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
