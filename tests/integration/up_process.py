"""`harnessrl up` as a child process of a test: started as a user starts it, its output read
as it comes, its ready table parsed."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers import eventually

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ["broker", "inference", "gateway", "reward", "sample-builder", "trainer", "controller"]


async def start_up(workdir: Path, config: str = "examples/up.yaml") -> Up:
    """`harnessrl up --config CONFIG --workdir WORKDIR`, run from the repository root; the
    caller stops it (SIGINT, then `finish`; kill on failure)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harnessrl", "up", "--config", config, "--workdir", str(workdir),
        cwd=ROOT,
        env={**os.environ, "NO_COLOR": "1"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    return Up(process)


class Up:
    """The running `harnessrl up` process and the lines it printed so far."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    async def table(self, timeout: float) -> dict[str, tuple[int, str, str]]:
        """Wait for the ready table; service -> (pid, listens, health URL)."""

        async def printed() -> bool:
            if self.process.returncode is not None:
                pytest.fail("harnessrl up exited early:\n" + "\n".join(self.lines[-60:]))
            return any(line.startswith("harnessrl up: ready") for line in self.lines)

        await eventually(printed, timeout=timeout, interval=0.2)
        start = next(i for i, line in enumerate(self.lines) if line.startswith("harnessrl up:"))
        rows: dict[str, tuple[int, str, str]] = {}
        for line in self.lines[start + 2 :]:
            parts = line.split()
            if not line.startswith("  ") or parts[0] not in SERVICES:
                break
            rows[parts[0]] = (int(parts[1]), " ".join(parts[2:-1]), parts[-1])
        return rows

    async def finish(self, timeout: float) -> int:
        code = await asyncio.wait_for(self.process.wait(), timeout)
        await self._reader
        return code

    async def stop(self, timeout: float = 60) -> int:
        """Ctrl-C (an orderly stop of every service), then SIGKILL if it takes too long."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return await self.finish(timeout)
        except TimeoutError:
            self.process.kill()
            return await self.finish(timeout)
