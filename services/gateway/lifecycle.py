"""One harness call through the gateway, whatever its dialect: admit, forward, capture, answer.

`Lifecycle.serve()` is the whole life of a call, written once:

1. the dialect translates the harness's request into an engine call (a 400 in the harness's
   shape if it refuses it);
2. admission: the recovery and pause gates, then the episode book (a closed episode is a
   409: a refused call captures nothing);
3. the completion budget is fitted to the engine's context (services/gateway/budget.py);
4. the call goes to the episode's engine under the inference contract (contract.py); a
   production session's call in a canary rollout goes only to engines serving its version
   (session_arms.py), and its answer is counted in the session's guard stats;
5. only a call that the engine completed is captured: one ModelCall per choice with the
   next sequence numbers of its episode, written to the producer (and its WAL) before the
   harness gets the answer's last byte; a stream is captured only when it ran to its
   `[DONE]` without an error event, so a harness that went away, or a generation that
   failed, trains nothing;
6. outcome: the call's span ends, its metrics are counted, the episode book is told.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from harnessrl.bus import Producer
from harnessrl.episode_token import EpisodeClaims
from harnessrl.http import Request, Response, SseDecoder, StreamingResponse
from harnessrl.http.errors import ConnectionClosedError
from harnessrl.logs import get_logger
from harnessrl.rollout import Rollout, RolloutState
from harnessrl.services.gateway.budget import Budget
from harnessrl.services.gateway.config import GatewaySection
from harnessrl.services.gateway.control import Gate
from harnessrl.services.gateway.dialects.base import Dialect, EngineCall
from harnessrl.services.gateway.engines import EnginePool
from harnessrl.services.gateway.errors import render_engine, respond
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.services.gateway.open_episodes import EpisodeBook, OpenEpisode
from harnessrl.services.gateway.session_arms import SessionCalls, call_status
from harnessrl.services.gateway.tool_markup import Answer, ChatParts, chat_answer
from harnessrl.services.gateway.versions import EngineVersions
from harnessrl.telemetry import extract_context, span_ids
from harnessrl.trust.capture import (
    Completion,
    Exchange,
    StreamCapture,
    aligned,
    model_calls,
    take,
)
from harnessrl.trust.contract import (
    CHAT_PATH,
    VERSION_HEADER,
    constrained,
    engine_request,
    policy_version,
)

log = get_logger(__name__)

RESPONSE_ID_CHARS = 256
"""Longest response id recorded (the engine's free text; a hostile engine cannot bloat calls)."""
SSE_HEADERS = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]


class CallAdmission:
    """What a call passes before it reaches an engine: the gateway's gates and its book."""

    def __init__(self, book: EpisodeBook, gate: Gate, recovery: Gate | None = None) -> None:
        self.book = book
        self.gate = gate
        self.recovery = recovery
        """Closed while the gateway rebuilds its episodes from hrl.calls after a start."""

    async def enter(self, claims: EpisodeClaims) -> OpenEpisode:
        """Wait for the gates; raises Paused past their hold, EpisodeClosedError for a
        closed episode."""
        if self.recovery is not None:
            await self.recovery.enter()
        await self.gate.enter()
        return self.book.begin(claims)


class Engines:
    """The engines' side of a call: which one serves it, under what name and version."""

    def __init__(
        self,
        pool: EnginePool,
        *,
        model: str,
        versions: EngineVersions,
        rollout: RolloutState | None = None,
    ) -> None:
        self.pool = pool
        self.model = model
        """The model name the engines are asked for."""
        self.versions = versions
        self.rollout = rollout
        """The canary rollout (with production.canary.enabled): calls of no session's
        version are asked for its current version, the newest not rolled back."""

    def current(self) -> Rollout:
        """The rollout's state now (empty without one)."""
        return self.rollout.state if self.rollout is not None else Rollout()


