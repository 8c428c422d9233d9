"""The stack `harnessrl up` would run, with the controls a fault injector needs: SIGKILL one
service (its whole process group, as a container runtime would) and start it again with the
same ports, config and instance name; freeze a process group (SIGSTOP) for a while."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable

from harnessrl.apps.up.plan import ChildSpec, StackPlan
from harnessrl.apps.up.supervisor import Child


class ChaosStack:
    """Children of one plan; each line they write goes to `emit(name, line)`."""

    def __init__(self, plan: StackPlan, emit: Callable[[str, str], None]) -> None:
        self.plan = plan
        self._emit = emit
        self._specs = {spec.name: spec for spec in plan.children}
        self.children: dict[str, Child] = {}
        self._expected_exit: set[str] = set()

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.plan.children]

    def spec(self, name: str) -> ChildSpec:
        return self._specs[name]

    async def start(self, ready_timeout_s: float) -> None:
        """Start every child in plan order, each once the previous one is ready."""
        for spec in self.plan.children:
            await self._start(spec, ready_timeout_s)

    async def _start(self, spec: ChildSpec, ready_timeout_s: float) -> None:
        child = Child(spec, self._emit)
        self.children[spec.name] = child
        await child.start()
        await child.wait_ready(ready_timeout_s)

    async def kill_and_restart(self, name: str, ready_timeout_s: float) -> float:
        """SIGKILL `name`'s process group, start it again, wait until it is ready. Returns
        the seconds it was down. Raises UpError when it does not come back."""
        child = self.children[name]
        self._expected_exit.add(name)
        started = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        await child.stop(grace_s=1.0)  # reaps it and drains its output
        self._expected_exit.discard(name)
        await self._start(self._specs[name], ready_timeout_s)
        return time.monotonic() - started

    async def freeze(self, name: str, seconds: float) -> None:
        """SIGSTOP `name`'s process group for `seconds`, then SIGCONT (even if cancelled)."""
        pid = self.children[name].pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)

    def failure(self) -> str | None:
        """Why the stack is broken: a child that exited without being killed here."""
        for name, child in self.children.items():
            if child.returncode is not None and name not in self._expected_exit:
                return str(child.failure(f"exited on its own with code {child.returncode}"))
        return None

    async def stop(self, names: list[str] | None = None, grace_s: float = 30.0) -> None:
        """Stop the named children (default all), in reverse start order."""
        order = [n for n in reversed(self.names) if n in self.children]
        for name in order if names is None else [n for n in order if n in names]:
            self._expected_exit.add(name)
            await self.children[name].stop(grace_s)
