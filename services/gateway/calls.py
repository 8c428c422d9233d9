"""One harness call through the gateway: admit, forward, capture, account.

`Forwarder.call()` gives a `Call`, used as an async context manager by the API routes:
entering it passes the pause gate and the episode book (a closed episode raises there, so a
refused call captures nothing), exiting it ends the call's span and bookkeeping. In between,
`complete()` or `chunks()` forward the call to the episode's engine. Only a call that the
engine completed, and that the harness received in full, is captured: one ModelCall per
choice, with the next sequence numbers of its episode, stamped with the policy version the
engine names in its x-policy-version header or, for an engine that sends none (vLLM), the
version it had loaded when the call was sent (services/gateway/versions.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from harnessrl.bus import Producer
from harnessrl.episode_token import EpisodeClaims
from harnessrl.http.errors import ConnectionClosedError
from harnessrl.logs import get_logger
from harnessrl.services.gateway.capture import Completion, prepare, take
from harnessrl.services.gateway.config import GatewaySection
from harnessrl.services.gateway.control import Gate
from harnessrl.services.gateway.engines import EnginePool
from harnessrl.services.gateway.episodes import Episode, EpisodeBook
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.services.gateway.versions import EngineVersions
from harnessrl.telemetry import extract_context, span_ids
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

VERSION_HEADER = "x-policy-version"
_MODES = {"train": pb.MODE_TRAIN, "val": pb.MODE_VAL}


@dataclass(frozen=True, slots=True)
class StreamStart:
    """How the engine answered a streamed call: `error` is its body when status is not 200."""

    status: int
    error: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Upstream:
    """An engine's non-streamed answer: the parsed body when status is 200, else raw."""

    status: int
    data: dict[str, Any] | None
    raw: bytes


class Forwarder:
    """Everything a call needs; one per gateway."""

    def __init__(
        self,
        settings: GatewaySection,
        *,
        pool: EnginePool,
        book: EpisodeBook,
        gate: Gate,
        producer: Producer,
        metrics: GatewayMetrics,
        tracer: trace.Tracer,
        engine_model: str,
        versions: EngineVersions,
        recovery: Gate | None = None,
    ) -> None:
        self.settings = settings
        self.recovery = recovery
        """Closed while the gateway rebuilds its episodes from hrl.calls after a start."""
        self.pool = pool
        self.book = book
        self.gate = gate
        self.producer = producer
        self.metrics = metrics
        self.tracer = tracer
        self.engine_model = engine_model
        self.versions = versions

    def call(
        self,
        claims: EpisodeClaims,
        *,
        api: int,
        kind: str,
        path: str,
        body: dict[str, Any],
        raw: bytes,
        traceparent: str | None,
    ) -> Call:
        return Call(
            self, claims, api=api, kind=kind, path=path, body=body, raw=raw, traceparent=traceparent
        )


