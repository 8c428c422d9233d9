"""Keep-alive connections to one host:port, at most `max_connections` open at once."""

from __future__ import annotations

import asyncio
from collections import deque

from harnessrl.http.client_connection import ClientConnection
from harnessrl.http.errors import ConnectError


class ConnectionPool:
    """Hands out idle connections (most recently used first) or opens new ones.

    When `max_connections` are open, `acquire` waits, first come first served, for one to
    be released or closed. Connections the upstream closed while idle are dropped when
    noticed (the loop sees the close) or when a request fails on them.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_connections: int,
        connect_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self._host = host
        self._port = port
        self._max = max_connections
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._idle: deque[ClientConnection] = deque()
        self._all: set[ClientConnection] = set()
        self._opening = 0
        self._waiters: deque[asyncio.Future[ClientConnection | None]] = deque()
        self._closed = False
        self.connects = 0  # connections opened so far

    async def acquire(self, *, fresh: bool = False) -> ClientConnection:
        """An idle connection, or a new one when `fresh` or none is idle.

        Raises ConnectError when a new connection cannot be made, RuntimeError once closed.
        """
        while True:
            if self._closed:
                raise RuntimeError("the HTTP client is closed")
            idle = self._idle
            while idle and not fresh:
                connection = idle.pop()
                if connection.reusable:
                    return connection
            if len(self._all) + self._opening < self._max:
                return await self._connect()
            if fresh and idle:
                idle.popleft().close()  # its slot frees up once the close completes
            handed = await self._wait()
            if handed is not None:
                if not fresh:
                    return handed
                self.release(handed)

    def release(self, connection: ClientConnection) -> None:
        """Take back a connection: kept when it can serve another request, else closed."""
        if self._closed or not connection.reusable:
            connection.close()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(connection)
                return
        self._idle.append(connection)

    async def close(self) -> None:
        """Close every connection; requests in flight fail (idempotent)."""
        self._closed = True
        for connection in list(self._all):
            connection.close()
        self._idle.clear()
        while self._waiters:
            self._wake_one()
        await asyncio.sleep(0)  # let the transports run their connection_lost

    async def _wait(self) -> ClientConnection | None:
        """A released connection, or None when a slot freed up."""
        waiter: asyncio.Future[ClientConnection | None]
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                handed = waiter.result()
                if handed is not None:
                    self.release(handed)
                else:
                    self._wake_one()
            raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _connect(self) -> ClientConnection:
        loop = asyncio.get_running_loop()
        self._opening += 1
        connected = False
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: ClientConnection(loop, self._read_timeout_s, self._on_lost),
                    self._host,
                    self._port,
                )
            connected = True
        except TimeoutError as err:
            raise ConnectError(
                f"connecting to {self._host}:{self._port} timed out"
                f" after {self._connect_timeout_s} s"
            ) from err
        except OSError as err:
            raise ConnectError(f"cannot connect to {self._host}:{self._port}: {err}") from err
        finally:
            self._opening -= 1
            if not connected:
                self._wake_one()  # the slot it would have taken is free
        self._all.add(connection)
        self.connects += 1
        if self._closed:
            connection.close()
            raise RuntimeError("the HTTP client is closed")
        return connection

    def _on_lost(self, connection: ClientConnection) -> None:
        self._all.discard(connection)
        if connection in self._idle:
            self._idle.remove(connection)
        self._wake_one()
