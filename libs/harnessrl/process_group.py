"""Process groups: what the controller's harness runs, the reward's test runs, `harnessrl up`
and chaos start, each child in a session of its own so that one signal reaches everything it
started.

A group that is already gone is not an error for `kill_group`; a group whose members belong
to another user (a sandbox's init that changed uid) counts as alive for `group_alive`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Protocol


class _Process(Protocol):
    pid: int

    async def wait(self) -> int: ...


def kill_group(pgid: int, sig: int) -> None:
    """Send `sig` to the process group `pgid`; a group already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def terminate_group(process: _Process, grace_s: float, *, linger: bool = False) -> None:
    """SIGTERM to the group led by `process`; SIGKILL when its leader has not exited after
    `grace_s`. With `linger`, also wait (within the same grace) for the rest of the group to
    finish after their SIGTERM: nothing signals a group's end, so it is polled."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    kill_group(process.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        kill_group(process.pid, signal.SIGKILL)
        await process.wait()
        return
    while linger and group_alive(process.pid) and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
