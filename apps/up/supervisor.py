"""One supervised child process: started in its own process group, its output relayed line
by line, readiness polled on /healthz, stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections import deque
from collections.abc import Callable

import httpx

from harnessrl.apps.up.plan import ChildSpec, UpError

TAIL_LINES = 40


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when `up` dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class Child:
    """A service process. `emit(name, line)` gets each output line (stdout and stderr).

    `stop()` is idempotent; the process is addressed by handle (its pid and process group),
    never by name.
    """

    def __init__(self, spec: ChildSpec, emit: Callable[[str, str], None]) -> None:
        self.spec = spec
        self._emit = emit
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._process: asyncio.subprocess.Process | None = None
        self._pumps: list[asyncio.Task[None]] = []

    @property
    def pid(self) -> int:
        if self._process is None:
            raise UpError(f"{self.spec.name} was not started")
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    def tail(self) -> list[str]:
        """Its last output lines, oldest first."""
        return list(self._tail)

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            *self.spec.argv,
            env={**os.environ, **self.spec.env},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches `up` only; `up` stops children in order
            preexec_fn=_die_with_parent,  # one prctl call: async-signal-safe enough
        )
        for stream in (self._process.stdout, self._process.stderr):
            assert stream is not None
            self._pumps.append(asyncio.create_task(self._pump(stream)))

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode(errors="replace").rstrip("\n")
            self._tail.append(text)
            self._emit(self.spec.name, text)

    async def wait(self) -> int:
        """Wait for the process to exit; returns its exit code."""
        if self._process is None:
            raise UpError(f"{self.spec.name} was not started")
        return await self._process.wait()

    async def wait_ready(self, timeout: float) -> None:
        """Poll the health URL until it answers 200. Raises UpError with the last output
        lines when the process exits first or `timeout` seconds pass."""
        try:
            async with asyncio.timeout(timeout), httpx.AsyncClient(timeout=2.0) as client:
                while self.returncode is None:
                    with contextlib.suppress(httpx.TransportError):  # not listening yet
                        response = await client.get(self.spec.health_url)
                        if response.status_code == 200:
                            return
                    await asyncio.sleep(0.2)
        except TimeoutError:
            raise self.failure(f"not ready within {timeout:.0f}s") from None
        await self._drain()
        raise self.failure(f"exited with code {self.returncode} while starting")

    def failure(self, reason: str) -> UpError:
        """An UpError naming this child, the reason and its last output lines."""
        tail = "\n".join(f"    {line}" for line in self._tail) or "    (no output)"
        return UpError(f"{self.spec.name} {reason}; its last output:\n{tail}")

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM the service, SIGKILL its whole process group after `grace_s` seconds.
        Idempotent; returns the exit code (None if it was never started)."""
        process = self._process
        if process is None:
            return None
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                self._emit(self.spec.name, f"still running after {grace_s:.0f}s: SIGKILL")
        with contextlib.suppress(ProcessLookupError):  # whatever it left in its group
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        await self._drain()
        return process.returncode

    async def _drain(self) -> None:
        # Output still buffered in the pipes belongs in the log; a grandchild holding a pipe
        # open must not hold up the stop, hence the bound.
        if self._pumps:
            await asyncio.wait(self._pumps, timeout=2.0)
            for pump in self._pumps:
                pump.cancel()
