"""Tracing: one tracer provider per process, W3C context carried in Kafka record headers."""

from harnessrl.telemetry.propagation import extract_context, inject_headers, span_ids
from harnessrl.telemetry.tracing import create_tracer_provider

__all__ = ["create_tracer_provider", "extract_context", "inject_headers", "span_ids"]
