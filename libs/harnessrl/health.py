"""`/healthz` and `/metrics` for services that have no HTTP API of their own (controller,
reward, sample builder, trainer), on the project's one server stack (`harnessrl.http`, the
gateway's own). The gateway serves the same two routes on its API server; the dev engine on
its FastAPI app, as vLLM does.

Only GET and HEAD of those two paths are answered; bodies are refused at the head (a health
endpoint takes none), and a slow client is dropped by the server's own timeouts.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from harnessrl.http import HttpServer, Request, Response

HealthCheck = Callable[[], dict[str, bool]]

_TEXT = [("content-type", "text/plain")]
_HEADER_TIMEOUT_S = 5.0
_MAX_BODY_BYTES = 1024


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
        self._server: HttpServer | None = None

    async def start(self) -> None:
        self._server = HttpServer(
            self._respond,
            host=self.host,
            port=self.port,
            max_body_bytes=_MAX_BODY_BYTES,
            max_buffered_bytes=64 * _MAX_BODY_BYTES,
            header_timeout_s=_HEADER_TIMEOUT_S,
            body_timeout_s=_HEADER_TIMEOUT_S,
        )
        await self._server.start()
        self.port = self._server.port

    async def stop(self) -> None:
        """Stop listening (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s=1.0)

    async def _respond(self, request: Request) -> Response:
        if request.path not in ("/healthz", "/metrics"):
            return Response(404, _TEXT, b"not found\n")
        if request.method not in ("GET", "HEAD"):
            return Response(405, [*_TEXT, ("allow", "GET, HEAD")], b"method not allowed\n")
        if request.path == "/healthz":
            status, body = health_body(self._check())
            return Response(status, [("content-type", "application/json")], body)
        return Response(
            200, [("content-type", CONTENT_TYPE_LATEST)], generate_latest(self._registry)
        )
