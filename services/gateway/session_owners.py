"""Which gateway replica owns a production session, and forwarding a call to it.

An app knows one address (a Service, a load balancer), so a session's calls may land on any
replica. Exactly one replica owns a session (rendezvous hashing of its group id over the
names in `gateway.peers`: every replica agrees without state, and adding one moves only its
share): only the owner numbers its calls, so they never collide. A replica that does not own
the session forwards the request, as it came, to the owner and relays the answer (streamed
when it streams); the app never sees a 421. A forwarded request carries
`x-harnessrl-forwarded-by`, and is served only by its owner: replicas that disagree on the
peers answer 503 (their configuration is wrong) rather than both numbering one session.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import AsyncExitStack
from urllib.parse import quote

from harnessrl.http import HttpClient, Request, Response, StreamingResponse
from harnessrl.logs import get_logger
from harnessrl.rendezvous import ranking
from harnessrl.services.gateway.config import GatewayPeer

log = get_logger(__name__)

FORWARDED_HEADER = "x-harnessrl-forwarded-by"
_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade"}
)


class NotOwnerError(Exception):
    """A forwarded request reached a replica that does not own its session either."""


class SessionOwners:
    """The replicas sharing sessions, and a keep-alive client to each of the others."""

    def __init__(self, peers: Sequence[GatewayPeer], replica: str, *, timeout_s: float) -> None:
        self._names = [p.name for p in peers]
        self._replica = replica
        self._clients = {
            p.name: HttpClient(p.url.rstrip("/"), read_timeout_s=timeout_s)
            for p in peers
            if p.name != replica
        }

    def owner(self, group_id: str) -> str:
        """The name of the replica that owns the session `group_id` (this one's when no
        peers are configured)."""
        if not self._names:
            return self._replica
        return self._names[ranking(group_id, self._names)[0]]

    async def forward(self, owner: str, request: Request) -> Response | StreamingResponse:
        """`request` sent to `owner` as it came; its answer relayed (streamed). Raises
        NotOwnerError for a request another replica forwarded already, and what the client
        raises when the owner cannot be reached."""
        if FORWARDED_HEADER in request.headers:
            raise NotOwnerError(
                f"forwarded by {request.headers[FORWARDED_HEADER]!r} to {self._replica!r}, "
                f"which holds that {owner!r} owns it: the replicas' gateway.peers differ"
            )
        client = self._clients[owner]
        headers = [(k, v) for k, v in request.raw_headers if k.lower() not in _HOP]
        headers.append((FORWARDED_HEADER, self._replica))
        target = quote(request.path, safe="/-._~:@!$&'()*+,;=")
        if request.query:
            target += "?" + request.query
        stack = AsyncExitStack()
        try:
            response = await stack.enter_async_context(
                client.stream(request.method, target, headers=headers, body=request.body)
            )
        except BaseException:
            await stack.aclose()
            raise
        relayed = [(k, v) for k, v in response.headers.items() if k not in _HOP]
        return StreamingResponse(response.status, relayed, _relay(response, stack))

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.close()


async def _relay(response: object, stack: AsyncExitStack) -> AsyncGenerator[bytes, None]:
    try:
        while chunk := await response.read_chunk():  # type: ignore[attr-defined]
            yield chunk
    finally:
        await stack.aclose()
