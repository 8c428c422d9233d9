"""`harnessrl sample-builder` (imports nothing heavy)."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.command import add_kafka_options, load, module_main, serve_service


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "sample-builder",
        help="run the sample builder (calls + episodes + rewards -> GroupSamples)",
        description="Join hrl.calls, hrl.episodes and hrl.rewards per group; when a group is "
        "complete, merge each episode's calls into training sequences from the recorded "
        "token ids, compute group advantages and publish GroupSamples on hrl.samples.",
    )
    parser.add_argument("--estimator", choices=["grpo", "rloo", "mean"], help="advantage estimator")
    parser.add_argument(
        "--tokenizer", metavar="DIR", help="model directory (classifies retokenization breaks)"
    )
    add_kafka_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.services.sample_builder.config import SampleBuilderConfig
    from harnessrl.services.sample_builder.service import SampleBuilderService

    flags = {"estimator": args.estimator, "tokenizer": args.tokenizer}
    config = load(SampleBuilderConfig, args, sample_builder={k: v for k, v in flags.items() if v})
    return serve_service(
        "sample-builder", config, config.sample_builder, lambda rt: SampleBuilderService(config, rt)
    )


def main(argv: list[str] | None = None) -> int:
    return module_main("harnessrl.services.sample_builder", "sample-builder", register, argv)
