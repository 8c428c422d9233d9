"""Structured logs: JSON lines with the trace id, and secrets masked."""

from __future__ import annotations

import io
import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from harnessrl.config import LogSettings
from harnessrl.logs import configure_logging, get_logger


def test_json_lines_carry_fields_and_the_current_trace_id() -> None:
    stream = io.StringIO()
    configure_logging("reward", LogSettings(format="json"), stream)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        get_logger("harnessrl.test").info("scored", episode="e1", value=0.5)
    data = json.loads(stream.getvalue().strip())
    ctx = span.get_span_context()
    assert data["msg"] == "scored"
    assert data["service"] == "reward"
    assert data["level"] == "info"
    assert data["episode"] == "e1"
    assert data["value"] == 0.5
    assert data["trace_id"] == format(ctx.trace_id, "032x")
    assert data["span_id"] == format(ctx.span_id, "016x")


def test_secret_looking_fields_are_masked() -> None:
    stream = io.StringIO()
    configure_logging("gateway", LogSettings(format="json"), stream)
    log = get_logger("harnessrl.test")
    log.info(
        "request", authorization="Bearer sk-secret", api_key="k", admin_token="t", password="p"
    )
    line = stream.getvalue()
    for secret in ("sk-secret", '"k"', '"t"', '"p"'):
        assert secret not in line
    assert line.count("**********") == 4


def test_token_counts_are_not_taken_for_secrets() -> None:
    stream = io.StringIO()
    configure_logging("trainer", LogSettings(format="json"), stream)
    get_logger("harnessrl.test").info(
        "step", trained_tokens=7, prompt_tokens=3, classify_retokenization=True, token="t"
    )
    data = json.loads(stream.getvalue())
    assert (data["trained_tokens"], data["prompt_tokens"]) == (7, 3)
    assert data["classify_retokenization"] is True and data["token"] == "**********"


def test_text_format_is_one_readable_line() -> None:
    stream = io.StringIO()
    configure_logging("broker", LogSettings(format="text", level="DEBUG"), stream)
    get_logger("x").debug("ready", bootstrap="127.0.0.1:9092", note="two words")
    line = stream.getvalue().strip()
    assert " debug   broker ready bootstrap=127.0.0.1:9092 " in line
    assert 'note="two words"' in line
    logging.getLogger().handlers.clear()


def test_exceptions_include_the_traceback() -> None:
    stream = io.StringIO()
    configure_logging("x", LogSettings(format="json"), stream)
    try:
        raise ValueError("boom")
    except ValueError:
        get_logger("x").exception("failed", step=3)
    data = json.loads(stream.getvalue().strip())
    assert "ValueError: boom" in data["exc"]
    assert data["step"] == 3
