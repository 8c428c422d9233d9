"""Writing a streamed response body, and closing the iterator that produced it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from harnessrl.http import wire
from harnessrl.logs import get_logger

log = get_logger(__name__)


async def pump(
    chunks: AsyncIterator[bytes],
    transport: asyncio.WriteTransport,
    drain: Callable[[], Awaitable[None]],
    *,
    chunked: bool,
) -> bool:
    """Write each non-empty chunk as it is yielded, waiting on `drain` between chunks.

    Returns True when the iterator ended and the body was terminated, False when the
    iterator raised (logged; the body is left unterminated so the client sees it cut).
    Cancellation propagates.
    """
    try:
        async for data in chunks:
            if data:
                transport.write(wire.chunk(data) if chunked else data)
                if transport.get_write_buffer_size():  # else there is nothing to wait for
                    await drain()
    except Exception:
        log.exception("streaming response failed")
        return False
    if chunked:
        transport.write(wire.LAST_CHUNK)
    return True


async def aclose(chunks: AsyncIterator[bytes]) -> None:
    """Close `chunks` if it can be closed (an async generator sees GeneratorExit)."""
    close = getattr(chunks, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:
        log.exception("closing a streamed response failed")
