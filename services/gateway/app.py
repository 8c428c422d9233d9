"""Routing of the gateway's HTTP API and authentication; the dialects do the rest.

    /e/{token}/v1/...   the episode token in the path      /v1/...   the token as API key

    POST /v1/chat/completions        OpenAI chat                 dialects/openai_chat.py
    POST /v1/completions             OpenAI completions          dialects/openai_completions.py
    POST /v1/responses               OpenAI Responses            dialects/responses.py
    GET|DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items
    POST /v1/messages                Anthropic Messages          dialects/anthropic.py
    POST /v1/messages/count_tokens   Anthropic token count (the engine's own count)
    GET  /v1/models, /v1/models/{id} in the shape of the API the client speaks
    /admin/...   /healthz   /metrics   /openapi.json (services/gateway/openapi.py)

With `gateway.admin_port` set, /admin/... is served only on that port (AdminApp, with
/healthz and /metrics) and is a 404 on the harness port.

The token in the path is the episode's; an API key that is a valid token of another episode
is refused (403), anything else in it is ignored (SDKs always send some key). Errors are in
the shape of the API asked: Anthropic's for /v1/messages... and for requests that carry
`anthropic-version` (every Anthropic SDK sends it), OpenAI's otherwise. Every request is
one access-log line and one count of `harnessrl_gateway_requests{route,status}`, the route
being its template (never the token), so a harness that hits a missing route shows; a
production session's call logs its canary arm and version too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from harnessrl.episode_token import EpisodeClaims, TokenError, verify
from harnessrl.health import health_body
from harnessrl.http import Request, Response, StreamingResponse
from harnessrl.http.errors import HttpClientError
from harnessrl.logs import get_logger
from harnessrl.production import (
    END_HEADER,
    KIND_HEADER,
    SESSION_HEADER,
    check_kind,
    check_session_id,
    session_group,
)
from harnessrl.services.gateway.admin import Admin
from harnessrl.services.gateway.control import Paused
from harnessrl.services.gateway.depth import check_depth
from harnessrl.services.gateway.dialects.base import Dialect
from harnessrl.services.gateway.dialects.openai_chat import ChatDialect
from harnessrl.services.gateway.dialects.openai_completions import CompletionsDialect
from harnessrl.services.gateway.dialects.responses import ResponsesDialect
from harnessrl.services.gateway.engines import UpstreamError
from harnessrl.services.gateway.errors import (
    ANTHROPIC,
    OPENAI,
    ErrorShape,
    GatewayError,
    render,
    respond,
)
from harnessrl.services.gateway.lifecycle import Lifecycle
from harnessrl.services.gateway.models import Models
from harnessrl.services.gateway.open_episodes import EpisodeClosedError
from harnessrl.services.gateway.openapi import document_bytes
from harnessrl.services.gateway.production_sessions import ProductionSessions, SessionEndedError
from harnessrl.services.gateway.session_arms import SessionCalls
from harnessrl.services.gateway.session_owners import NotOwnerError, SessionOwners
from harnessrl.trust.contract import CHAT_PATH, engine_request

log = get_logger(__name__)

_CACHE_LIMIT = 100_000
API_ROUTES = {
    "/v1/chat/completions": ("POST",),
    "/v1/completions": ("POST",),
    "/v1/responses": ("POST",),
    "/v1/responses/{id}": ("GET", "DELETE"),
    "/v1/responses/{id}/input_items": ("GET",),
    "/v1/messages": ("POST",),
    "/v1/messages/count_tokens": ("POST",),
    "/v1/models": ("GET",),
    "/v1/models/{id}": ("GET",),
}
"""The harness-facing routes and their methods, each also under /e/{token}; the OpenAPI
document at /openapi.json describes exactly these."""


def dialects(responses: ResponsesDialect, messages: Dialect) -> dict[str, Dialect]:
    """The dialect serving each generating route."""
    return {
        "/v1/chat/completions": ChatDialect(),
        "/v1/completions": CompletionsDialect(),
        "/v1/responses": responses,
        "/v1/messages": messages,
    }


class GatewayApp:
    """The request handler of the gateway's HTTP server."""

    def __init__(
        self,
        lifecycle: Lifecycle,
        admin: Admin | None,
        *,
        dialects: Mapping[str, Dialect],
        responses: ResponsesDialect,
        models: Models,
        secrets: Sequence[bytes],
        registry: CollectorRegistry,
        health: Callable[[], dict[str, bool]],
        max_depth: int,
        replica: str = "",
        sessions: ProductionSessions | None = None,
        owners: SessionOwners | None = None,
    ) -> None:
        self._owners = owners
        self._life = lifecycle
        self._sessions = sessions if sessions is not None and sessions.apps else None
        self._replica = replica
        self._admin = admin
        self._responses = responses
        self._dialects = dialects
        self._models = models
        self._secrets = list(secrets)
        self._registry = registry
        self._health = health
        self._max_depth = max_depth
        self._claims: dict[str, EpisodeClaims] = {}

    async def __call__(self, request: Request) -> Response | StreamingResponse:
        started = time.perf_counter()
        path = request.path
        episode: list[str] = []  # filled once the request is authorized
        arm: dict[str, object] = {}  # a session's arm and version, once it is known
        if path.startswith("/e/"):
            token, _, rest = path[3:].partition("/")
            route = "/" + rest
            response = await self._api(request, route, token, episode, path_token=True)
        elif path.startswith(("/s/", "/k/")) and self._sessions is not None:
            route, session, kind = _session_path(path)
            response = await self._session_api(
                request, route, session, kind, episode, arm=arm, in_path=True
            )
        elif path.startswith("/v1/"):
            route = path
            key = _api_key(request) or ""
            named = request.headers.get(SESSION_HEADER)
            if self._sessions is not None and (
                named is not None or self._sessions.apps.by_key(key)
            ):
                kind = request.headers.get(KIND_HEADER, "")
                response = await self._session_api(
                    request, route, named, kind, episode, arm=arm, in_path=False
                )
            else:
                response = await self._api(request, route, key, episode)
        elif path.startswith("/sessions/") and self._sessions is not None:
            route = "/sessions/{id}/end"
            response = await self._end_session(request, path)
        else:
            route = path if path in ("/healthz", "/metrics", "/openapi.json") else ""
            if path.startswith("/admin/") and self._admin is not None:
                route = "/admin/..."
                response = await self._admin.handle(request)
            elif path in ("/healthz", "/metrics"):
                response = _service_route(path, self._health, self._registry)
            elif path == "/openapi.json":
                response = Response(200, [("content-type", "application/json")], document_bytes())
            else:
                response = render(OPENAI, GatewayError(404, f"{path}: not found"))
        template = _template(route)
        self._life.metrics.requests(template, str(response.status)).inc()
        log.info(
            "request",
            method=request.method,
            route=template,
            status=response.status,
            ms=round((time.perf_counter() - started) * 1000, 3),
            episode_id=episode[0] if episode else None,
            stream=isinstance(response, StreamingResponse),
            **arm,
        )
        return response

    async def _api(
        self,
        request: Request,
        route: str,
        token: str,
        episode: list[str],
        *,
        path_token: bool = False,
    ) -> Response | StreamingResponse:
        anthropic = route.startswith("/v1/messages") or "anthropic-version" in request.headers
        shape: ErrorShape = ANTHROPIC if anthropic else OPENAI
        try:
            claims = self._authorize(token)
            if path_token and (other := _api_key(request)) and other != token:
                self._check_same_episode(claims, other)
        except TokenError as err:
            self._life.metrics.refused(err.reason).inc()
            status = _TOKEN_STATUS.get(err.reason, 401)
            return render(shape, GatewayError(status, str(err)))
        episode.append(claims.episode_id)
        return await self._serve(request, route, claims, shape)

    async def _serve(
        self,
        request: Request,
        route: str,
        claims: EpisodeClaims,
        shape: ErrorShape,
        session: SessionCalls | None = None,
    ) -> Response | StreamingResponse:
        """The authorized request, its refusals in the API's own shape."""
        try:
            return await self._route(request, route, claims, shape, session)
        except GatewayError as err:
            return render(shape, err)
        except EpisodeClosedError as err:
            self._life.metrics.refused("closed").inc()
            return render(shape, GatewayError(409, str(err)))
        except Paused as err:
            self._life.metrics.refused("paused" if err.status == 429 else "recovering").inc()
            headers = [("retry-after", str(err.retry_after_s))]
            return render(shape, GatewayError(err.status, str(err), headers=headers))
        except UpstreamError as err:
            return render(shape, GatewayError(err.status, str(err)))

    async def _session_api(
        self,
        request: Request,
        route: str,
        session: str | None,
        kind: str,
        episode: list[str],
        *,
        arm: dict[str, object],
        in_path: bool,
    ) -> Response | StreamingResponse:
        """A production app's call (production_sessions.py): its app key, its session
        (`arm` gets its arm and version for the access log)."""
        assert self._sessions is not None
        anthropic = route.startswith("/v1/messages") or "anthropic-version" in request.headers
        shape: ErrorShape = ANTHROPIC if anthropic else OPENAI
        app = self._sessions.apps.by_key(_api_key(request) or "")
        try:
            if app is None:
                self._life.metrics.refused("app_key").inc()
                raise GatewayError(
                    401,
                    "api key: a production session needs its app's key "
                    "(production.apps) as the API key",
                    "api_key",
                )
            if session is None:
                raise GatewayError(
                    400,
                    f"{SESSION_HEADER}: required: an app's call names its session (this "
                    "header, or /s/<session>/ in the base URL)",
                    SESSION_HEADER,
                )
            where = "path: /s/<session>" if in_path else SESSION_HEADER
            try:
                check_session_id(session, where)
                if kind:
                    check_kind(kind, "path: /k/<kind>" if in_path else KIND_HEADER)
            except ValueError as err:
                raise GatewayError(400, str(err), where) from None
            owner = self._owner(app.name, session)
            if owner is not None:
                return await self._forward(owner, request, shape)
            claims = self._sessions.claims(app, session, kind)
        except GatewayError as err:
            return render(shape, err)
        except SessionEndedError as err:
            self._life.metrics.refused("session_ended").inc()
            # The SDKs retry a 409 unless told not to: an ended session stays ended.
            no_retry = [("x-should-retry", "false")]
            return render(shape, GatewayError(409, str(err), SESSION_HEADER, headers=no_retry))
        episode.append(claims.episode_id)
        calls = self._sessions.calls(claims)
        if calls is not None and calls.version is not None:
            arm.update(arm=calls.arm, policy_version=calls.version)
        response = await self._serve(request, route, claims, shape, calls)
        if request.headers.get(END_HEADER, "").lower() in ("1", "true", "yes"):
            self._sessions.end_after_call(claims)
        return response

    def _owner(self, app: str, session: str) -> str | None:
        """The replica to forward the session's calls to; None when it is this one."""
        if self._owners is None:
            return None
        owner = self._owners.owner(session_group(app, session))
        return None if owner == self._replica else owner

    async def _forward(
        self, owner: str, request: Request, shape: ErrorShape
    ) -> Response | StreamingResponse:
        """The request served by the replica that owns its session (session_owners.py)."""
        assert self._owners is not None
        try:
            return await self._owners.forward(owner, request)
        except NotOwnerError as err:
            log.error("session forwarding loop", error=str(err))
            return render(shape, GatewayError(503, str(err)))
        except (OSError, HttpClientError) as err:
            self._life.metrics.refused("owner_unreachable").inc()
            return render(
                shape,
                GatewayError(
                    503,
                    f"the gateway replica {owner!r} that owns this session is unreachable "
                    f"({type(err).__name__}); retry",
                    headers=[("retry-after", "1")],
                ),
            )

    async def _end_session(self, request: Request, path: str) -> Response | StreamingResponse:
        """`POST /sessions/{session}/end` with the app's key: the session ends (its calls in
        flight finish first); answers its call count. Ending again answers the same."""
        assert self._sessions is not None
        session, _, rest = path.removeprefix("/sessions/").partition("/")
        if rest != "end":
            return render(OPENAI, GatewayError(404, f"{path}: not found"))
        if request.method != "POST":
            return render(OPENAI, GatewayError(405, f"{request.method} {path}: not allowed"))
        app = self._sessions.apps.by_key(_api_key(request) or "")
        if app is None:
            self._life.metrics.refused("app_key").inc()
            return render(OPENAI, GatewayError(401, "api key: an app's key is required", "api_key"))
        try:
            check_session_id(session, "path: /sessions/<session>/end")
            owner = self._owner(app.name, session)
            if owner is not None:
                return await self._forward(owner, request, OPENAI)
            ended = await self._sessions.end(app, session)
        except ValueError as err:
            return render(OPENAI, GatewayError(400, str(err), "session"))
        except KeyError:
            return render(OPENAI, GatewayError(404, f"session {session!r}: unknown", "session"))
        except Exception as err:  # the close was refused (broker away): the app may retry
            return render(OPENAI, GatewayError(503, f"session {session!r}: not ended: {err}"))
        return respond(
            200,
            {"session": session, "ended_by": ended.ended_by, "call_count": ended.call_count},
        )

    async def _route(
        self,
        request: Request,
        route: str,
        claims: EpisodeClaims,
        shape: ErrorShape,
        session: SessionCalls | None = None,
    ) -> Response | StreamingResponse:
        method = request.method
        if route == "/v1/models" or route.startswith("/v1/models/"):
            _expect(method, "GET", route)
            name = route.removeprefix("/v1/models").removeprefix("/")
            return self._models.answer(name or None, anthropic=shape is ANTHROPIC)
        if route.startswith("/v1/responses/"):
            return self._responses.route(method, route.removeprefix("/v1/responses/"), claims)
        dialect = self._dialects.get(route)
        if dialect is None and route != "/v1/messages/count_tokens":
            raise GatewayError(404, f"{route}: not found")
        _expect(method, "POST", route)
        body = self._body(request)
        if dialect is None:
            return await self._count_tokens(claims, body)
        return await self._life.serve(dialect, claims, request, body, session)

    def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError as err:
            raise GatewayError(400, f"body: not valid JSON ({err})", "body") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "body: must be a JSON object", "body")
        check_depth(body, self._max_depth)
        return body

    async def _count_tokens(self, claims: EpisodeClaims, body: dict[str, Any]) -> Response:
        """Anthropic's token count: the prompt the engine would see for this request, as
        its own tokenizer and chat template count it."""
        # Translated as the call would be (server tools left out as there), budget aside.
        call = self._dialects["/v1/messages"].translate(
            {"max_tokens": 1, **body, "stream": False}, claims
        )
        life = self._life
        upstream = engine_request(call.body, CHAT_PATH, life.engines.model, life.settings.val)
        count = await life.budget.prompt_tokens(upstream, True, claims.episode_id)
        if count is None:
            raise GatewayError(502, "the engine cannot count tokens (it serves no /tokenize)")
        return respond(200, {"input_tokens": count})

    def _authorize(self, token: str) -> EpisodeClaims:
        claims = self._claims.get(token)
        if claims is None:
            if not token:
                raise TokenError(
                    "missing", "episode token: none given (in the path, or as the API key)"
                )
            claims = verify(token, self._secrets)
            if claims.gateway != self._replica:
                raise TokenError(
                    "other_replica",
                    f"episode token: episode {claims.episode_id} belongs to gateway replica "
                    f"{claims.gateway or '(unnamed)'!r}, not this one "
                    f"({self._replica or '(unnamed)'!r}): send its calls to that replica's URL",
                )
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


