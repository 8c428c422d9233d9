"""Traces exported for real: OTLP over gRPC to a receiver, and OTLP-JSON-lines files."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from opentelemetry import trace

from harnessrl import events
from harnessrl.bus import Consumer, Context, Producer, Record
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings, TelemetrySettings
from harnessrl.telemetry import create_tracer_provider
from harnessrl.telemetry.jsonl import read_spans
from harnessrl.telemetry.receiver import OtlpReceiver
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import eventually

pytestmark = pytest.mark.integration


async def test_a_trace_crosses_kafka_between_services_and_reaches_the_otlp_receiver(
    kafka: KafkaSettings,
    producer_settings: ProducerSettings,
    consumer_settings: ConsumerSettings,
    tmp_path: Path,
) -> None:
    receiver = OtlpReceiver(tmp_path / "spans.jsonl", port=0)
    await receiver.start()
    otlp = TelemetrySettings(exporter="otlp-grpc", endpoint=receiver.endpoint)
    gateway = create_tracer_provider("gateway", "gw-0", otlp)
    builder = create_tracer_provider("sample-builder", "sb-0", otlp)
    handled = asyncio.Event()

    async def handle(record: Record, ctx: Context) -> None:
        handled.set()

    producer = Producer(kafka, producer_settings, name="gateway/gw-0")
    await producer.start()
    consumer = Consumer(
        kafka,
        consumer_settings,
        topics=[events.CALLS],
        group_id="sb",
        handler=handle,
        producer=producer,
        tracer=builder.get_tracer("bus"),
    )
    task = asyncio.create_task(consumer.run())
    try:
        await eventually(lambda: bool(consumer.assigned))
        with gateway.get_tracer("gateway").start_as_current_span("POST /v1/chat/completions"):
            call_ctx = trace.get_current_span().get_span_context()
            await producer.publish(pb.ModelCall(episode_id="e", attempt=1, group_id="g", seq=0))
        await asyncio.wait_for(handled.wait(), 30)
    finally:
        await consumer.stop()
        await task
        await producer.stop()
    # The exporters are synchronous gRPC clients; flush them off the loop the receiver runs on.
    await asyncio.to_thread(gateway.shutdown)
    await asyncio.to_thread(builder.shutdown)
    await receiver.stop()

    spans = {s["name"]: s for s in read_spans(tmp_path / "spans.jsonl")}
    call, process = spans["POST /v1/chat/completions"], spans["hrl.calls process"]
    assert call["service"] == "harnessrl-gateway"
    assert process["service"] == "harnessrl-sample-builder"
    assert call["traceId"] == format(call_ctx.trace_id, "032x")
    assert process["traceId"] == call["traceId"]
    assert process["parentSpanId"] == call["spanId"]
    assert process["kind"] == 5  # SPAN_KIND_CONSUMER, as OTLP/JSON writes enums


def test_jsonl_exporter_writes_otlp_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    provider = create_tracer_provider(
        "trainer", "t-0", TelemetrySettings(exporter="jsonl", jsonl_path=path)
    )
    tracer = provider.get_tracer("trainer")
    with tracer.start_as_current_span("group") as group:
        pass
    link = trace.Link(group.get_span_context())
    with tracer.start_as_current_span("step", links=[link]) as step:
        step.set_attribute("harnessrl.step", 7)
    provider.shutdown()
    spans = {s["name"]: s for s in read_spans(path)}
    assert spans["step"]["links"][0]["spanId"] == format(group.get_span_context().span_id, "016x")
    assert spans["step"]["links"][0]["traceId"] == spans["group"]["traceId"]
    assert spans["step"]["service"] == "harnessrl-trainer"
    assert {"key": "harnessrl.step", "value": {"intValue": "7"}} in spans["step"]["attributes"]


def test_exporter_none_records_nothing_but_keeps_trace_ids() -> None:
    provider = create_tracer_provider("x", "x-0", TelemetrySettings(exporter="none"))
    with provider.get_tracer("x").start_as_current_span("s") as span:
        assert not span.is_recording()
        assert span.get_span_context().is_valid
