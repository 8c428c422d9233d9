"""OTLP-JSON-lines files: one OTLP/JSON `ExportTraceServiceRequest` per line.

This is the file format of the OpenTelemetry Collector's file exporter (ids as hex, enums
as integers), so the files can be replayed into any OTLP backend. The embedded default
writes spans here, and `read_spans` reads them back for `harnessrl trace`.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson
from google.protobuf import json_format
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def request_to_json(request: ExportTraceServiceRequest) -> bytes:
    """OTLP/JSON encoding of a request: camelCase keys, hex ids, integer enums."""
    data = json_format.MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in data.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _hex_ids(span)
                for link in span.get("links", ()):
                    _hex_ids(link)
    return orjson.dumps(data)


def _hex_ids(obj: dict[str, Any]) -> None:
    for key in _ID_KEYS:
        if key in obj:
            obj[key] = base64.b64decode(obj[key]).hex()


class JsonLinesWriter:
    """Appends requests to a file, one line each; safe across threads and processes.

    Each line is written with one `write` on an O_APPEND descriptor, so lines from several
    processes sharing the file never interleave.
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def write(self, request: ExportTraceServiceRequest) -> None:
        line = request_to_json(request) + b"\n"
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class JsonLinesSpanExporter(SpanExporter):
    """Span exporter that appends OTLP-JSON lines to a local file."""

    def __init__(self, path: Path) -> None:
        self._writer = JsonLinesWriter(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self._writer.write(encode_spans(spans))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self._writer.close()


def read_spans(path: Path) -> Iterator[dict[str, Any]]:
    """Every span in an OTLP-JSON-lines file, each with its resource's `service.name` added
    as the key "service". Lines that are not valid JSON (a torn last line) are skipped."""
    with path.open("rb") as f:
        for line in f:
            try:
                data = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            for resource_spans in data.get("resourceSpans", ()):
                service = _service_name(resource_spans.get("resource", {}))
                for scope_spans in resource_spans.get("scopeSpans", ()):
                    for span in scope_spans.get("spans", ()):
                        yield {**span, "service": service}


def _service_name(resource: dict[str, Any]) -> str:
    for attr in resource.get("attributes", ()):
        if attr.get("key") == "service.name":
            return str(attr.get("value", {}).get("stringValue", ""))
    return ""
