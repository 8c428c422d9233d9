"""`harnessrl submit FILE`: validate a JSON-lines task file, then publish it to hrl.tasks."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

from harnessrl.command import CliError, Progress, add_kafka_options, load, read_tasks


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "submit",
        help="submit tasks from a JSON-lines file to hrl.tasks",
        description="Validate every line of FILE, then publish one TaskSubmitted per line to "
        "hrl.tasks, each with a fresh group id. A bad line is reported with its line number "
        "and field, and then nothing from the file is sent. Prints one JSON line per task "
        '({"task_id", "group_id", "split"}) once the broker has acknowledged them all.',
    )
    parser.add_argument("file", type=Path, metavar="FILE", help="JSON-lines task file")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for the broker to acknowledge (default 60)",
    )
    add_kafka_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.config import ServiceConfig

    tasks = read_tasks(args.file, after_error="; nothing was submitted")
    config = load(ServiceConfig, args)
    return asyncio.run(_submit(tasks, config, args.timeout))


async def _submit(tasks: list[Any], config: Any, timeout: float) -> int:
    import orjson

    from harnessrl import events
    from harnessrl.bus import Producer, ensure_topics
    from harnessrl.tasks import new_group_id, to_event

    bootstrap = config.kafka.bootstrap_servers
    if config.kafka.create_topics:
        try:
            await ensure_topics(config.kafka, [events.TASKS], max_attempts=5)
        except Exception as err:
            raise CliError(f"cannot reach Kafka at {bootstrap}: {err!r}") from None
    # A private spill directory: what is not acknowledged here must not be sent later by
    # surprise; the command reports it instead.
    with tempfile.TemporaryDirectory(prefix="harnessrl-submit-") as spill:
        settings = config.producer.model_copy(update={"spill_dir": Path(spill), "wal": False})
        producer = Producer(config.kafka, settings, name=f"submit/{config.instance}")
        await producer.start()
        rows = []
        try:
            deliveries = []
            for task in tasks:
                group_id = new_group_id()
                deliveries.append(producer.publish(to_event(task, group_id)))
                rows.append({"task_id": task.task_id, "group_id": group_id, "split": task.split})
            progress = Progress("submit", len(tasks))
            acked = 0
            try:
                for delivery in asyncio.as_completed(deliveries, timeout=timeout):
                    await delivery
                    acked += 1
                    progress.update(acked)
            except TimeoutError:
                raise CliError(
                    f"{len(tasks) - acked} of {len(tasks)} tasks not acknowledged within "
                    f"{timeout:g}s (is Kafka at {bootstrap} up?)"
                ) from None
            progress.close()
        finally:
            await producer.stop(timeout=1.0)
    out = sys.stdout.buffer
    for row in rows:
        out.write(orjson.dumps(row) + b"\n")
    out.flush()
    print(f"submitted {len(rows)} tasks to {events.TASKS}", file=sys.stderr)
    return 0
