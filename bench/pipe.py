"""A byte pipe: the least any HTTP proxy between a harness and an engine can cost.

`harnessrl bench gateway` runs it beside the gateway as the floor of the streamed rows. It
accepts connections and joins each to its own connection to the upstream, copying bytes
both ways as they arrive, in the event loop's callbacks: no parsing, no await, no copy
kept. Per streamed chunk it pays what every relay pays — being woken, one read, one write
(on loopback the write includes the kernel delivering the bytes to the reader) — and
nothing else, so the gateway's CPU above the pipe's is what its HTTP, its translation and
its capture cost. Flow control is the transports' own: a side whose peer cannot keep up
stops reading until the peer has drained.
"""

from __future__ import annotations

import asyncio


class _Side(asyncio.Protocol):
    """One end of a joined pair; bytes it receives are written to its peer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self._early: list[bytes] = []  # bytes received before the peer connected

    def join(self, peer: _Side) -> None:
        self.peer = peer
        assert peer.transport is not None
        for data in self._early:
            peer.transport.write(data)
        self._early.clear()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self._early.append(data)
        else:
            peer.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Downstream(_Side):
    """The client's side: connects its upstream when the client connects."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        super().__init__()
        self._upstream = upstream

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(_Side, *self._upstream)
        except OSError:
            assert self.transport is not None
            self.transport.close()
            return
        up.peer = self
        self.join(up)


def pipe(port: int, upstream_port: int) -> None:
    """The pipe (a child process): 127.0.0.1:`port` joined to 127.0.0.1:`upstream_port`."""
    from harnessrl.bench.load_driver import run_loop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Downstream(("127.0.0.1", upstream_port)), "127.0.0.1", port
        )
        async with server:
            await asyncio.Event().wait()

    run_loop(main())
