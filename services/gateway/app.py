"""Routing of the gateway's HTTP API, authentication, and the OpenAI routes.

    /e/{token}/v1/chat/completions | /completions | /models | /messages   token in the path
    /v1/chat/completions | /completions | /models | /messages             token as API key
    /admin/...   /healthz   /metrics   /openapi.json (the routes above; services/gateway/openapi.py)

With `gateway.admin_port` set, /admin/... is served only on that port (AdminApp, with
/healthz and /metrics) and is a 404 on the harness port.

The token in the path is the episode's; an API key that is a valid token of another episode
is refused (403), anything else in it is ignored (SDKs always send some key). Errors are
answered in the API's own shape: OpenAI's for OpenAI routes, Anthropic's for /v1/messages.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from harnessrl.episode_token import EpisodeClaims, TokenError, verify
from harnessrl.health import health_body
from harnessrl.http import Request, Response, StreamingResponse
from harnessrl.services.gateway import anthropic_api
from harnessrl.services.gateway.admin import Admin, json_response
from harnessrl.services.gateway.calls import Forwarder, StreamStart
from harnessrl.services.gateway.capture import (
    CHAT,
    COMPLETIONS,
    InvalidRequest,
    check_request,
    for_harness,
)
from harnessrl.services.gateway.control import Paused
from harnessrl.services.gateway.engines import UpstreamError
from harnessrl.services.gateway.episodes import EpisodeClosedError
from harnessrl.services.gateway.openapi import document_bytes
from harnessrl.v1 import events_pb2 as pb

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_SSE = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]
_CACHE_LIMIT = 100_000
API_ROUTES = {
    "/v1/chat/completions": "POST",
    "/v1/completions": "POST",
    "/v1/models": "GET",
    "/v1/messages": "POST",
}
"""The harness-facing routes and their method (each also under /e/{token}); the OpenAPI
document at /openapi.json describes exactly these."""


def openai_error(
    status: int,
    message: str,
    param: str | None = None,
    headers: list[tuple[str, str]] | None = None,
) -> Response:
    """A response in OpenAI's error shape."""
    kind = _OPENAI_TYPES.get(status, "api_error")
    return json_response(
        status, {"error": {"message": message, "type": kind, "param": param, "code": None}}, headers
    )


