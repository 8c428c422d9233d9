"""Sync-mode weight swaps: pause the gateways, wait for the engines, resume.

Follows hrl.policy (its own consumer group per trainer instance, from the beginning) to
know which version each engine serves, and publishes the ControlCommands. Command ids are
derived from the version, so a trainer that restarts mid-swap repeats the same commands
and the gateways apply each once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from harnessrl.bus import Context, Producer
from harnessrl.logs import get_logger
from harnessrl.service_bus import Handlers
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


class EngineWatch:
    def __init__(self, producer: Producer, *, expected: int) -> None:
        self._producer = producer
        self._expected = expected
        self.loaded: dict[str, int] = {}
        """Newest version each engine reported loading."""
        self._changed = asyncio.Event()
        self.handlers: Handlers = {pb.PolicyLoaded: self._on_loaded}
        """What it consumes (from hrl.policy, in a consumer group of its trainer instance)."""

    async def _on_loaded(self, event: pb.PolicyLoaded, ctx: Context) -> None:
        if event.ok and event.version > self.loaded.get(event.engine, -1):
            self.loaded[event.engine] = event.version
            self._changed.set()

    def serving(self, version: int) -> int:
        """Engines that serve `version` or newer."""
        return sum(1 for v in self.loaded.values() if v >= version)

    async def pause(self, version: int) -> None:
        await self._command(pb.CONTROL_ACTION_PAUSE, version, f"sync swap to version {version}")

    async def resume(self, version: int) -> None:
        await self._command(pb.CONTROL_ACTION_RESUME, version, f"version {version} loaded")

    async def wait_loaded(self, version: int, timeout_s: float) -> bool:
        """Until `expected` engines serve `version`; False (logged) after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.serving(version) < self._expected:
            self._changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                log.error(
                    "engines did not load the version in time; going on",
                    version=version,
                    serving=self.serving(version),
                    expected=self._expected,
                )
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                continue
        return True

    async def _command(self, action: Any, version: int, reason: str) -> None:
        name = pb.ControlAction.Name(action).removeprefix("CONTROL_ACTION_").lower()
        await self._producer.publish(
            pb.ControlCommand(
                command_id=f"{name}-{version}",
                action=action,
                reason=reason,
                policy_version=version,
            )
        )
