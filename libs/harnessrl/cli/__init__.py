"""The `harnessrl` command line.

Sub-commands live in sibling modules; each registers its parser and imports what it needs
only when it runs, so `harnessrl --help` never loads aiokafka, torch or OpenTelemetry.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from harnessrl import __version__
from harnessrl.cli import (
    bench,
    broker,
    chaos,
    config_cmd,
    doctor,
    episode,
    events_cmd,
    experiment,
    submit,
    swe,
    trace,
    up,
)
from harnessrl.cli.common import CliError
from harnessrl.services.controller import cli as controller
from harnessrl.services.gateway import cli as gateway
from harnessrl.services.inference import cli as inference
from harnessrl.services.reward import cli as reward
from harnessrl.services.sample_builder import cli as sample_builder
from harnessrl.services.trainer import cli as trainer

_COMMANDS = (
    broker,
    inference,
    gateway,
    controller,
    reward,
    sample_builder,
    trainer,
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
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harnessrl",
        description="Reinforcement learning through the real agent harness.",
    )
    parser.add_argument("--version", action="version", version=f"harnessrl {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module in _COMMANDS:
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
