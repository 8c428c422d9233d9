"""/healthz and /metrics over a real loopback socket, on the project's HTTP server."""

from __future__ import annotations

import asyncio
import json

from prometheus_client import CollectorRegistry, Counter

from harnessrl.health import HealthServer


async def _request(port: int, raw: bytes) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_health_and_metrics_endpoints() -> None:
    registry = CollectorRegistry()
    Counter("things", "Things.", registry=registry).inc(3)
    checks = {"kafka": True, "engine": True}
    server = HealthServer("127.0.0.1", 0, registry, lambda: dict(checks))
    await server.start()
    try:
        status, body = await _request(
            server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        assert (status, json.loads(body)) == (200, {"status": "ok", "checks": checks})
        checks["engine"] = False
        status, body = await _request(
            server.port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
        )
        assert status == 503
        assert json.loads(body)["status"] == "unhealthy"
        status, body = await _request(
            server.port, b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n"
        )
        assert status == 200
        assert b"things_total 3.0" in body
        assert (await _request(server.port, b"GET /nope HTTP/1.1\r\nConnection: close\r\n\r\n"))[
            0
        ] == 404
        assert (
            await _request(server.port, b"POST /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
        )[0] == 405
        assert (await _request(server.port, b"garbage\r\n\r\n"))[0] == 400
        head = b"HEAD /healthz HTTP/1.1\r\nConnection: close\r\n\r\n"
        assert await _request(server.port, head) == (503, b"")
    finally:
        await server.stop()
        await server.stop()  # idempotent
