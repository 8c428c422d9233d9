"""`harnessrl reward` (imports nothing heavy)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harnessrl.command import CliError, add_kafka_options, load


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "reward",
        help="run the reward service (scores finished episodes)",
        description="Consume EpisodeFinished from hrl.episodes, score each final attempt with "
        "the configured reward (builtin:answer, builtin:tests, entrypoint:<module>:<function> "
        "or grpc:<host>:<port>) and publish RewardAssigned on hrl.rewards.",
    )
    parser.add_argument(
        "--source",
        metavar="SOURCE",
        help="the reward (reward.source), e.g. builtin:tests or entrypoint:my_pkg.rewards:score",
    )
    add_kafka_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.runtime import serve
    from harnessrl.services.reward.config import RewardConfig
    from harnessrl.services.reward.service import RewardService

    flags = {"source": args.source}
    config = load(RewardConfig, args, reward={k: v for k, v in flags.items() if v})
    try:
        return serve("reward", config, config.reward, lambda rt: RewardService(config, rt))
    except ValueError as err:
        raise CliError(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harnessrl.services.reward")
    register(parser.add_subparsers())
    args = parser.parse_args(["reward", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.run(args)
    return code
