"""W3C trace context in Kafka record headers (`traceparent`, `tracestate`).

The producer injects the context current at publish time; the consumer extracts it and
starts its processing span as a child, so one trace follows an event across services.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Headers = list[tuple[str, bytes]]

_PROPAGATOR = TraceContextTextMapPropagator()  # stateless; W3C only, by contract


class _HeaderSetter(Setter[Headers]):
    def set(self, carrier: Headers, key: str, value: str) -> None:
        carrier.append((key, value.encode()))


class _HeaderGetter(Getter[Sequence[tuple[str, bytes]]]):
    def get(self, carrier: Sequence[tuple[str, bytes]], key: str) -> list[str] | None:
        values = [v.decode("utf-8", "replace") for k, v in carrier if k == key]
        return values or None

    def keys(self, carrier: Sequence[tuple[str, bytes]]) -> list[str]:
        return [k for k, _ in carrier]


_SETTER = _HeaderSetter()
_GETTER = _HeaderGetter()


def inject_headers(headers: Headers, context: Context | None = None) -> Headers:
    """Append `traceparent`/`tracestate` for `context` (default: the current one) to headers.

    Appends nothing when there is no valid span in the context. Returns `headers`.
    """
    _PROPAGATOR.inject(headers, context=context, setter=_SETTER)
    return headers


def extract_context(headers: Iterable[tuple[str, bytes]] | None) -> Context:
    """The trace context carried by record headers (an empty context when there is none)."""
    return _PROPAGATOR.extract(list(headers or ()), getter=_GETTER)


def span_ids(span: trace.Span | None = None) -> tuple[str, str]:
    """(trace id, span id) of `span` (default: the current span) as hex; ("", "") if none."""
    ctx = (span or trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
