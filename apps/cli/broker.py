"""`harnessrl broker`: run the embedded Kafka-protocol broker with every topic created."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.command import add_config_option, load


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "broker",
        help="run the embedded broker (Tansu, in memory) and create the topics",
        description="Run the embedded Kafka-protocol broker (Tansu, in-memory storage) in the "
        "foreground and create every harnessrl topic. Ctrl-C stops it.",
    )
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="Kafka port (default 9092; 0 picks one)")
    parser.add_argument("--advertised-host", help="host name clients should connect to")
    add_config_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.broker import BrokerConfig, BrokerService
    from harnessrl.runtime import serve

    section = {
        key: value
        for key, value in (
            ("listen_host", args.host),
            ("listen_port", args.port),
            ("advertised_host", args.advertised_host),
        )
        if value is not None
    }
    config = load(BrokerConfig, args, broker=section)

    def ready(bootstrap: str) -> None:
        print(f"harnessrl broker: Kafka listening on {bootstrap} (Ctrl-C to stop)", flush=True)

    return serve("broker", config, config.broker, lambda _: BrokerService(config, on_ready=ready))
