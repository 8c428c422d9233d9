"""The engines behind the gateway: which one serves an episode, and retrying the others.

An episode sticks to one engine for the engine's prefix cache: engines are ranked per
episode by rendezvous hashing, so adding or removing an engine moves only the episodes that
ranked it first. A call that needs one policy version (a production session's, in a canary
rollout) is ranked among the engines serving it only (`among`): the same order with the
others left out, so it too sticks to one engine. A transient failure before any response
(connection refused, a timeout while connecting, 502/503/504) moves the call down the
episode's ranking after a short backoff; anything else is the caller's to answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

from harnessrl.http import ClientResponse, HttpClient
from harnessrl.logs import get_logger
from harnessrl.rendezvous import ranking
from harnessrl.retry import Backoff, is_retryable

log = get_logger(__name__)

RETRY_STATUSES = frozenset({502, 503, 504})
_JSON = [("content-type", "application/json")]


class UpstreamError(Exception):
    """No engine could answer: `status` is what the harness gets (502 or 504)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class EnginePool:
    """HTTP clients for the configured engines (keep-alive pools), and the retry policy."""

    def __init__(self, urls: list[str], *, timeout_s: float, attempts: int) -> None:
        self.urls = urls
        self._clients = [HttpClient(url, read_timeout_s=timeout_s) for url in urls]
        self._attempts = attempts
        self._backoff = Backoff(0.05, 1.0)

    def ranking(self, episode_id: str, among: Collection[str] | None = None) -> list[int]:
        """Engine indexes in the order this episode tries them; with `among`, only the
        engines whose URL it holds (compared without a trailing slash)."""
        order = ranking(episode_id, self.urls)
        if among is None:
            return order
        return [i for i in order if self.urls[i].rstrip("/") in among]

    async def request(
        self,
        episode_id: str,
        path: str,
        body: bytes | Callable[[str], bytes],
        among: Collection[str] | None = None,
    ) -> tuple[str, ClientResponse]:
        """(engine URL, response) of a POST of `body` (or of `body(engine URL)`, a body per
        engine) to one of the engines (`among` them, when given: not empty); transient
        failures are retried. A response with a non-retryable status is returned as it is.
        Raises UpstreamError."""
        last: str = "no engine answered"
        delays = self._backoff.delays()
        ranking = self._ranked(episode_id, among)
        for attempt in range(self._attempts):
            index = ranking[attempt % len(ranking)]
            try:
                response = await self._clients[index].request(
                    "POST", path, headers=_JSON, body=_for(body, self.urls[index])
                )
            except Exception as err:
                if not is_retryable(err):
                    raise
                last = f"{self.urls[index]}: {type(err).__name__}: {err}"
            else:
                if response.status not in RETRY_STATUSES:
                    return self.urls[index], response
                last = f"{self.urls[index]}: HTTP {response.status}"
            log.warning("engine call failed; retrying", attempt=attempt + 1, error=last)
            await asyncio.sleep(next(delays))
        raise UpstreamError(504 if "Timeout" in last else 502, f"engine unavailable: {last}")

    @asynccontextmanager
    async def stream(
        self,
        episode_id: str,
        path: str,
        body: bytes | Callable[[str], bytes],
        among: Collection[str] | None = None,
    ) -> AsyncIterator[tuple[str, Any]]:
        """(engine URL, streaming response) of a POST; retried like request() until an
        engine answers, never after (bytes may have reached the harness by then)."""
        last: str = "no engine answered"
        delays = self._backoff.delays()
        ranking = self._ranked(episode_id, among)
        for attempt in range(self._attempts):
            index = ranking[attempt % len(ranking)]
            payload = _for(body, self.urls[index])
            context = self._clients[index].stream("POST", path, headers=_JSON, body=payload)
            try:
                response = await context.__aenter__()
            except Exception as err:
                if not is_retryable(err):
                    raise
                last = f"{self.urls[index]}: {type(err).__name__}: {err}"
            else:
                if response.status not in RETRY_STATUSES:
                    try:
                        yield self.urls[index], response
                    except BaseException as exc:
                        if not await context.__aexit__(type(exc), exc, exc.__traceback__):
                            raise
                    else:
                        await context.__aexit__(None, None, None)
                    return
                await context.__aexit__(None, None, None)
                last = f"{self.urls[index]}: HTTP {response.status}"
            log.warning("engine call failed; retrying", attempt=attempt + 1, error=last)
            await asyncio.sleep(next(delays))
        raise UpstreamError(504 if "Timeout" in last else 502, f"engine unavailable: {last}")

    def _ranked(self, episode_id: str, among: Collection[str] | None) -> list[int]:
        order = self.ranking(episode_id, among)
        if not order:
            raise ValueError("among: names none of the configured engines")
        return order

    async def get(self, path: str) -> ClientResponse:
        """GET from the first engine (model listing)."""
        return await self._clients[0].request("GET", path)

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients), return_exceptions=True)


def _for(body: bytes | Callable[[str], bytes], url: str) -> bytes:
    return body(url) if callable(body) else body