class Lifecycle:
    """Serves harness calls; one per gateway."""

    def __init__(
        self,
        settings: GatewaySection,
        *,
        admission: CallAdmission,
        engines: Engines,
        budget: Budget,
        producer: Producer,
        metrics: GatewayMetrics,
        tracer: trace.Tracer,
    ) -> None:
        self.settings = settings
        self.admission = admission
        self.engines = engines
        self.budget = budget
        self.producer = producer
        self.metrics = metrics
        self.tracer = tracer

    async def serve(
        self,
        dialect: Dialect,
        claims: EpisodeClaims,
        request: Request,
        body: dict[str, Any],
        session: SessionCalls | None = None,
    ) -> Response | StreamingResponse:
        """Answer one harness request (of a production session: `session`, which routes
        it and counts it). Raises GatewayError (refused; 503 while no engine serves the
        session's version), Paused, EpisodeClosedError, UpstreamError (no engine
        answered): the caller renders them in the dialect's shape."""
        call = dialect.translate(body, claims)
        run = _CallRun(self, dialect, claims, call, request, session=session)
        await run.start()
        try:
            if call.stream:
                return await run.stream()  # the stream ends the call
            answer = await run.complete()
        except BaseException as err:
            run.end(err)
            raise
        run.end()
        return answer


class _StreamRelay:
    """The harness's stream: `chunks`, and `over` run when it is closed even if it never
    started (an async generator closed before its first step skips its `finally`: a
    harness that left while the engine's stream opened would hold its episode open)."""

    __slots__ = ("_chunks", "_over")

    def __init__(
        self, chunks: AsyncGenerator[bytes, None], over: Callable[[], Awaitable[None]]
    ) -> None:
        self._chunks = chunks
        self._over = over

    def __aiter__(self) -> _StreamRelay:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        await self._chunks.aclose()
        await self._over()