_TOKEN_STATUS = {"other_episode": 403, "other_replica": 421}
"""HTTP status of a refused token, by reason (401 otherwise): 421 Misdirected Request for a
token another gateway replica owns."""


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
        return render(OPENAI, GatewayError(404, f"{path}: not found (this is the admin port)"))


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


def _expect(method: str, allowed: str, route: str) -> None:
    if method != allowed:
        raise GatewayError(405, f"{method} {route}: method not allowed")


def _template(route: str) -> str:
    """The route's template for logs and metric labels: a bounded set, never the token."""
    if route in API_ROUTES or route in ("/healthz", "/metrics", "/openapi.json", "/admin/..."):
        return route
    for prefix in ("/v1/models/", "/v1/responses/"):
        if route.startswith(prefix):
            return prefix + ("{id}/input_items" if route.endswith("/input_items") else "{id}")
    return "other"


def _session_path(path: str) -> tuple[str, str | None, str]:
    """(route, session, kind) of `/s/<session>/v1/...` or `/k/<kind>/s/<session>/v1/...`."""
    kind = ""
    if path.startswith("/k/"):
        kind, _, path = path[3:].partition("/")
        path = "/" + path
    if not path.startswith("/s/"):
        return path, None, kind
    session, _, rest = path[3:].partition("/")
    return "/" + rest, session, kind


def _api_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key")
