"""One broker for a whole test module, and the calls of one episode on it.

Module-scoped stacks keep suites that need many short calls fast; their tests tell each
other's calls apart by episode id (each test uses episodes of its own)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import ensure_topics
from harnessrl.config import KafkaSettings
from harnessrl.v1 import events_pb2 as pb
from tests.integration.gateway_stack import Stack


@asynccontextmanager
async def embedded_broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    """A fresh embedded broker with every harnessrl topic, stopped by its handle on exit."""
    broker = EmbeddedBroker(port=0, log_path=tmp_path / "broker.log")
    await broker.start()
    try:
        await ensure_topics(KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3))
        yield broker
    finally:
        await broker.stop()


async def episode_calls(
    stack: Stack, episode: str, count: int, timeout: float = 30.0
) -> list[pb.ModelCall]:
    """The ModelCalls of `episode` on hrl.calls in seq order, once there are `count` (or
    what there is after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        calls = [c for c in await stack.calls() if c.episode_id == episode]
        if len(calls) >= count or time.monotonic() > deadline:
            return sorted(calls, key=lambda c: c.seq)
        await asyncio.sleep(0.1)