class _CallRun:
    """The state of one call between admission and its end."""

    def __init__(
        self,
        life: Lifecycle,
        dialect: Dialect,
        claims: EpisodeClaims,
        call: EngineCall,
        request: Request,
        *,
        session: SessionCalls | None = None,
    ) -> None:
        self._life = life
        self._session = session
        self._among: frozenset[str] | None = None
        """The engines that may serve this call (None: any)."""
        self._answer: Answer | None = None
        self._dialect = dialect
        self._claims = claims
        self._call = call
        self._raw = request.body
        self._parent = request.headers.get("traceparent") or claims.traceparent
        settings = life.settings
        overrides = settings.train if claims.mode == "train" else settings.val
        self._upstream = engine_request(call.body, call.path, life.engines.model, overrides)
        self._episode: OpenEpisode | None = None
        self._span: trace.Span | None = None
        self._token: object = None
        self._started = time.perf_counter()
        self._started_ns = time.time_ns()
        self._versions: Mapping[str, int] = {}
        self._ended = False
        self.outcome = "error"

    async def start(self) -> None:
        self._episode = await self._life.admission.enter(self._claims)
        parent = extract_context([("traceparent", self._parent.encode())]) if self._parent else None
        span = self._span = self._life.tracer.start_span(
            f"gateway {self._dialect.kind}", context=parent, kind=SpanKind.SERVER
        )
        self._token = otel_context.attach(trace.set_span_in_context(span))
        if span.is_recording():
            claims = self._claims
            span.set_attributes(
                {
                    "harnessrl.episode_id": claims.episode_id,
                    "harnessrl.attempt": claims.attempt,
                    "harnessrl.group_id": claims.group_id,
                    "harnessrl.mode": claims.mode,
                    "harnessrl.stream": self._call.stream,
                }
            )

    def end(self, err: BaseException | None = None) -> None:
        """The call is over (idempotent)."""
        if self._ended:
            return
        self._ended = True
        life = self._life
        if self._span is not None:
            if err is not None:
                self._span.set_status(Status(StatusCode.ERROR, type(err).__name__))
            self._span.end()
            otel_context.detach(self._token)  # type: ignore[arg-type]  # attach's token
        if self._episode is not None:
            life.admission.book.end(self._episode)
        seconds = time.perf_counter() - self._started
        life.metrics.calls(self._dialect.kind, self.outcome).inc()
        life.metrics.latency(self._dialect.kind).observe(seconds)
        if self._session is not None:
            self._session.record(call_status(self.outcome, err), seconds * 1000, self._answer)

    async def _encoded(self) -> bytes:
        """The engine request's bytes, its budget fitted to the context."""
        call = self._call
        return await self._life.budget.fit(
            self._upstream,
            chat=call.path == CHAT_PATH,
            episode_id=self._claims.episode_id,
            budget_field=call.budget_field,
            prompt_field=call.prompt_field,
        )

    def _per_engine(self, body: bytes) -> Callable[[str], bytes]:
        """Take the engines' versions as of now; the body for each engine names the model
        its version is served under, when it reported one (a LoRA adapter in vLLM). A
        session with a version is sent only to engines serving it, under its name there."""
        engines = self._life.engines
        self._versions = engines.versions.snapshot()
        models = engines.versions.models()
        if self._session is not None and self._session.version is not None:
            models = self._route(self._session)
        elif engines.rollout is not None:
            models = self._current(models)

        def body_for(engine: str) -> bytes:
            model = models.get(engine.rstrip("/"))
            if not model:
                return body
            renamed = orjson.loads(body)
            renamed["model"] = model
            return orjson.dumps(renamed)

        return body_for

    def _current(self, models: Mapping[str, str]) -> Mapping[str, str]:
        """In a rollout, a call of no session's version asks each engine for the highest
        version it serves that was not rolled back: an engine keeping a rolled-back one
        for the sessions it serves is not asked for it (the trainer drops its samples)."""
        state = self._life.engines.current()
        versions = dict(self._versions)
        chosen = dict(models)
        for engine, served in self._life.engines.versions.serving().items():
            kept = [v for v in served if not state.retired(v)]
            if kept and max(kept) != versions.get(engine):
                versions[engine] = max(kept)
                chosen[engine] = served[max(kept)]
        self._versions = versions
        return chosen

    def _route(self, session: SessionCalls) -> Mapping[str, str]:
        """Engine -> model name for the session's version (session_arms.route); a retired
        version served nowhere is given up for stable, once, loudly."""
        life = self._life
        chosen = session.route_call(
            life.engines.versions.serving(),
            life.engines.current(),
            retry_after_s=life.settings.pause_retry_after_s,
        )
        if chosen.switched_from is not None:
            life.metrics.version_switches.inc()
            log.warning(
                "session version retired and served nowhere; the session is served from "
                "stable from now on",
                episode_id=self._claims.episode_id,
                version=chosen.switched_from,
                stable=chosen.version,
            )
        self._among = frozenset(chosen.engines)
        self._versions = {engine: chosen.version for engine in chosen.engines}
        return chosen.engines

    async def complete(self) -> Response:
        body = self._per_engine(await self._encoded())
        engine, response = await self._life.engines.pool.request(
            self._claims.episode_id, self._call.path, body, self._among
        )
        if response.status != 200:
            self.outcome = f"engine_{response.status}"
            return render_engine(self._dialect.errors, response.status, response.body)
        data = orjson.loads(response.body)
        self._answer = chat_answer(data)
        completions: dict[int, Completion] = {}
        take(data, self._call.path == CHAT_PATH, completions)
        self._capture(
            completions,
            engine,
            response.headers.get(VERSION_HEADER),
            response.body,
            str(data.get("id") or ""),
        )
        return respond(200, self._call.renderer.body(data))

    async def stream(self) -> Response | StreamingResponse:
        """Open the engine's stream; its answer is streamed by `_relay`, which ends the call
        (an engine error before the stream is answered whole, in the dialect's shape)."""
        body = self._per_engine(await self._encoded())
        stack = AsyncExitStack()
        try:
            engine, response = await stack.enter_async_context(
                self._life.engines.pool.stream(
                    self._claims.episode_id, self._call.path, body, self._among
                )
            )
            if response.status != 200:
                self.outcome = f"engine_{response.status}"
                raw = await response.read()
                await stack.aclose()
                self.end()
                return render_engine(self._dialect.errors, response.status, raw)
        except BaseException:
            await stack.aclose()
            raise
        relay = _StreamRelay(self._relay(stack, engine, response), lambda: self._over(stack))
        return StreamingResponse(200, list(SSE_HEADERS), relay)

    async def _relay(
        self, stack: AsyncExitStack, engine: str, response: Any
    ) -> AsyncGenerator[bytes, None]:
        """The harness's stream: each network read of the engine's stream is translated
        and written as one piece."""
        renderer = self._call.renderer.stream()
        capture = StreamCapture(chat=self._call.path == CHAT_PATH)
        keep = self._life.settings.capture_bodies
        sent: list[bytes] = []
        decoder = SseDecoder()
        parts = ChatParts()
        engine_id = ""
        try:
            while data := await response.read_chunk():
                out: list[bytes] = []
                for payload in decoder.feed(data):
                    chunk = capture.event(payload)
                    if chunk is None:  # [DONE]
                        break
                    if capture.failed:
                        self.outcome = "engine_error"
                        out.append(renderer.fail(chunk))
                        break
                    if keep:
                        sent.append(payload)
                    engine_id = engine_id or str(chunk.get("id") or "")
                    parts.add_body(chunk)
                    out.append(renderer.feed(chunk))
                if capture.finished:
                    self._answer = parts.answer()
                    self._capture(
                        capture.completions,
                        engine,
                        response.headers.get(VERSION_HEADER),
                        b"\n".join(sent),
                        engine_id,
                    )
                    out.append(renderer.finish())
                if out:
                    yield b"".join(out)
                if capture.done or capture.failed:
                    break
            if not (capture.done or capture.failed):  # the harness's stream is cut, as the
                self.outcome = "engine_cut"  # engine's was
                raise ConnectionClosedError(f"{engine}: the stream ended before its [DONE]")
        finally:
            await self._over(stack)

    async def _over(self, stack: AsyncExitStack) -> None:
        """End a streamed call (idempotent): its engine stream closed, its books kept."""
        if self.outcome == "error":
            self.outcome = "aborted"  # the harness went away mid-stream
        await stack.aclose()
        self.end()

    def _capture(
        self,
        completions: dict[int, Completion],
        engine: str,
        header: str | None,
        response_body: bytes,
        engine_id: str,
    ) -> None:
        life, episode, span = self._life, self._episode, self._span
        assert episode is not None and span is not None
        if not aligned(completions):
            life.metrics.mismatches.inc()
            log.warning("engine returned log-probs not aligned with token ids", engine=engine)
        cap = life.settings.body_capture_bytes if life.settings.capture_bodies else 0
        trace_id, span_id = span_ids(span)
        exchange = Exchange(
            claims=self._claims,
            api=self._dialect.api,
            model=self._call.model,
            stream=self._call.stream,
            policy_version=policy_version(header, self._versions.get(engine.rstrip("/"), 0)),
            engine=engine,
            temperature=float(self._upstream.get("temperature", 1.0)),
            top_p=float(self._upstream.get("top_p", 1.0)),
            latency_ms=(time.perf_counter() - self._started) * 1000,
            started_ns=self._started_ns,
            trace_id=trace_id,
            span_id=span_id,
            request_body=self._raw[:cap],
            response_body=response_body[:cap],
            bodies_truncated=cap > 0 and (len(self._raw) > cap or len(response_body) > cap),
            constrained=constrained(self._upstream) if self._claims.mode == "train" else "",
            response_id=self._call.renderer.response_id(engine_id)[:RESPONSE_ID_CHARS],
        )
        calls = model_calls(exchange, completions, episode.calls)
        for call in calls:
            episode.next_seq()
            episode.keep(life.producer.publish(call))  # type: ignore[arg-type]  # a Future
        prompt = sum(len(c.prompt_ids) for c in completions.values())
        completion = sum(len(c.ids) for c in completions.values())
        life.metrics.prompt_tokens.inc(prompt)
        life.metrics.completion_tokens.inc(completion)
        if span.is_recording():
            span.set_attributes(
                {
                    "harnessrl.engine": engine,
                    "harnessrl.policy_version": str(exchange.policy_version),
                    "harnessrl.choices": len(completions),
                    "harnessrl.seq": [c.seq for c in calls],
                    "harnessrl.prompt_tokens": prompt,
                    "harnessrl.completion_tokens": completion,
                }
            )
        self.outcome = "ok"
