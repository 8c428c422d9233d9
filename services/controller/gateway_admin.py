"""Closing episodes at the gateway (its admin API), with retries while it is away."""

from __future__ import annotations

import asyncio

import orjson

from harnessrl.http import HttpClient
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, is_retryable

log = get_logger(__name__)


class GatewayCloseError(RuntimeError):
    """The gateway refused to close an episode, or stayed unreachable past the deadline."""


class GatewayAdmin:
    def __init__(self, url: str, admin_token: str, *, timeout_s: float) -> None:
        self._client = HttpClient(url, read_timeout_s=60)
        self._auth = [
            ("authorization", f"Bearer {admin_token}"),
            ("content-type", "application/json"),
        ]
        self._timeout_s = timeout_s

    async def close_episode(self, episode_id: str, attempt: int, group_id: str, reason: str) -> int:
        """Close the attempt at the gateway; returns its call count. Retries transient
        failures (and 503) until `timeout_s`, then raises GatewayCloseError."""
        body = orjson.dumps({"attempt": attempt, "group_id": group_id, "reason": reason})
        delays = Backoff(0.2, 5.0).delays()
        deadline = asyncio.get_running_loop().time() + self._timeout_s
        while True:
            problem: str
            try:
                response = await self._client.request(
                    "POST", f"/admin/episodes/{episode_id}/close", headers=self._auth, body=body
                )
            except Exception as err:
                if not is_retryable(err):
                    raise
                problem = repr(err)
            else:
                if response.status == 200:
                    count: int = orjson.loads(response.body)["call_count"]
                    return count
                if response.status not in (502, 503, 504):
                    raise GatewayCloseError(
                        f"gateway refused to close {episode_id}: HTTP "
                        f"{response.status} {response.body[:300]!r}"
                    )
                problem = f"HTTP {response.status}"
            if asyncio.get_running_loop().time() > deadline:
                raise GatewayCloseError(f"gateway unreachable closing {episode_id}: {problem}")
            log.warning(
                "closing an episode at the gateway failed; retrying",
                episode_id=episode_id,
                error=problem,
            )
            await asyncio.sleep(next(delays))

    async def close(self) -> None:
        await self._client.close()
