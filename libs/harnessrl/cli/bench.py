"""`harnessrl bench ...`: benchmarks that print JSON figures (code in bench/)."""

from __future__ import annotations

import argparse
from typing import Any

from harnessrl.cli.common import add_kafka_options


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="run a benchmark and print JSON figures")
    sub = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    bus = sub.add_parser(
        "bus",
        help="bus producer->consumer throughput and latency vs raw aiokafka",
        description="Move ModelCall-sized events (2,000 prompt ids, 500 completion ids and "
        "log-probs) producer->consumer through the project's bus and through raw aiokafka "
        "with the same bytes, in the same run, on an embedded broker (or --bootstrap). "
        "The last line is one JSON object.",
    )
    bus.add_argument("--json", action="store_true", help="print only the JSON result line")
    bus.add_argument(
        "--events", type=int, default=5000, help="events per throughput run (default 5000)"
    )
    bus.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating bus/raw rounds; the median is reported (default 3)",
    )
    add_kafka_options(bus)
    bus.set_defaults(run=_run_bus)
    parser.set_defaults(run=lambda _: parser.print_help() or 2)


def _run_bus(args: argparse.Namespace) -> int:
    from harnessrl.bench import bus

    return bus.main(args)
