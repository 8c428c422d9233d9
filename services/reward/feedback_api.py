"""The feedback API: an app tells the reward service how its sessions went.

    POST   /v1/feedback        {"session", "name", "value", "response_id"?, "idempotency_key"?}
    GET    /v1/sessions/{id}   the app's session: state, end, signals, decided value
    DELETE /v1/sessions/{id}   take the session back: nothing of it is kept or trained again
    GET    /healthz

Served on `reward.feedback_port` when production.apps is set. Each request carries its app's
key (`Authorization: Bearer <key>` or `x-api-key`); sessions are namespaced by app, so an
app can only ever reach its own (another app's session id is simply unknown to it).

A 202 means the signal is on disk (the store's transaction committed with fsync); a repeat
of its idempotency key (by default a digest of name, value and response id, so an exact
retry is the same signal) answers `duplicate: true` and changes nothing. Every refusal
stores nothing and says why in `{"error": {"message", "field", "code"}}`: 400 bad input
(naming the field), 401 no or unknown key, 404 unknown session, 405 wrong method, 409 the
session's reward is already decided, its window ended or it was deleted, 413 body too large.

A DELETE purges the session from the store (a tombstone stays, see feedback_store.py),
publishes SessionDeleted once and waits up to reward.delete_wait_s for the trainer's answer:
200 `{"session", "deleted": true, "applied": true, "trained", "trained_versions"}`, or 202
with `"applied": false` when it has not answered yet (GET shows the answer once it came).
Deleting again gives the same answer.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from typing import Annotated, Any

import orjson
from opentelemetry import trace
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from harnessrl.health import HealthCheck, health_body
from harnessrl.http import HttpServer, Request, Response
from harnessrl.logs import get_logger
from harnessrl.production import (
    Apps,
    AppSpec,
    ProductionSection,
    check_session_id,
    session_group,
    session_traceparent,
)
from harnessrl.services.reward.feedback_join import FeedbackJoin
from harnessrl.services.reward.feedback_store import (
    FeedbackStore,
    SessionRecord,
    SignalReceipt,
    StoredSignal,
    StoreThread,
    Tombstone,
)
from harnessrl.telemetry import extract_context, span_ids
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

FEEDBACK_ROUTE = "/v1/feedback"
SESSIONS_PREFIX = "/v1/sessions/"
_JSON = [("content-type", "application/json")]
_RESPONSE_ID = re.compile(r"(chatcmpl-|cmpl-|resp_|msg_)[A-Za-z0-9_-]+")
_MAX_ID = 200
_REFUSALS = {  # status for each outcome of the store that is not an acceptance
    "unknown_session": 404,
    "decided": 409,
    "window_ended": 409,
    "too_many": 409,
    "deleted": 409,
}


def _response_id(value: str) -> str:
    if len(value) > _MAX_ID or not _RESPONSE_ID.fullmatch(value):
        raise ValueError(
            f"at most {_MAX_ID} characters: chatcmpl-, cmpl-, resp_ or msg_ and then letters, "
            "digits, _ or -"
        )
    return value


def _idempotency_key(value: str | None) -> str | None:
    if value is not None and (not 1 <= len(value) <= _MAX_ID or not value.isprintable()):
        raise ValueError(f"1 to {_MAX_ID} printable characters")
    return value


class FeedbackBody(BaseModel):
    """The body of POST /v1/feedback (the signal's name and range are checked against
    production.feedback.signals after this)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    session: Annotated[str, AfterValidator(check_session_id)]
    name: str
    value: Annotated[float, Field(allow_inf_nan=False)]
    response_id: Annotated[str, AfterValidator(_response_id)] = ""
    idempotency_key: Annotated[str | None, AfterValidator(_idempotency_key)] = None


