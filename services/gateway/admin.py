"""The admin API: close episodes, pause / resume / drain calls, status. Bearer-token only.

    POST /admin/episodes/{episode_id}/close   {"attempt": 1, "group_id": "g-...", "reason"?}
    POST /admin/pause {"reason"?}   POST /admin/resume   POST /admin/drain {"timeout_s"?}
    GET  /admin/status

Close refuses further calls of the attempt (409), waits for its calls in flight and for
every ModelCall's acknowledgement, then publishes EpisodeClosed{call_count} and answers
once that is acknowledged too. Closing again answers the same count and publishes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from typing import Any

import orjson

from harnessrl.bus import Producer
from harnessrl.episode_token import EpisodeClaims
from harnessrl.http import Request, Response
from harnessrl.logs import get_logger
from harnessrl.services.gateway.control import Gate
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.services.gateway.open_episodes import EpisodeBook
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

CLOSED_RETENTION_S = 24 * 3600.0
"""How long a gateway remembers an episode closed before it made any call."""


def json_response(status: int, data: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    return Response(
        status, [("content-type", "application/json"), *(headers or [])], orjson.dumps(data)
    )


def _problem(status: int, message: str) -> Response:
    return json_response(status, {"error": {"message": message, "type": "admin_error"}})


class Admin:
    """Admin routes of one gateway replica."""

    def __init__(
        self,
        *,
        token: bytes,
        book: EpisodeBook,
        gate: Gate,
        producer: Producer,
        metrics: GatewayMetrics,
        status: Any,
        replica: str = "",
    ) -> None:
        self._replica = replica
        self._token = token
        self._book = book
        self._gate = gate
        self._producer = producer
        self._metrics = metrics
        self._status = status  # () -> dict of extra status fields
        self._closing: dict[tuple[str, int], asyncio.Task[int]] = {}

    async def handle(self, request: Request) -> Response:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), b"Bearer " + self._token):
            self._metrics.refused("admin_auth").inc()
            return _problem(
                401, "admin API: a valid 'Authorization: Bearer <admin token>' header is required"
            )
        parts = request.path.strip("/").split("/")  # admin, ...
        if request.method == "GET" and parts == ["admin", "status"]:
            return json_response(
                200,
                {
                    "paused": self._gate.paused,
                    "reason": self._gate.reason,
                    "episodes": len(self._book),
                    "in_flight": self._book.in_flight,
                    **self._status(),
                },
            )
        if request.method != "POST":
            return _problem(405, f"{request.method} {request.path}: method not allowed")
        try:
            body = orjson.loads(request.body) if request.body.strip() else {}
        except orjson.JSONDecodeError:
            return _problem(400, "body: not valid JSON")
        if not isinstance(body, dict):
            return _problem(400, "body: must be a JSON object")
        if len(parts) == 4 and parts[1] == "episodes" and parts[3] == "close":
            return await self._close(parts[2], body)
        if parts == ["admin", "pause"]:
            self._gate.pause(str(body.get("reason", "admin")))
            log.info("calls paused", reason=self._gate.reason)
            return json_response(200, {"paused": True})
        if parts == ["admin", "resume"]:
            self._gate.resume()
            log.info("calls resumed")
            return json_response(200, {"paused": False})
        if parts == ["admin", "drain"]:
            return await self._drain(body)
        return _problem(404, f"{request.path}: no such admin route")

    async def _close(self, episode_id: str, body: dict[str, Any]) -> Response:
        attempt, group_id = body.get("attempt"), body.get("group_id")
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
            return _problem(400, "attempt: required, a positive integer")
        if not isinstance(group_id, str) or not group_id:
            return _problem(400, "group_id: required, a non-empty string")
        reason = str(body.get("reason", "finished"))
        owner = body.get("gateway", self._replica)
        if not isinstance(owner, str):
            return _problem(400, "gateway: a string, the name of the replica that owns it")
        if owner != self._replica:  # closing it here would count none of its calls
            return _problem(
                421,
                f"gateway: episode {episode_id} belongs to replica {owner!r}, not this one "
                f"({self._replica or '(unnamed)'!r}): close it there",
            )
        claims = EpisodeClaims(
            episode_id,
            attempt,
            group_id,
            "train",
            time.time() + CLOSED_RETENTION_S,
            gateway=self._replica,
        )
        try:
            count = await self.close(claims, reason)
        except Exception as err:
            log.error("closing an episode failed", episode_id=episode_id, error=repr(err))
            return _problem(503, f"episode {episode_id}: could not be closed: {err}")
        return json_response(
            200, {"episode_id": episode_id, "attempt": attempt, "call_count": count}
        )

    async def close(self, claims: EpisodeClaims, reason: str) -> int:
        """Close the attempt (once, however often asked): its call count, after its
        EpisodeClosed is acknowledged. Raises what refused it; asking again then retries."""
        key = (claims.episode_id, claims.attempt)
        task = self._closing.get(key)
        if task is None:
            task = self._closing[key] = asyncio.create_task(self._close_once(claims, reason))
        try:
            return await asyncio.shield(task)
        except Exception:
            if self._closing.get(key) is task:
                del self._closing[key]
            raise

    async def _close_once(self, claims: EpisodeClaims, reason: str) -> int:
        episode = await self._book.close(claims)
        if episode.closed_count is None:
            await self._producer.publish(
                pb.EpisodeClosed(
                    episode_id=claims.episode_id,
                    attempt=claims.attempt,
                    group_id=claims.group_id,
                    call_count=episode.calls,
                    reason=reason,
                    gateway=self._replica,
                )
            )
            episode.closed_count = episode.calls
            self._metrics.closed.inc()
            log.info(
                "episode closed",
                episode_id=claims.episode_id,
                attempt=claims.attempt,
                call_count=episode.calls,
            )
        return episode.closed_count

    def sweep(self) -> None:
        """Forget finished closes (the book forgets their episodes on its own sweep)."""
        self._closing = {k: t for k, t in self._closing.items() if not t.done()}

    async def _drain(self, body: dict[str, Any]) -> Response:
        timeout = body.get("timeout_s", 60)
        if not isinstance(timeout, int | float) or timeout <= 0:
            return _problem(400, "timeout_s: must be a positive number")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._book.wait_idle(), float(timeout))
        drained = self._book.in_flight == 0
        return json_response(
            200 if drained else 504, {"drained": drained, "in_flight": self._book.in_flight}
        )
