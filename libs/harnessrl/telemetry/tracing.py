"""The tracer provider of a service, with the exporter its settings choose."""

from __future__ import annotations

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

from harnessrl.config import TelemetrySettings


def create_tracer_provider(
    service: str, instance: str, settings: TelemetrySettings
) -> TracerProvider:
    """A provider whose resource names the service (`harnessrl-<service>`) and instance.

    With exporter "none" nothing is recorded, but spans still get valid ids, so trace
    context keeps flowing through HTTP and Kafka headers and into log lines. The caller owns
    the provider and calls `shutdown()` on it at exit (which flushes the exporter).
    """
    resource = Resource.create(
        {
            "service.name": f"harnessrl-{service}",
            "service.namespace": "harnessrl",
            "service.instance.id": instance,
        }
    )
    exporter = _exporter(settings)
    sampler = (
        ALWAYS_OFF if exporter is None else ParentBased(TraceIdRatioBased(settings.sample_ratio))
    )
    provider = TracerProvider(resource=resource, sampler=sampler)
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _exporter(settings: TelemetrySettings) -> SpanExporter | None:
    if settings.exporter == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        endpoint = settings.endpoint or "http://localhost:4317"
        return OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    if settings.exporter == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpSpanExporter,
        )

        return HttpSpanExporter(endpoint=settings.endpoint or "http://localhost:4318/v1/traces")
    if settings.exporter == "jsonl":
        from harnessrl.telemetry.jsonl import JsonLinesSpanExporter

        return JsonLinesSpanExporter(settings.jsonl_path)
    return None
