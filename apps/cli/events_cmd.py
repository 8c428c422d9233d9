"""`harnessrl events tail TOPIC`: print a topic's records as JSON lines."""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from typing import Any

from harnessrl.command import CliError, add_kafka_options, load


def register(commands: Any) -> None:
    parser = commands.add_parser("events", help="inspect the event topics")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    tail = sub.add_parser(
        "tail",
        help="print a topic's records as JSON lines",
        description="Print each record of TOPIC as one JSON line: its position, key, trace "
        "context and the decoded envelope (hrl.dlq records: the dead-letter reason and the "
        "original bytes, base64). Follows the topic until --max records were printed.",
    )
    tail.add_argument("topic", metavar="TOPIC", help="topic name, e.g. hrl.tasks")
    tail.add_argument(
        "--from-beginning",
        action="store_true",
        help="start at the oldest record (default: only new records)",
    )
    tail.add_argument("--max", type=int, metavar="N", help="exit after N records")
    tail.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="exit (code 1) if --max records did not arrive within S seconds",
    )
    add_kafka_options(tail)
    tail.set_defaults(run=run_tail)
    parser.set_defaults(run=lambda _: parser.print_help() or 2)


def record_json(record: Any) -> dict[str, Any]:
    """One consumed record as JSON-ready data (decoding failures are reported, not raised)."""
    from harnessrl import events

    headers = {k: v.decode("utf-8", "replace") for k, v in (record.headers or ())}
    data: dict[str, Any] = {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "key": record.key.decode("utf-8", "replace") if record.key is not None else None,
        "timestamp_ms": record.timestamp,
    }
    for name in ("traceparent", "tracestate"):
        if name in headers:
            data[name] = headers.pop(name)
    if record.topic == events.DLQ:
        data["dlq"] = {k[4:]: v for k, v in headers.items() if k.startswith("dlq.")}
        data["value_b64"] = base64.b64encode(record.value or b"").decode()
        return data
    try:
        envelope = events.decode(record.topic, record.value)
    except events.DecodeError as err:
        data["error"] = str(err)
        data["value_b64"] = base64.b64encode(record.value or b"").decode()
        return data
    meta, kind, event = events.unwrap(envelope)
    data["event_type"] = kind
    data["meta"] = events.to_dict(meta)
    data["event"] = events.to_dict(event)
    return data


def run_tail(args: argparse.Namespace) -> int:
    from harnessrl.config import ServiceConfig

    if args.max is not None and args.max < 1:
        raise CliError("--max: must be at least 1")
    config = load(ServiceConfig, args)
    return asyncio.run(_tail(args, config))


async def _tail(args: argparse.Namespace, config: Any) -> int:
    import orjson
    from aiokafka import AIOKafkaConsumer

    from harnessrl.bus import client_kwargs

    consumer = AIOKafkaConsumer(
        **client_kwargs(config.kafka, "harnessrl-events-tail"),
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest" if args.from_beginning else "latest",
    )
    try:
        await consumer.start()
    except Exception as err:
        await consumer.stop()
        raise CliError(f"cannot reach Kafka at {config.kafka.bootstrap_servers}: {err!r}") from None
    printed = 0
    out = sys.stdout.buffer
    try:
        if args.topic not in await consumer.topics():
            raise CliError(f"topic {args.topic!r} does not exist")
        consumer.subscribe([args.topic])
        async with asyncio.timeout(args.timeout):
            while args.max is None or printed < args.max:
                batch = await consumer.getmany(timeout_ms=500)
                for records in batch.values():
                    for record in records:
                        if args.max is not None and printed >= args.max:
                            break
                        out.write(orjson.dumps(record_json(record)) + b"\n")
                        printed += 1
                out.flush()
    except TimeoutError:
        print(
            f"harnessrl: {printed} of {args.max} records within {args.timeout:g}s", file=sys.stderr
        )
        return 1
    finally:
        await consumer.stop()
    return 0
