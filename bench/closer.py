"""The controller's part of `harnessrl bench load`: closing episodes at the gateway replica
that owns them, with the controller's own client, in a process of its own.

    python -m harnessrl.bench.closer   # started by Closer; reads its settings on stdin

The bench's harnesses are a thousand threads of one process. Closes made on an event loop
in that process, or handed back by one reader thread, waited for its one interpreter lock
behind those threads at every step (the gateway answered a close in 5 ms at p50 and 20 ms at
p99; the bench timed 2 s), so the bench timed its own queue instead of the controller and
the gateway. The controller is a process of its own in every deployment, and here too: one
event loop closes every episode concurrently, as the controller's does. Each harness thread
has a socket of its own to it, so an answer wakes the one thread that waits for it, as a
call's answer does. A request or answer is one JSON line.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from harnessrl.services.controller.config import GatewayReplica

POLL_S = 0.25
"""How often a waiting thread checks whether its close was given up."""


class CloseFailedError(RuntimeError):
    """The controller's client gave up closing the episode; the message is its error."""


class CloseGivenUpError(RuntimeError):
    """The bench stopped waiting for the close (it is stopping)."""


class Closer:
    """A controller process closing episodes, with `channels` sockets to it: channel i is
    used by one thread at a time. `stop()` is idempotent."""

    def __init__(
        self,
        replicas: Sequence[GatewayReplica],
        admin_token: str,
        *,
        timeout_s: float,
        channels: int,
    ) -> None:
        pairs = [socket.socketpair() for _ in range(channels)]
        self._channels = [ours for ours, _ in pairs]
        self._buffers = [b""] * channels
        theirs = [sock for _, sock in pairs]
        fds = [sock.fileno() for sock in theirs]
        settings = {
            "replicas": [r.model_dump() for r in replicas],
            "admin_token": admin_token,
            "timeout_s": timeout_s,
            "fds": fds,
        }
        # Its own session, as the gateways': a terminal's Ctrl-C reaches the bench alone,
        # which ends this process by closing its channels once its episodes have ended.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "harnessrl.bench.closer"],
            stdin=subprocess.PIPE,
            pass_fds=fds,
            start_new_session=True,
        )
        assert self._process.stdin is not None
        with self._process.stdin as stdin:
            stdin.write(orjson.dumps(settings))
        for sock in theirs:
            sock.close()
        for sock in self._channels:
            sock.settimeout(POLL_S)

    def close(
        self,
        channel: int,
        episode: tuple[str, int, str, str],
        *,
        timeout_s: float,
        given_up: Callable[[], bool],
    ) -> tuple[int, float]:
        """Close (episode id, attempt, group id, reason) at its owner; its call count, and
        the seconds the controller's client took (from the request read to the answer).

        Raises CloseFailedError (the client gave up), TimeoutError (no answer within
        `timeout_s`), CloseGivenUpError (`given_up()` turned true while waiting)."""
        sock = self._channels[channel]
        sock.sendall(orjson.dumps(episode) + b"\n")
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._line(channel, given_up, deadline)
            episode_id, closed, value, seconds = orjson.loads(line)
            if episode_id != episode[0]:
                continue  # the late answer of a close this channel timed out on
            if not closed:
                raise CloseFailedError(value)
            return int(value), float(seconds)

    def _line(self, channel: int, given_up: Callable[[], bool], deadline: float) -> bytes:
        sock = self._channels[channel]
        while b"\n" not in self._buffers[channel]:
            if given_up():
                raise CloseGivenUpError("the bench is stopping")
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from the controller's client")
            try:
                data = sock.recv(65536)
            except TimeoutError:
                continue
            if not data:
                raise CloseFailedError("the closer process ended")
            self._buffers[channel] += data
        line, self._buffers[channel] = self._buffers[channel].split(b"\n", 1)
        return line

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the process: its channels close, closes in progress end first."""
        for sock in self._channels:
            sock.close()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


async def _serve(settings: dict[str, Any]) -> None:
    """The process: close what each channel asks, answer on it; end when all are closed."""
    from harnessrl.services.controller.config import GatewayReplica
    from harnessrl.services.controller.gateway_admin import Gateways

    replicas = [GatewayReplica(**replica) for replica in settings["replicas"]]
    gateways = Gateways(replicas, settings["admin_token"], timeout_s=settings["timeout_s"])

    async def channel(fd: int) -> None:
        reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd))
        tasks: set[asyncio.Task[None]] = set()
        while line := await reader.readline():
            task = asyncio.create_task(close(writer, *orjson.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        writer.close()

    async def close(
        writer: asyncio.StreamWriter, episode_id: str, attempt: int, group_id: str, reason: str
    ) -> None:
        started = time.perf_counter()
        try:
            count = await gateways.admin(episode_id).close_episode(
                episode_id, attempt, group_id, reason
            )
            answer = [episode_id, True, count, time.perf_counter() - started]
        except Exception as err:  # handed to the thread that waits for it
            answer = [episode_id, False, f"{type(err).__name__}: {err}", 0.0]
        with contextlib.suppress(ConnectionError):  # that thread's bench is gone
            writer.write(orjson.dumps(answer) + b"\n")

    try:
        await asyncio.gather(*(channel(fd) for fd in settings["fds"]))
    finally:
        await gateways.close()


if __name__ == "__main__":
    asyncio.run(_serve(orjson.loads(sys.stdin.buffer.read())))
