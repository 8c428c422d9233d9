"""The controller's end of a sandboxed run's only way out: a unix socket, bound into the
sandbox, whose connections are carried byte for byte to the gateway's host:port.

One relay per run, so a run's connections are counted (and capped) on their own and end
with it. The bytes are not looked at: TLS, HTTP/1.1 and streams pass unchanged, and the
episode token still decides what the harness may do at the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from harnessrl.logs import get_logger

log = get_logger(__name__)

_CHUNK = 64 * 1024


class GatewayRelay:
    """Serves `path`, connecting each accepted connection to host:port."""

    def __init__(
        self, path: Path, host: str, port: int, *, max_connections: int, owner: int | None
    ) -> None:
        self.path = path
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._owner = owner
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen; only the socket's owner (the run's uid when `owner` is given) may
        connect."""
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        if self._owner is not None:
            os.chown(self.path, self._owner, self._owner)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        """Stop listening and cut the connections still open. Idempotent."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self._max_connections:
            writer.close()
            return
        self._connections.add(task)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(self._host, self._port)
            except OSError as err:  # the harness sees its connection closed, as it would
                log.warning("sandbox relay: gateway unreachable", error=str(err))
                return
            try:
                await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))
            finally:
                up_writer.close()
        finally:
            writer.close()
            self._connections.discard(task)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until the end of stream, then pass the end on (half-close)."""
    try:
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except ConnectionError:  # the other side went away: the peer sees the close
        with contextlib.suppress(OSError):
            writer.close()
