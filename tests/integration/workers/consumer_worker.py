"""A consumer process for crash tests: `python -m tests.integration.workers.consumer_worker`.

Consumes hrl.tasks slowly; for each task it publishes an EpisodeStarted (an output the
commit must wait for) and appends "<run> <partition> <offset>" to --log once handled. A
parent test kills it with SIGKILL mid-batch and starts it again.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

from harnessrl.bus import Consumer, Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP


async def main(args: argparse.Namespace) -> None:
    kafka = KafkaSettings(bootstrap_servers=args.bootstrap)
    producer = Producer(
        kafka, ProducerSettings(spill_dir=Path(args.spill)), name=f"worker/{args.run}"
    )
    await producer.start()
    log = Path(args.log).open("a")  # noqa: SIM115 - lives as long as the process

    async def handle(record: Any, ctx: Any) -> None:
        await asyncio.sleep(args.delay)
        task = record.event
        ctx.publish(
            pb.EpisodeStarted(
                episode_id=f"ep-{task.task_id}",
                attempt=1,
                group_id=task.group_id,
                task_id=task.task_id,
            )
        )
        log.write(f"{args.run} {record.partition} {record.offset}\n")
        log.flush()

    consumer = Consumer(
        kafka,
        ConsumerSettings(max_poll_records=args.batch, **FAST_GROUP),
        topics=["hrl.tasks"],
        group_id=args.group,
        handler=handle,
        producer=producer,
    )
    loop = asyncio.get_running_loop()
    stopping = set()
    loop.add_signal_handler(
        signal.SIGTERM, lambda: stopping.add(asyncio.ensure_future(consumer.stop()))
    )
    await consumer.run()
    await producer.stop()
    log.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("bootstrap", "group", "log", "spill", "run"):
        parser.add_argument(f"--{name}", required=True)
    parser.add_argument("--delay", type=float, default=0.01)
    parser.add_argument("--batch", type=int, default=40)
    asyncio.run(main(parser.parse_args()))