class FeedbackRefused(Exception):
    """A request refused: its status, the outcome counted, the field and why."""

    def __init__(
        self, status: int, code: str, message: str, field: str = "", allow: str = ""
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.allow = allow

    def response(self) -> Response:
        error = {"message": self.message, "field": self.field, "code": self.code}
        headers = [*_JSON, ("allow", self.allow)] if self.allow else _JSON
        return Response(self.status, headers, orjson.dumps({"error": error}))


def default_key(name: str, value: float, response_id: str) -> str:
    """The idempotency key of a signal sent without one: the same for an exact retry."""
    digest = hashlib.sha256(orjson.dumps([name, float(value), response_id])).hexdigest()
    return f"digest:{digest[:40]}"


class FeedbackApi:
    """The HTTP edge of feedback; see the module docstring. `clock` is wall-clock seconds."""

    def __init__(
        self,
        production: ProductionSection,
        store: StoreThread,
        join: FeedbackJoin,
        tracer: trace.Tracer,
        health: HealthCheck,
        *,
        delete_wait_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._production = production
        self._delete_wait_s = delete_wait_s
        self._apps = Apps(production.apps)
        self._store = store
        self._join = join
        self._metrics = join.metrics
        self._tracer = tracer
        self._health = health
        self._clock = clock
        self._server: HttpServer | None = None

    @property
    def port(self) -> int:
        """The port listened on, once started."""
        return 0 if self._server is None else self._server.port

    async def start(self, host: str, port: int) -> None:
        limit = self._production.feedback.max_body_bytes
        self._server = HttpServer(
            self.handle,
            host=host,
            port=port,
            max_body_bytes=limit,
            max_buffered_bytes=64 * limit,
            header_timeout_s=10.0,
            body_timeout_s=10.0,
            on_error=self._server_error,
        )
        await self._server.start()
        log.info("feedback API listening", url=f"http://{host}:{self._server.port}")

    async def stop(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s=5.0)

    async def handle(self, request: Request) -> Response:
        path, method = request.path, request.method
        try:
            if path == "/healthz":
                _allow(method, "GET", "HEAD")
                status, body = health_body(self._health())
                return Response(status, _JSON, body)
            if path == FEEDBACK_ROUTE:
                _allow(method, "POST")
                return await self._feedback(request)
            if path.startswith(SESSIONS_PREFIX):
                _allow(method, "GET", "HEAD", "DELETE")
                if method == "DELETE":
                    return await self._delete(request, path[len(SESSIONS_PREFIX) :])
                return await self._show(request, path[len(SESSIONS_PREFIX) :])
            raise FeedbackRefused(404, "not_found", f"{path}: no such route")
        except FeedbackRefused as refused:
            if path == FEEDBACK_ROUTE and refused.status != 405:
                self._metrics.signals(f"refused_{refused.code}").inc()
            return refused.response()

    def _server_error(self, status: int, message: str, path: str = "") -> Response:
        """The responses the server gives itself (413 above all), in this API's shape."""
        code = "too_large" if status == 413 else "server"
        field = "body" if status == 413 else ""
        if path == FEEDBACK_ROUTE and status == 413:
            self._metrics.signals(f"refused_{code}").inc()
            message = f"{message} (production.feedback.max_body_bytes)"
        return FeedbackRefused(status, code, message, field).response()

    def _app(self, request: Request) -> AppSpec:
        auth = request.headers.get("authorization", "")
        key = (
            auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        )
        if not key:
            raise FeedbackRefused(
                401, "unauthorized", "no app key: send Authorization: Bearer <key> or x-api-key"
            )
        app = self._apps.by_key(key)
        if app is None:
            raise FeedbackRefused(401, "unauthorized", "unknown app key", "authorization")
        return app

    async def _feedback(self, request: Request) -> Response:
        app = self._app(request)
        body = self._parse(request.body)
        group_id = session_group(app.name, body.session)
        key = body.idempotency_key or default_key(body.name, body.value, body.response_id)
        traceparent = session_traceparent(app.name, body.session)
        parent = extract_context([("traceparent", traceparent.encode())])
        with self._tracer.start_as_current_span("feedback.signal", context=parent) as span:
            trace_id, span_id = span_ids(span)
            signal = StoredSignal(
                body.name, body.value, body.response_id, key, self._clock(), span_id, trace_id
            )
            receipt = await self._store.call(FeedbackStore.add_signal, group_id, signal)
            span.set_attribute("harnessrl.episode_id", group_id)
            span.set_attribute("harnessrl.feedback.name", signal.name)
            span.set_attribute("harnessrl.feedback.outcome", receipt.outcome)
            log.info(
                "feedback signal",
                app=app.name,
                session=body.session,
                name=signal.name,
                value=signal.value,
                response_id=signal.response_id,
                outcome=receipt.outcome,
            )
        return await self._answer(body.session, group_id, signal, receipt)

    async def _answer(
        self, session: str, group_id: str, signal: StoredSignal, receipt: SignalReceipt
    ) -> Response:
        outcome = receipt.outcome
        if outcome in _REFUSALS:
            raise FeedbackRefused(
                _REFUSALS[outcome], outcome, _refusal(outcome, session), "session"
            )
        answer: dict[str, Any] = {"session": session, "accepted": True, "duplicate": False}
        if outcome == "duplicate":
            answer["duplicate"] = True
            if not receipt.same_content:
                answer["message"] = (
                    f"idempotency_key {signal.idempotency_key!r} was already used for a signal "
                    "with other content; the first one counts, this one changed nothing"
                )
        elif receipt.ended_at is not None:
            delay = signal.received_at - receipt.ended_at
            if delay >= 0:
                self._metrics.delay.observe(delay)
            await self._join.settle([group_id])  # may decide it now
        self._metrics.signals(outcome).inc()
        return Response(202, _JSON, orjson.dumps(answer))

    def _parse(self, raw: bytes) -> FeedbackBody:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as err:
            raise FeedbackRefused(
                400, "malformed", f"body: not valid JSON ({err})", "body"
            ) from None
        if not isinstance(data, dict):
            raise FeedbackRefused(400, "malformed", "body: must be a JSON object", "body")
        try:
            body = FeedbackBody.model_validate(data)
        except ValidationError as err:
            first = err.errors()[0]
            field = ".".join(str(part) for part in first["loc"])
            reason = str(first["msg"]).removeprefix("Value error, ")
            if not reason.startswith(f"{field}:"):
                reason = f"{field}: {reason}"
            raise FeedbackRefused(400, "invalid", reason, field) from None
        rule = self._production.feedback.signals.get(body.name)
        if rule is None:
            known = ", ".join(sorted(self._production.feedback.signals))
            raise FeedbackRefused(
                400, "invalid", f"name: unknown signal {body.name!r} (accepted: {known})", "name"
            )
        if not rule.min <= body.value <= rule.max:
            raise FeedbackRefused(
                400,
                "invalid",
                f"value: {body.value:g} is outside [{rule.min:g}, {rule.max:g}] for {body.name!r}",
                "value",
            )
        return body

    def _session_of(self, request: Request, session_id: str) -> tuple[AppSpec, str]:
        """The app and the group id of the session a /v1/sessions/{id} request names."""
        app = self._app(request)
        try:
            check_session_id(session_id)
        except ValueError as err:
            raise FeedbackRefused(400, "invalid", str(err), "session") from None
        return app, session_group(app.name, session_id)

    async def _show(self, request: Request, session_id: str) -> Response:
        _, group_id = self._session_of(request, session_id)
        record = await self._store.call(FeedbackStore.session, group_id)
        if record is None:
            tomb = await self._store.call(FeedbackStore.tombstone, group_id)
            if tomb is None:
                raise _unknown(session_id)
            return Response(200, _JSON, orjson.dumps(_deletion_view(tomb)))
        signals = await self._store.call(FeedbackStore.signals, group_id)
        return Response(200, _JSON, orjson.dumps(self._session_view(record, signals)))

    async def _delete(self, request: Request, session_id: str) -> Response:
        app, group_id = self._session_of(request, session_id)
        traceparent = session_traceparent(app.name, session_id)
        parent = extract_context([("traceparent", traceparent.encode())])
        with self._tracer.start_as_current_span("feedback.delete", context=parent) as span:
            span.set_attribute("harnessrl.episode_id", group_id)
            tomb = await self._join.delete(app.name, session_id, self._delete_wait_s)
            if tomb is None:
                raise _unknown(session_id)
            span.set_attribute("harnessrl.feedback.applied", tomb.applied_at is not None)
        status = 202 if tomb.applied_at is None else 200
        answer = {k: v for k, v in _deletion_view(tomb).items() if k not in _TOMB_ONLY}
        return Response(status, _JSON, orjson.dumps(answer))

    def _session_view(self, record: SessionRecord, signals: list[StoredSignal]) -> dict[str, Any]:
        window = self._production.feedback.window_s
        view: dict[str, Any] = {
            "session": record.session_id,
            "state": record.view,
            "kind": record.kind,
            "explored": record.explored,
            "started_at": record.started_at,
            "ended_at": record.ended_at,
            "ended_by": record.ended_by,
            "window_ends_at": None if record.ended_at is None else record.ended_at + window,
            "signals": [
                {
                    "name": s.name,
                    "value": s.value,
                    "response_id": s.response_id,
                    "idempotency_key": s.idempotency_key,
                    "received_at": s.received_at,
                }
                for s in signals
            ],
            "decided_at": record.decided_at,
            "value": None,
            "missing": None,
        }
        if record.reward is not None:
            reward = pb.RewardAssigned.FromString(record.reward)
            view["missing"] = reward.missing
            view["value"] = None if reward.missing else reward.value
        return view


_TOMB_ONLY = ("state", "deleted_at", "applied_at", "dropped_tokens", "version")
"""What GET shows of a deleted session and the DELETE answer leaves out."""


def _deletion_view(tomb: Tombstone) -> dict[str, Any]:
    """A deleted session as the API shows it (the DELETE answer is its first keys)."""
    applied = tomb.applied_at is not None
    return {
        "session": tomb.session_id,
        "deleted": True,
        "applied": applied,
        "trained": bool(tomb.trained_versions) if applied else None,
        "trained_versions": list(tomb.trained_versions) if applied else None,
        "state": "deleted",
        "deleted_at": tomb.deleted_at,
        "applied_at": tomb.applied_at,
        "dropped_tokens": tomb.dropped_tokens if applied else None,
        "version": tomb.version if applied else None,
    }


def _unknown(session: str) -> FeedbackRefused:
    return FeedbackRefused(404, "unknown_session", _refusal("unknown_session", session), "session")


def _allow(method: str, *allowed: str) -> None:
    if method not in allowed:
        methods = ", ".join(allowed)
        raise FeedbackRefused(
            405, "method", f"{method}: method not allowed (allowed: {methods})", allow=methods
        )


def _refusal(outcome: str, session: str) -> str:
    return {
        "unknown_session": f"session {session!r}: no such session of this app",
        "decided": f"session {session!r}: its reward is already decided; not counted",
        "window_ended": f"session {session!r}: its feedback window has ended; not counted",
        "too_many": f"session {session!r}: it holds the most signals a session may; not counted",
        "deleted": f"session {session!r}: deleted by its app; not counted",
    }[outcome]
