"""A minimal service for lifecycle tests: `python -m tests.integration.workers.lifecycle_service`.

Its run() returns `--drain` seconds after stop() was called, or raises with `--fail`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from harnessrl.config import ServiceConfig, ServiceSection, load_config
from harnessrl.runtime import Runtime, serve


class LifecycleConfig(ServiceConfig):
    lifecycle: ServiceSection = ServiceSection()
    """This test service's runtime settings."""


class LifecycleService:
    def __init__(self, runtime: Runtime, drain_s: float, fail: bool) -> None:
        self._stopped = asyncio.Event()
        self._drain_s = drain_s
        self._fail = fail

    async def run(self) -> None:
        print("running", flush=True)
        if self._fail:
            raise RuntimeError("cannot reach the reward service")
        await self._stopped.wait()
        await asyncio.sleep(self._drain_s)
        print("drained", flush=True)

    async def stop(self) -> None:
        self._stopped.set()

    def health(self) -> dict[str, bool]:
        return {"running": not self._stopped.is_set()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--drain", type=float, default=0.0)
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    config = load_config(LifecycleConfig)
    sys.exit(
        serve(
            "lifecycle",
            config,
            config.lifecycle,
            lambda rt: LifecycleService(rt, args.drain, args.fail),
        )
    )
