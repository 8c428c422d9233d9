"""A test run as a process group: bounded in time, its output's tail kept, with a clean
environment.

`run_group` starts a command (the test jail's bwrap, see `jail.py`) in its own session,
hence its own process group. When the run ends, times out or is cancelled, the whole group
is killed (SIGTERM, then SIGKILL after the grace); the jail's PID namespace then takes
every process the run started with it. Only the tail of the output is kept, for the
score's message. `clean_env` is the run's whole environment: the caller's secrets and
Python settings never reach the tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harnessrl.process_group import kill_group, terminate_group

_READ_CHUNK = 64 * 1024
_LINE_LIMIT = 64 * 1024
"""Longer lines are not passed to `on_line` (a summary line is far shorter)."""


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    """Write `data` and close; a command that exits without reading it all is not an error."""
    with contextlib.suppress(ConnectionError):
        pipe.write(data)
        await pipe.drain()
        pipe.close()


def _ignore_result(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved


def clean_env(home: Path, tmp: Path) -> dict[str, str]:
    """The environment of a test run, and nothing else.

    PATH: the caller's, so the task's tools are found. HOME and TMPDIR: directories of the
    run (deleted with it), so nothing lands in the caller's. LANG: a UTF-8 locale, so tools
    do not fall back to ASCII. PYTHONDONTWRITEBYTECODE: no .pyc files in the copy.
    PYTHONNOUSERSITE: no user site-packages (HOME is the run's, but a test may point HOME
    into the copy). Everything else (PYTHONPATH, VIRTUAL_ENV, PYTEST_*, credentials,
    proxies) is left out.
    """
    return {
        "PATH": os.environ.get("PATH", os.defpath),
        "HOME": str(home),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONNOUSERSITE": "1",
    }


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """How a test run ended."""

    exit_code: int | None
    """The command's exit status (negative: killed by that signal); None when timed out."""
    timed_out: bool
    output_tail: bytes
    """The end of stdout and stderr together, at most the cap."""


class _Output:
    """Keeps the tail of a stream, and hands each complete line to a callback."""

    def __init__(self, cap: int, on_line: Callable[[bytes], None] | None) -> None:
        self.tail = bytearray()
        self._cap = cap
        self._on_line = on_line
        self._pending = bytearray()
        self._overlong = False

    async def read(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(_READ_CHUNK):
            self.tail += chunk
            if len(self.tail) > self._cap:
                del self.tail[: len(self.tail) - self._cap]
            if self._on_line is not None:
                self._split(chunk)
        if self._on_line is not None and self._pending and not self._overlong:
            self._on_line(bytes(self._pending))

    def _split(self, chunk: bytes) -> None:
        assert self._on_line is not None
        self._pending += chunk
        while (end := self._pending.find(b"\n")) >= 0:
            if not self._overlong:
                self._on_line(bytes(self._pending[:end]))
            self._overlong = False
            del self._pending[: end + 1]
        if len(self._pending) > _LINE_LIMIT:
            self._overlong = True
            self._pending.clear()


async def run_group(
    argv: Sequence[str],
    *,
    cwd: Path,
    env: dict[str, str],
    timeout_s: float,
    kill_grace_s: float,
    output_cap_bytes: int,
    on_line: Callable[[bytes], None] | None = None,
    pass_fds: Sequence[int] = (),
    after_start: Callable[[], None] | None = None,
    stdin: bytes | None = None,
) -> RunOutcome:
    """Run `argv` as a new process group; see the module docstring.

    At `timeout_s` the group gets SIGTERM, then SIGKILL after `kill_grace_s`. However the
    run ends (exit, timeout, cancellation of this coroutine), whatever is left of the group
    is killed before this returns or raises. `on_line` gets each output line (without its
    newline); `pass_fds` are inherited by the command; `after_start` is called once it has
    started; `stdin` is written to the command's standard input, which is then closed (no
    input at all when None). Raises OSError when the command cannot be started.
    """
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        start_new_session=True,
        pass_fds=pass_fds,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    if after_start is not None:
        after_start()
    assert process.stdout is not None
    output = _Output(output_cap_bytes, on_line)
    reader = asyncio.create_task(output.read(process.stdout))
    if stdin is not None:
        assert process.stdin is not None
        writer = asyncio.create_task(_feed(process.stdin, stdin))
        writer.add_done_callback(_ignore_result)  # a command that never reads: killed below
    timed_out = False
    try:
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            await terminate_group(process, kill_grace_s, linger=True)
    finally:
        kill_group(process.pid, signal.SIGKILL)  # leftovers: children, or all on cancellation
        await process.wait()
        # A child that left the group may still hold the pipe: do not wait for it forever.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reader, kill_grace_s)
    return RunOutcome(
        exit_code=None if timed_out else process.returncode,
        timed_out=timed_out,
        output_tail=bytes(output.tail),
    )
