"""Test runs as contained process groups: bounded in time, cut off from the network.

A test run executes code the policy wrote, so it gets:

- its own session, hence its own process group: the command and every child it starts.
  When the run ends, times out or is cancelled, the whole group is killed (SIGTERM, then
  SIGKILL after the grace); nothing of it outlives the run. A child that starts its own
  session escapes the group: containing that needs a PID namespace or a cgroup, which this
  module does not use.
- a clean environment (`clean_env`): the caller's secrets and Python settings never reach
  the tests.
- no network, where asked: the command runs under `unshare --user --map-root-user --net`,
  in a new user and network namespace whose only interface is loopback (brought up, so
  suites that serve on localhost work). unshare and the loopback step exec the command, so
  the process we started is the command itself and killing its group works as without it
  (the user namespace is ours, so our signals reach it).
- a cap on the output kept: only its tail, for the score's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harnessrl.logs import get_logger

log = get_logger(__name__)

# Inside the new namespace, bring loopback up (test suites often serve on localhost), then
# exec the command: SIOCGIFFLAGS / SIOCSIFFLAGS with IFF_UP on "lo", no `ip` needed.
_LOOPBACK_UP = (
    "import fcntl,os,socket,struct,sys\n"
    "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
    "f=struct.unpack('16sH',fcntl.ioctl(s,0x8913,struct.pack('16sH',b'lo',0)))[1]\n"
    "fcntl.ioctl(s,0x8914,struct.pack('16sH',b'lo',f|1))\n"
    "s.close()\n"
    "os.execvp(sys.argv[1],sys.argv[1:])\n"
)
NETNS_PREFIX = (
    "unshare", "--user", "--map-root-user", "--net", "--", sys.executable, "-c", _LOOPBACK_UP
)  # fmt: skip
"""Runs the rest of the argv in new user and network namespaces: loopback only."""

_PROBE_TIMEOUT_S = 10.0
_READ_CHUNK = 64 * 1024
_LINE_LIMIT = 64 * 1024
"""Longer lines are not passed to `on_line` (a summary line is far shorter)."""


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


class NetworkPolicy:
    """Decides, once per instance, how test runs reach the network (settings `network`)."""

    def __init__(self, mode: Literal["auto", "off", "on"]) -> None:
        self._mode = mode
        self._problem: str | None = None
        self._probed = False
        self._lock = asyncio.Lock()

    async def prefix(self) -> tuple[str, ...]:
        """The argv prefix that puts a test run where it belongs; () for the host network.

        Probes the machine on the first call ("off" and "auto" only) and remembers the
        answer. Raises RuntimeError when the mode is "off" and the machine cannot make a
        network namespace.
        """
        if self._mode == "on":
            return ()
        async with self._lock:
            if not self._probed:
                self._problem = await _probe_netns()
                self._probed = True
                if self._problem is not None and self._mode == "auto":
                    log.warning(
                        "test runs will have the host's network: no network namespace here",
                        setting="reward.tests.network",
                        reason=self._problem,
                    )
        if self._problem is None:
            return NETNS_PREFIX
        if self._mode == "off":
            raise RuntimeError(
                f'reward.tests.network: "off", but this machine cannot make a network '
                f"namespace ({self._problem})"
            )
        return ()


async def _probe_netns() -> str | None:
    """None when `unshare` can run a command without network here, else why not."""
    if shutil.which(NETNS_PREFIX[0]) is None:
        return f"{NETNS_PREFIX[0]} is not installed"
    try:
        process = await asyncio.create_subprocess_exec(
            *NETNS_PREFIX,
            "true",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as err:
        return f"cannot start {NETNS_PREFIX[0]}: {err}"
    try:
        _, stderr = await asyncio.wait_for(process.communicate(), _PROBE_TIMEOUT_S)
    except TimeoutError:
        process.kill()
        await process.wait()
        return f"{NETNS_PREFIX[0]} did not answer in {_PROBE_TIMEOUT_S:g} s"
    if process.returncode != 0:
        detail = stderr.decode("utf-8", "replace").strip() or f"exit code {process.returncode}"
        return f"{' '.join(NETNS_PREFIX[:-1])} true: {detail}"
    return None


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
) -> RunOutcome:
    """Run `argv` as a new process group; see the module docstring.

    At `timeout_s` the group gets SIGTERM, then SIGKILL after `kill_grace_s`. However the
    run ends (exit, timeout, cancellation of this coroutine), whatever is left of the group
    is killed before this returns or raises. `on_line` gets each output line (without its
    newline); `pass_fds` are inherited by the command; `after_start` is called once it has
    started. Raises OSError when the command cannot be started.
    """
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        start_new_session=True,
        pass_fds=pass_fds,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    if after_start is not None:
        after_start()
    assert process.stdout is not None
    output = _Output(output_cap_bytes, on_line)
    reader = asyncio.create_task(output.read(process.stdout))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            await _terminate(process, kill_grace_s)
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


async def _terminate(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """SIGTERM to the group; back when it is gone or the grace is over."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    kill_group(process.pid, signal.SIGTERM)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(process.wait(), grace_s)
    # The command is gone; its children may still be finishing after their SIGTERM. Nothing
    # signals a group's end, so it is polled.
    while _group_alive(process.pid) and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)


def kill_group(pgid: int, sig: int) -> None:
    """Send `sig` to the process group; a group already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
