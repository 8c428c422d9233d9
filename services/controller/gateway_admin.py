"""Closing episodes at the gateway replica that owns them (its admin API), with retries
while it is away; which replica owns an episode (rendezvous hashing).

One close per episode attempt, so a controller running a thousand episodes sends them as
fast as a gateway takes calls: they go through the project's own keep-alive client, whose
pool hands connections out first come first served in constant time. (On httpx, whose pool
re-scans every queued request and every connection each time one frees, 1,000 concurrent
episodes spent the controller's event loop in that scan and stopped closing: issue 39.)"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

import orjson

from harnessrl.http import HttpClient
from harnessrl.logs import get_logger
from harnessrl.rendezvous import ranking
from harnessrl.retry import Backoff, is_retryable

if TYPE_CHECKING:
    from harnessrl.services.controller.config import GatewayReplica

log = get_logger(__name__)


def owner(episode_id: str, replicas: Sequence[GatewayReplica]) -> GatewayReplica:
    """The replica that owns `episode_id`, by rendezvous hashing over the replicas' names:
    every controller agrees without state, and adding a replica moves only its share."""
    return replicas[ranking(episode_id, [r.name for r in replicas])[0]]


ADMIN_CONNECTIONS = 64
"""Connections kept open to one replica's admin API; further closes wait their turn."""


class GatewayCloseError(RuntimeError):
    """The gateway refused to close an episode, or stayed unreachable past the deadline."""


class GatewayAdmin:
    """The admin API of one gateway replica."""

    def __init__(self, url: str, admin_token: str, *, timeout_s: float, replica: str = "") -> None:
        self.replica = replica
        self._client = HttpClient(
            url, max_connections=ADMIN_CONNECTIONS, connect_timeout_s=10.0, read_timeout_s=60.0
        )
        self._auth = [
            ("authorization", f"Bearer {admin_token}"),
            ("content-type", "application/json"),
        ]
        self._timeout_s = timeout_s

    async def close_episode(self, episode_id: str, attempt: int, group_id: str, reason: str) -> int:
        """Close the attempt at the gateway; returns its call count. Retries transient
        failures (and 503) until `timeout_s`, then raises GatewayCloseError."""
        body = orjson.dumps(
            {"attempt": attempt, "group_id": group_id, "reason": reason, "gateway": self.replica}
        )
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


class Gateways:
    """Every gateway replica the controller spreads episodes over, each with its admin API."""

    def __init__(
        self, replicas: Sequence[GatewayReplica], admin_token: str, *, timeout_s: float
    ) -> None:
        self.replicas = list(replicas)
        self._admins = {
            r.name: GatewayAdmin(r.admin_url or r.url, admin_token, timeout_s=timeout_s,
                                 replica=r.name)
            for r in self.replicas
        }  # fmt: skip

    def owner(self, episode_id: str) -> GatewayReplica:
        return owner(episode_id, self.replicas)

    def admin(self, episode_id: str) -> GatewayAdmin:
        """The admin API of the episode's owner."""
        return self._admins[self.owner(episode_id).name]

    async def close(self) -> None:
        for admin in self._admins.values():
            await admin.close()
