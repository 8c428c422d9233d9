"""The responses an episode stored (`store`, the default), for `previous_response_id` and
`GET /v1/responses/{id}`.

Each stored response keeps its own input items, its output and the response it continued,
so a chain is resolved by walking back and costs memory in proportion to its length, not its
square. Responses belong to the episode attempt that made them: another episode's id is not
found. The store is bounded (`max_responses`, oldest evicted first) and forgets an episode's
responses when its token expires (`sweep`). It lives in the gateway replica's memory: after
a restart, a chain by id fails with a 400 naming `previous_response_id` (harnesses that send
`store: false` and the whole input, as Codex does, are unaffected).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

Key = tuple[str, int]  # (episode id, attempt)


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any]
    items: list[dict[str, Any]]
    """The input items of its own request."""
    previous: str | None
    expires_at: float


class ResponseStore:
    """Stored responses of this gateway replica. Use from one event loop."""

    def __init__(self, max_responses: int) -> None:
        self._max = max_responses
        self._stored: OrderedDict[tuple[Key, str], Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, key: Key, stored: Stored) -> None:
        """Keep a response (idempotent), evicting the oldest past the bound."""
        self._stored[(key, stored.response["id"])] = stored
        while len(self._stored) > self._max:
            self._stored.popitem(last=False)

    def get(self, key: Key, response_id: str) -> Stored | None:
        return self._stored.get((key, response_id))

    def delete(self, key: Key, response_id: str) -> bool:
        return self._stored.pop((key, response_id), None) is not None

    def forget(self, key: Key) -> int:
        """Drop every stored response of the episode `key` (a deleted session); how many."""
        gone = [k for k in self._stored if k[0] == key]
        for k in gone:
            del self._stored[k]
        return len(gone)

    def history(self, key: Key, response_id: str) -> list[dict[str, Any]] | None:
        """The items a request continuing `response_id` starts from: every input and output
        item of the chain, oldest first; None when it (or a response it continued) is not
        stored."""
        chain: list[Stored] = []
        seen: set[str] = set()
        current: str | None = response_id
        while current is not None:
            stored = self.get(key, current)
            if stored is None or current in seen:  # ids are fresh: a cycle is a bug, not a hang
                return None
            seen.add(current)
            chain.append(stored)
            current = stored.previous
        items: list[dict[str, Any]] = []
        for stored in reversed(chain):
            items += stored.items
            items += stored.response["output"]
        return items

    def sweep(self, now: float | None = None) -> int:
        """Forget the responses of episodes whose token expired; returns how many."""
        now = time.time() if now is None else now
        expired = [k for k, s in self._stored.items() if s.expires_at <= now]
        for key in expired:
            del self._stored[key]
        return len(expired)
