"""A producer process for crash tests: accepts events with `wal` on while no broker is up,
says "accepted", then waits to be killed with SIGKILL."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from harnessrl.bus import Producer
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.v1 import events_pb2 as pb


async def main(args: argparse.Namespace) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=args.bootstrap),
        ProducerSettings(spill_dir=Path(args.spill), wal=True),
        name="wal/0",
    )
    await producer.start()
    for i in range(args.count):
        producer.publish(pb.ModelCall(episode_id="e", attempt=1, group_id="g-wal", seq=i))
    print("accepted", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--spill", required=True)
    parser.add_argument("--count", type=int, required=True)
    asyncio.run(main(parser.parse_args()))
