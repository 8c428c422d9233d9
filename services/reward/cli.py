"""`harnessrl reward` (imports nothing heavy)."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.command import add_kafka_options, load, module_main, serve_service


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
    from harnessrl.services.reward.config import RewardConfig
    from harnessrl.services.reward.service import RewardService

    flags = {"source": args.source}
    config = load(RewardConfig, args, reward={k: v for k, v in flags.items() if v})
    return serve_service("reward", config, config.reward, lambda rt: RewardService(config, rt))


def main(argv: list[str] | None = None) -> int:
    return module_main("harnessrl.services.reward", "reward", register, argv)