class GatewayApp:
    """The request handler of the gateway's HTTP server."""

    def __init__(
        self,
        forwarder: Forwarder,
        admin: Admin | None,
        *,
        secrets: Sequence[bytes],
        registry: CollectorRegistry,
        health: Callable[[], dict[str, bool]],
        models: Callable[[], bytes],
    ) -> None:
        self._f = forwarder
        self._admin = admin
        self._secrets = list(secrets)
        self._registry = registry
        self._health = health
        self._models = models
        self._claims: dict[str, EpisodeClaims] = {}

    async def __call__(self, request: Request) -> Response | StreamingResponse:
        path = request.path
        if path.startswith("/e/"):
            token, _, rest = path[3:].partition("/")
            return await self._api(request, "/" + rest, token, path_token=True)
        if path.startswith("/v1/"):
            return await self._api(request, path, _api_key(request) or "", path_token=False)
        if path.startswith("/admin/") and self._admin is not None:
            return await self._admin.handle(request)
        if path in ("/healthz", "/metrics"):
            return _service_route(path, self._health, self._registry)
        if path == "/openapi.json":
            return Response(200, [("content-type", "application/json")], document_bytes())
        return openai_error(404, f"{path}: not found")

    async def _api(
        self, request: Request, route: str, token: str, *, path_token: bool
    ) -> Response | StreamingResponse:
        anthropic = route == "/v1/messages"
        error = anthropic_api.error if anthropic else openai_error
        method = API_ROUTES.get(route)
        if method is None:
            return error(404, f"{route}: not found")
        try:
            claims = self._authorize(token)
            if path_token and (other := _api_key(request)) and other != token:
                self._check_same_episode(claims, other)
        except TokenError as err:
            self._f.metrics.refused(err.reason).inc()
            status = 403 if err.reason == "other_episode" else 401
            return error(status, str(err))
        if request.method != method:
            return error(405, f"{request.method} {route}: method not allowed")
        if route == "/v1/models":
            return Response(200, [("content-type", "application/json")], self._models())
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as err:
            return error(400, f"body: not valid JSON ({err})")
        if not isinstance(body, dict):
            return error(400, "body: must be a JSON object")
        try:
            if anthropic:
                return await anthropic_api.messages(self._f, claims, request, body)
            kind = CHAT if route == "/v1/chat/completions" else COMPLETIONS
            check_request(body, kind)
            return await self._openai(claims, request, kind, route, body)
        except InvalidRequest as err:
            return error(400, str(err), err.param)
        except EpisodeClosedError as err:
            self._f.metrics.refused("closed").inc()
            return error(409, str(err))
        except Paused as err:
            self._f.metrics.refused("paused" if err.status == 429 else "recovering").inc()
            return error(err.status, str(err), headers=[("retry-after", str(err.retry_after_s))])
        except UpstreamError as err:
            return error(err.status, str(err))

    async def _openai(
        self, claims: EpisodeClaims, request: Request, kind: str, route: str, body: dict[str, Any]
    ) -> Response | StreamingResponse:
        api = pb.API_OPENAI_CHAT if kind == CHAT else pb.API_OPENAI_COMPLETIONS
        call = self._f.call(
            claims,
            api=api,
            kind=kind,
            path=route,
            body=body,
            raw=request.body,
            traceparent=request.headers.get("traceparent"),
        )
        if not call.asked.stream:
            async with call:
                upstream = await call.complete()
            if upstream.data is None:
                return Response(
                    upstream.status, [("content-type", "application/json")], upstream.raw
                )
            return json_response(200, for_harness(upstream.data, call.asked))
        await call.__aenter__()
        chunks = call.chunks()
        try:
            start = await anext(chunks)
            assert isinstance(start, StreamStart)
            if start.error is not None:
                await _finish(call, chunks)
                return json_response(start.status, start.error)
        except BaseException:
            await _finish(call, chunks)
            raise

        async def sse() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    assert isinstance(chunk, dict)
                    yield b"data: " + orjson.dumps(for_harness(chunk, call.asked)) + b"\n\n"
                yield b"data: [DONE]\n\n"
            finally:
                if call.outcome == "error":
                    call.outcome = "aborted"  # the harness went away mid-stream
                await _finish(call, chunks)

        return StreamingResponse(200, list(_SSE), sse())

    def _authorize(self, token: str) -> EpisodeClaims:
        claims = self._claims.get(token)
        if claims is None:
            if not token:
                raise TokenError(
                    "missing", "episode token: none given (in the path, or as the API key)"
                )
            claims = verify(token, self._secrets)
            if len(self._claims) >= _CACHE_LIMIT:
                self._claims.clear()
            self._claims[token] = claims
        else:
            verify_expiry(claims)
        return claims

    def _check_same_episode(self, claims: EpisodeClaims, other: str) -> None:
        try:
            theirs = self._authorize(other)
        except TokenError:
            return  # not a token: an ordinary API key the SDK insisted on sending
        if (theirs.episode_id, theirs.attempt) != (claims.episode_id, claims.attempt):
            raise TokenError(
                "other_episode", "episode token: the API key is the token of another episode"
            )


class AdminApp:
    """The request handler of the admin port (`gateway.admin_port`): the admin API, and the
    service's /healthz and /metrics; nothing of the harness API."""

    def __init__(
        self,
        admin: Admin,
        *,
        registry: CollectorRegistry,
        health: Callable[[], dict[str, bool]],
    ) -> None:
        self._admin = admin
        self._registry = registry
        self._health = health

    async def __call__(self, request: Request) -> Response:
        path = request.path
        if path.startswith("/admin/"):
            return await self._admin.handle(request)
        if path in ("/healthz", "/metrics"):
            return _service_route(path, self._health, self._registry)
        return openai_error(404, f"{path}: not found (this is the admin port)")


def _service_route(
    path: str, health: Callable[[], dict[str, bool]], registry: CollectorRegistry
) -> Response:
    if path == "/healthz":
        status, body = health_body(health())
        return Response(status, [("content-type", "application/json")], body)
    return Response(200, [("content-type", CONTENT_TYPE_LATEST)], generate_latest(registry))


def verify_expiry(claims: EpisodeClaims) -> None:
    if claims.expires_at <= time.time():
        raise TokenError("expired", f"episode token: expired for episode {claims.episode_id}")


async def _finish(call: Any, chunks: AsyncIterator[Any]) -> None:
    await chunks.aclose()  # type: ignore[attr-defined]  # an async generator
    await call.__aexit__(None, None, None)


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")
