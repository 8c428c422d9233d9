"""`harnessrl controller` and `harnessrl status` (imports nothing heavy)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from harnessrl.command import CliError, add_kafka_options, load, module_main, serve_service


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "controller",
        help="run the episode controller (harness runs per task)",
        description="Consume hrl.tasks, run the configured harness once per episode (local "
        "processes or Kubernetes Jobs) pointed at the gateway, close each episode at the "
        "gateway and report EpisodeStarted/EpisodeFinished on hrl.episodes. Needs "
        "controller.harness, controller.token_secret and controller.admin_token.",
    )
    parser.add_argument("--gateway", metavar="URL", help="gateway base URL for harnesses")
    parser.add_argument("--runner", choices=["local", "kubernetes"], help="where harnesses run")
    add_kafka_options(parser)
    parser.set_defaults(run=run)
    status = commands.add_parser(
        "status",
        help="groups and episodes: in flight, finished, failed, by policy version",
        description="Read hrl.tasks and hrl.episodes from the beginning and summarise: groups "
        "submitted / complete / in progress, episodes by status and by policy version, "
        "attempts retried.",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    add_kafka_options(status)
    status.set_defaults(run=run_status)


def run(args: argparse.Namespace) -> int:
    from harnessrl.services.controller.config import ControllerConfig
    from harnessrl.services.controller.service import ControllerService

    flags = {"gateway_url": args.gateway, "runner": args.runner}
    config = load(ControllerConfig, args, controller={k: v for k, v in flags.items() if v})
    return serve_service(
        "controller", config, config.controller, lambda rt: ControllerService(config, rt)
    )


def run_status(args: argparse.Namespace) -> int:
    from harnessrl.config import ServiceConfig
    from harnessrl.services.controller.status import collect, render

    config = load(ServiceConfig, args)
    try:
        summary = asyncio.run(collect(config.kafka))
    except Exception as err:
        raise CliError(
            f"cannot read the topics at {config.kafka.bootstrap_servers}: {err!r}"
        ) from None
    sys.stdout.write(render(summary, as_json=args.json))
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main("harnessrl.services.controller", "controller", register, argv)
