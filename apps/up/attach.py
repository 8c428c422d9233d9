"""A client's view of a `harnessrl up` stack: start one for a run, or read a running one's
stack file. Used by `harnessrl experiment` and `harnessrl doctor` through `stack_for_run`."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class StackError(RuntimeError):
    """The stack could not be started or read; the message says why (with its log's tail)."""


@dataclass(frozen=True, slots=True)
class RunningStack:
    bootstrap: str
    traces: Path
    urls: dict[str, str]
    """Base URL of each service (its /healthz and /metrics are below it)."""
    config: Path | None = None
    """The config file the stack was started with (None: the defaults)."""
    failure: Callable[[], str | None] = lambda: None
    """Why the stack is gone, once it is (None while it runs)."""


@contextlib.asynccontextmanager
async def stack_for(
    *,
    config: Path | None,
    stack_file: Path | None,
    workdir: Path,
    log_path: Path,
    progress: IO[str],
    env: Mapping[str, str] = {},
    without: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
) -> AsyncIterator[RunningStack]:
    """The running stack of `stack_file`, or (None) one started now with `harnessrl up
    --config config --workdir workdir`, its output in `log_path`, `env` on top of this
    process's environment, the services named in `without` left out; stopped (SIGINT, an
    orderly stop) on the way out, and with this process if it dies."""
    if stack_file is not None:
        yield read_stack(stack_file)
        return
    stack_path = _fresh(workdir)
    argv = [sys.executable, "-m", "harnessrl", "up", "--workdir", str(workdir)]
    if config is not None:
        argv += ["--config", str(config)]
    for name in without:
        argv += ["--without", name]
    progress.write(f"starting the stack (harnessrl up; its log: {log_path})\n")
    progress.flush()
    with log_path.open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=log_file,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "NO_COLOR": "1", **env},
            preexec_fn=_stop_with_parent,  # one prctl call: async-signal-safe enough
        )
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not stack_path.exists():
            if process.returncode is not None or time.monotonic() > deadline:
                raise StackError("the stack did not start:\n" + _tail(log_path))
            await asyncio.sleep(0.2)

        def failure() -> str | None:
            if process.returncode is None:
                return None
            return f"the stack stopped (exit {process.returncode}):\n" + _tail(log_path)

        stack = dataclasses.replace(read_stack(stack_path), failure=failure)
        progress.write(f"stack ready: kafka {stack.bootstrap}, traces {stack.traces}\n")
        yield stack
    finally:
        await _stop(process)


@contextlib.asynccontextmanager
async def stack_for_run(
    run_dir: Path,
    *,
    config: Path | None,
    stack_file: Path | None,
    progress: IO[str],
    error: type[Exception],
    env: Mapping[str, str] = {},
    without: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
) -> AsyncIterator[RunningStack]:
    """The stack of one run of a command (an experiment, a doctor run) that writes into
    `run_dir`: `stack_for` with the stack's state in run_dir/stack and its log in
    run_dir/up.log; SIGTERM cancels the run (so the stack is stopped in order), and a
    `StackError` becomes the command's own `error`, with the same message."""
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    main = asyncio.current_task()
    assert main is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    stack = stack_for(
        config=config,
        stack_file=stack_file,
        workdir=run_dir / "stack",
        log_path=run_dir / "up.log",
        progress=progress,
        env=env,
        without=without,
        ready_timeout_s=ready_timeout_s,
    )
    try:
        async with stack as running:
            yield running
    except StackError as err:
        raise error(str(err)) from None


def read_stack(path: Path) -> RunningStack:
    """The stack a `harnessrl up` stack file describes; StackError when it is not one."""
    try:
        data = json.loads(path.read_text())
        config = data.get("config")
        return RunningStack(
            bootstrap=data["bootstrap"],
            traces=Path(data["traces"]),
            urls={name: s["url"] for name, s in data["services"].items()},
            config=Path(config) if config else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise StackError(f"{path}: not a harnessrl up stack file ({err!r})") from None


def _fresh(workdir: Path) -> Path:
    """The stack file `up` will write in `workdir`, none there yet."""
    workdir.mkdir(parents=True, exist_ok=True)
    stack_path = workdir / "stack.json"
    stack_path.unlink(missing_ok=True)
    return stack_path


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _stop_with_parent() -> None:
    """In `up` before exec: SIGTERM it (an orderly stop) when the client dies (Linux)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(process.wait(), 90)
        except TimeoutError:
            process.kill()
            await process.wait()