class Call:
    """One forwarded call; see the module docstring."""

    def __init__(
        self,
        forwarder: Forwarder,
        claims: EpisodeClaims,
        *,
        api: int,
        kind: str,
        path: str,
        body: dict[str, Any],
        raw: bytes,
        traceparent: str | None,
    ) -> None:
        self._f = forwarder
        self.claims = claims
        self.api = api
        self.kind = kind
        self.path = path
        overrides = forwarder.settings.train if claims.mode == "train" else forwarder.settings.val
        self.upstream, self.asked = prepare(body, kind, forwarder.engine_model, overrides)
        self._raw = raw
        self._parent = traceparent or claims.traceparent
        self._episode: Episode | None = None
        self._span: trace.Span | None = None
        self._token: object = None
        self._started = time.perf_counter()
        self._started_ns = time.time_ns()
        self._versions: Mapping[str, int] = {}  # engines' loaded versions when sent
        self.outcome = "error"

    async def __aenter__(self) -> Call:
        if self._f.recovery is not None:
            await self._f.recovery.enter()
        await self._f.gate.enter()
        self._episode = self._f.book.begin(self.claims)  # raises for a closed episode
        parent = extract_context([("traceparent", self._parent.encode())]) if self._parent else None
        self._span = self._f.tracer.start_span(
            f"gateway {self.kind}", context=parent, kind=SpanKind.SERVER
        )
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        if self._span.is_recording():
            self._span.set_attributes(
                {
                    "harnessrl.episode_id": self.claims.episode_id,
                    "harnessrl.attempt": self.claims.attempt,
                    "harnessrl.group_id": self.claims.group_id,
                    "harnessrl.mode": self.claims.mode,
                    "harnessrl.stream": self.asked.stream,
                }
            )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._span is not None:
            if exc is not None:
                self._span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            self._span.end()
            otel_context.detach(self._token)  # type: ignore[arg-type]  # attach's token
        if self._episode is not None:
            self._f.book.end(self._episode)
        self._f.metrics.calls(self.kind, self.outcome).inc()
        self._f.metrics.latency(self.kind).observe(time.perf_counter() - self._started)

    async def complete(self) -> Upstream:
        """Forward a non-streamed call; a 200 answer is captured before it is returned."""
        body = orjson.dumps(self.upstream)
        self._versions = self._f.versions.snapshot()
        engine, response = await self._f.pool.request(self.claims.episode_id, self.path, body)
        if response.status != 200:
            self.outcome = f"engine_{response.status}"
            return Upstream(response.status, None, response.body)
        data = orjson.loads(response.body)
        completions: dict[int, Completion] = {}
        take(data, self.kind, completions)
        self._capture(completions, engine, response.headers.get(VERSION_HEADER), response.body)
        return Upstream(200, data, response.body)

    async def chunks(self) -> AsyncIterator[StreamStart | dict[str, Any]]:
        """Forward a streamed call: first a StreamStart, then (when the engine answered 200)
        each chunk as the engine sent it. Captured only when the stream ran to its `[DONE]`
        without an error event (an engine that failed mid-way sends one, as vLLM does, and
        the harness sees the error): a harness that went away, or a generation that failed,
        trains nothing."""
        body = orjson.dumps(self.upstream)
        self._versions = self._f.versions.snapshot()
        async with self._f.pool.stream(self.claims.episode_id, self.path, body) as (
            engine,
            response,
        ):
            if response.status != 200:
                self.outcome = f"engine_{response.status}"
                raw = b"".join([chunk async for chunk in response.iter_chunks()])
                yield StreamStart(response.status, _error_dict(raw))
                return
            yield StreamStart(200, None)
            completions: dict[int, Completion] = {}
            sent: list[bytes] = []
            done = failed = False
            async for payload in response.iter_sse():
                if payload.strip() == b"[DONE]":
                    done = True
                    break
                chunk = orjson.loads(payload)
                if "error" in chunk or chunk.get("object") == "error":
                    failed = True
                    self.outcome = "engine_error"
                else:
                    take(chunk, self.kind, completions)
                if self._f.settings.capture_bodies:
                    sent.append(payload)
                yield chunk
            if done and not failed:
                self._capture(
                    completions, engine, response.headers.get(VERSION_HEADER), b"\n".join(sent)
                )
            elif not failed:  # the harness's stream is cut too, as when the engine goes away
                self.outcome = "engine_cut"
                raise ConnectionClosedError(f"{engine}: the stream ended before its [DONE]")

    def _capture(
        self,
        completions: dict[int, Completion],
        engine: str,
        header: str | None,
        response_body: bytes,
    ) -> None:
        assert self._episode is not None and self._span is not None
        settings = self._f.settings
        # The engine's own word wins; else what it had loaded when the call was sent.
        version = int(header) if header and header.isdigit() else self._versions.get(engine, 0)
        trace_id, span_id = span_ids(self._span)
        latency_ms = (time.perf_counter() - self._started) * 1000
        cap = settings.body_capture_bytes if settings.capture_bodies else 0
        temperature = float(self.upstream.get("temperature", 1.0))
        top_p = float(self.upstream.get("top_p", 1.0))
        seqs: list[int] = []
        for index in sorted(completions):
            completion = completions[index]
            if len(completion.logprobs) != len(completion.ids):
                self._f.metrics.mismatches.inc()
                log.warning(
                    "engine returned log-probs not aligned with token ids",
                    ids=len(completion.ids),
                    logprobs=len(completion.logprobs),
                )
            call = pb.ModelCall(
                episode_id=self.claims.episode_id,
                attempt=self.claims.attempt,
                group_id=self.claims.group_id,
                seq=self._episode.next_seq(),
                mode=_MODES[self.claims.mode],
                api=self.api,  # type: ignore[arg-type]
                model=self.asked.model,
                prompt_token_ids=completion.prompt_ids,
                completion_token_ids=completion.ids,
                completion_logprobs=completion.logprobs,
                policy_version=version,
                finish_reason=completion.finish_reason,
                latency_ms=latency_ms,
                stream=self.asked.stream,
                trace_id=trace_id,
                span_id=span_id,
                engine=engine,
                temperature=temperature,
                top_p=top_p,
                request_body=self._raw[:cap],
                response_body=response_body[:cap],
                bodies_truncated=cap > 0 and (len(self._raw) > cap or len(response_body) > cap),
            )
            call.started_at.FromNanoseconds(self._started_ns)
            seqs.append(call.seq)
            self._episode.keep(self._f.producer.publish(call))  # type: ignore[arg-type]
            self._f.metrics.prompt_tokens.inc(len(completion.prompt_ids))
            self._f.metrics.completion_tokens.inc(len(completion.ids))
        if self._span.is_recording():
            self._span.set_attributes(
                {
                    "harnessrl.engine": engine,
                    "harnessrl.policy_version": str(version),
                    "harnessrl.choices": len(completions),
                    "harnessrl.seq": seqs,
                    "harnessrl.prompt_tokens": sum(len(c.prompt_ids) for c in completions.values()),
                    "harnessrl.completion_tokens": sum(len(c.ids) for c in completions.values()),
                }
            )
        self.outcome = "ok"


def _error_dict(raw: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {
            "error": {
                "message": raw.decode("utf-8", "replace")[:500],
                "type": "api_error",
                "param": None,
                "code": None,
            }
        }
    return data if isinstance(data, dict) else {"error": {"message": str(data)}}
