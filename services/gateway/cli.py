"""`harnessrl gateway`: command-line flags of the gateway (imports nothing heavy)."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.command import add_kafka_options, load, module_main, serve_service


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "gateway",
        help="run the gateway harnesses call (OpenAI and Anthropic APIs)",
        description="Serve OpenAI's chat and completions APIs and Anthropic's Messages API "
        "to harnesses, per episode (/e/<token>/v1/... or the token as API key), forward "
        "every call to an engine with exact token ids and log-probs, and capture it as a "
        "ModelCall on hrl.calls. Needs gateway.token_secret and gateway.admin_token.",
    )
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8000; 0 picks one)")
    parser.add_argument(
        "--admin-port",
        type=int,
        help="serve the admin API only on this port (default: on --port)",
    )
    parser.add_argument(
        "--engine",
        action="append",
        metavar="URL",
        help="engine base URL (repeat for several; default from config)",
    )
    add_kafka_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.services.gateway.config import GatewayConfig
    from harnessrl.services.gateway.service import GatewayService

    flags = {
        "host": args.host,
        "port": args.port,
        "admin_port": args.admin_port,
        "engines": args.engine,
    }
    config = load(GatewayConfig, args, gateway={k: v for k, v in flags.items() if v is not None})
    return serve_service(
        "gateway",
        config,
        config.gateway,
        lambda rt: GatewayService(config, rt),
        health_endpoint=False,
        fast_loop=True,
    )


def main(argv: list[str] | None = None) -> int:
    return module_main("harnessrl.services.gateway", "gateway", register, argv)
