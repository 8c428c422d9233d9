"""`/healthz` and `/metrics` for services that have no HTTP API of their own.

A deliberately small HTTP/1.1 server on asyncio streams: GET or HEAD, one request per
connection. Services with an HTTP API (gateway, engine) serve the same two routes there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from harnessrl.logs import get_logger

log = get_logger(__name__)

HealthCheck = Callable[[], dict[str, bool]]
_MAX_HEADER_LINES = 100
_READ_TIMEOUT_S = 5.0


def health_body(checks: dict[str, bool]) -> tuple[int, bytes]:
    """(HTTP status, JSON body) for a set of named checks: 200 when all pass, else 503."""
    ok = all(checks.values())
    body = orjson.dumps({"status": "ok" if ok else "unhealthy", "checks": checks})
    return (200 if ok else 503), body


class HealthServer:
    """Serves /healthz (from `check`) and /metrics (from `registry`) on host:port."""

    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, check: HealthCheck
    ) -> None:
        self.host = host
        self.port = port
        self._registry = registry
        self._check = check
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT_S):
                request = (await reader.readline()).decode("latin-1").split()
                for _ in range(_MAX_HEADER_LINES):
                    if (await reader.readline()) in (b"\r\n", b"\n", b""):
                        break
            status, content_type, body = self._respond(request)
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (b"" if request[:1] == ["HEAD"] else body))
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass  # a slow or vanished client; nothing to answer
        finally:
            writer.close()

    def _respond(self, request: list[str]) -> tuple[int, str, bytes]:
        if len(request) != 3:
            return 400, "text/plain", b"bad request\n"
        method, target, _ = request
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        path = target.split("?", 1)[0]
        if path == "/healthz":
            status, body = health_body(self._check())
            return status, "application/json", body
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return 404, "text/plain", b"not found\n"


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    503: "Service Unavailable",
}
