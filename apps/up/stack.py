"""Start the stack in order, relay its merged log, stop it in reverse on a signal."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from harnessrl.apps.up.logview import LogView
from harnessrl.apps.up.plan import StackPlan, UpError, build_plan
from harnessrl.apps.up.stackfile import STACK_FILE, remove_stack_files, write_stack_file
from harnessrl.apps.up.supervisor import Child

READY_LINE = "harnessrl up: ready"
"""Printed, then the table of services, once every child answers /healthz."""


async def run_stack(
    config_file: Path | None,
    workdir: Path,
    *,
    out: Callable[[str], None],
    color: bool,
    ready_timeout_s: float = 180.0,
    grace_s: float = 30.0,
    without: frozenset[str] = frozenset(),
) -> int:
    """Run the whole stack until SIGINT/SIGTERM (exit code 0) or until a child fails to
    start or exits on its own (1). `workdir` must exist. Children are stopped in reverse
    start order, each with `grace_s` seconds between SIGTERM and SIGKILL, whatever ends the
    run. Raises UpError, pydantic.ValidationError or FileNotFoundError for a bad config."""
    from harnessrl.telemetry.receiver import OtlpReceiver

    remove_stack_files(workdir)  # a killed `up` leaves its own: they name a stack now gone
    receiver = OtlpReceiver(workdir / "traces.jsonl", port=0)
    await receiver.start()
    try:
        plan = build_plan(config_file, workdir, receiver.endpoint, without)
        view = LogView(["up", *(spec.name for spec in plan.children)], color=color)
        out(view.note(f"traces -> {receiver.path} (OTLP/gRPC on {receiver.endpoint})"))
        stack = Stack(plan, view, out, traces=receiver.path)
        return await stack.run(ready_timeout_s, grace_s)
    finally:
        await receiver.stop()


class Stack:
    """The children of one plan, started in order and stopped in reverse."""

    def __init__(
        self, plan: StackPlan, view: LogView, out: Callable[[str], None], *, traces: Path
    ) -> None:
        self._plan = plan
        self._view = view
        self._out = out
        self._traces = traces
        self._stack_file = traces.parent / STACK_FILE
        self._children: list[Child] = []
        self._stop = asyncio.Event()

    async def run(self, ready_timeout_s: float, grace_s: float) -> int:
        """Start, wait for a signal or a failure, stop. Returns the exit code."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        try:
            if await self._start(ready_timeout_s):
                data = stack_data(self._children, self._plan, self._traces)
                write_stack_file(self._stack_file, data, self._plan.gateway)
                self._out(
                    ready_table(
                        self._children,
                        self._plan.bootstrap,
                        self._traces,
                        self._stack_file,
                        feedback_url=self._plan.feedback_url,
                    )
                )
                await self._watch()
            return 0
        except UpError as err:
            self._out(self._view.note(f"error: {err}"))
            return 1
        finally:
            remove_stack_files(self._stack_file.parent)
            await self._stop_all(grace_s)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    async def _start(self, ready_timeout_s: float) -> bool:
        """Start each child once the previous one is ready; False when a signal came first."""
        for spec in self._plan.children:
            child = Child(spec, self._emit)
            self._children.append(child)
            await child.start()
            self._out(self._view.note(f"started {spec.name} pid={child.pid}"))
            if not await _unless_stopped(child.wait_ready(ready_timeout_s), self._stop):
                self._out(self._view.note("interrupted while starting"))
                return False
        return True

    async def _watch(self) -> None:
        """Until a signal; raises UpError when a child exits on its own before that."""
        waits = {asyncio.ensure_future(child.wait()): child for child in self._children}
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait([stopped, *waits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for future in (stopped, *waits):
                future.cancel()
        exited = [waits[f] for f in done if f in waits]
        if exited and not self._stop.is_set():
            raise exited[0].failure(f"exited on its own with code {exited[0].returncode}")

    async def _stop_all(self, grace_s: float) -> None:
        for child in reversed(self._children):
            self._out(self._view.note(f"stopping {child.spec.name} pid={child.pid}"))
            code = await child.stop(grace_s)
            self._out(self._view.note(f"{child.spec.name} exited code={code}"))

    def _emit(self, name: str, line: str) -> None:
        self._out(self._view.render(name, line))


async def _unless_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Await `work` unless `stop` is set first (then cancel it): True when it completed."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        task.result()  # its error, if any
        return True
    task.cancel()
    return False


def ready_table(
    children: list[Child],
    bootstrap: str,
    traces: Path,
    stack_file: Path,
    *,
    feedback_url: str | None = None,
) -> str:
    """`READY_LINE`, then one row per service: name, pid, where it listens, health URL;
    then the broker, the traces, the feedback API (a production stack's) and where the
    stack file is (never a secret)."""
    rows = [("SERVICE", "PID", "LISTENS", "HEALTH")]
    rows += [(c.spec.name, str(c.pid), c.spec.address, c.spec.health_url) for c in children]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{READY_LINE} (Ctrl-C stops everything)"]
    for row in rows:
        cells = "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
        lines.append(f"  {cells}  {row[3]}")
    lines.append(f"  kafka bootstrap {bootstrap}; traces in {traces}")
    if feedback_url is not None:
        lines.append(f"  feedback API {feedback_url} (POST /v1/feedback with an app's key)")
    lines.append(
        f"  stack file {stack_file} (gateway URLs and secrets, mode 0600): for "
        "`harnessrl episode open` and `harnessrl experiment --stack`"
    )
    lines.append("")
    return "\n".join(lines)


def stack_data(children: list[Child], plan: StackPlan, traces: Path) -> dict[str, object]:
    """What `STACK_FILE` says beside the gateway's access: `up`'s pid, the bootstrap
    servers, the traces file, the config file, the feedback API's base URL ("" when
    production.apps is not set), and each service's pid, base URL (its /healthz and
    /metrics are below it) and address."""
    services = {
        c.spec.name: {
            "pid": c.pid,
            "url": c.spec.health_url.removesuffix("/healthz"),
            "address": c.spec.address,
        }
        for c in children
    }
    return {
        "pid": os.getpid(),
        "bootstrap": plan.bootstrap,
        "traces": str(traces),
        "config": str(plan.config) if plan.config is not None else "",
        "feedback_url": plan.feedback_url or "",
        "services": services,
    }
