"""Structured logs: JSON lines with the trace id, and secrets masked."""

from __future__ import annotations

import io
import json
import logging
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider
from pydantic import SecretStr

from harnessrl.config import KafkaSettings, LogSettings, secret_values
from harnessrl.episode_token import EpisodeClaims, mint
from harnessrl.logs import configure_logging, get_logger
from harnessrl.runtime import serve
from harnessrl.services.gateway.config import GatewayConfig, GatewaySection


def _written(stream: io.StringIO) -> str:
    """What the service has written once its held lines are flushed."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    return stream.getvalue()


def test_lines_below_warning_are_written_in_batches_and_a_warning_at_once() -> None:
    stream = io.StringIO()
    configure_logging("gateway", LogSettings(format="json", batch_s=0.05), stream)
    log = get_logger("harnessrl.test")
    log.info("first")
    log.info("second")
    assert stream.getvalue() == ""  # held
    log.warning("third")
    assert [json.loads(x)["msg"] for x in stream.getvalue().splitlines()] == [
        "first", "second", "third",
    ]  # fmt: skip
    log.info("fourth")
    deadline = time.monotonic() + 5
    while "fourth" not in stream.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "fourth" in stream.getvalue()  # written by the flusher within its interval
    configure_logging("gateway", LogSettings(format="json", batch_s=0), stream)
    log.info("fifth")
    assert "fifth" in stream.getvalue()  # batch_s 0: every line at once
    logging.getLogger().handlers.clear()


def test_json_lines_carry_fields_and_the_current_trace_id() -> None:
    stream = io.StringIO()
    configure_logging("reward", LogSettings(format="json"), stream)
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("work") as span:
        get_logger("harnessrl.test").info("scored", episode="e1", value=0.5)
    data = json.loads(_written(stream).strip())
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
    line = _written(stream)
    for secret in ("sk-secret", '"k"', '"t"', '"p"'):
        assert secret not in line
    assert line.count("**********") == 4


def test_token_counts_are_not_taken_for_secrets() -> None:
    stream = io.StringIO()
    configure_logging("trainer", LogSettings(format="json"), stream)
    get_logger("harnessrl.test").info(
        "step", trained_tokens=7, prompt_tokens=3, classify_retokenization=True, token="t"
    )
    data = json.loads(_written(stream))
    assert (data["trained_tokens"], data["prompt_tokens"]) == (7, 3)
    assert data["classify_retokenization"] is True and data["token"] == "**********"


def test_text_format_is_one_readable_line() -> None:
    stream = io.StringIO()
    configure_logging("broker", LogSettings(format="text", level="DEBUG"), stream)
    get_logger("x").debug("ready", bootstrap="127.0.0.1:9092", note="two words")
    line = _written(stream).strip()
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
    data = json.loads(_written(stream).strip())
    assert "ValueError: boom" in data["exc"]
    assert data["step"] == 3


TOKEN = mint(EpisodeClaims("ep-1", 1, "g-1", "train", time.time() + 600), b"k" * 32)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_episode_tokens_are_masked_in_fields_messages_and_tracebacks(fmt: str) -> None:
    stream = io.StringIO()
    configure_logging("gateway", LogSettings(format=fmt), stream)
    log = get_logger("harnessrl.test")
    log.info("request refused", path=f"/e/{TOKEN}/v1/chat/completions", status=413)
    log.info(f"calling {TOKEN}", urls=[f"http://gw/e/{TOKEN}/v1"], nested={"k": [TOKEN]})
    try:
        raise RuntimeError(f"could not use {TOKEN}")
    except RuntimeError:
        log.exception("failed")
    text = _written(stream)
    logging.getLogger().handlers.clear()
    assert TOKEN not in text and TOKEN.split(".")[1] not in text
    assert "/e/**********/v1/chat/completions" in text
    assert text.count("**********") == 5  # path, message, list, nested dict, exception


def test_registered_secret_values_are_masked_wherever_they_appear() -> None:
    stream = io.StringIO()
    secrets = ["admin-token-0123456789", 'quote"and\\slash-secret', "short"]
    configure_logging("controller", LogSettings(format="json"), stream, secrets=secrets)
    log = get_logger("harnessrl.test")
    log.warning("closing failed", error=f"HTTP 401 for Bearer {secrets[0]}")
    log.info(secrets[1], detail={"header": secrets[1]})
    log.info("a short word", word="short")
    lines = [json.loads(line) for line in _written(stream).splitlines()]
    logging.getLogger().handlers.clear()
    assert lines[0]["error"] == "HTTP 401 for Bearer **********"
    assert lines[1]["msg"] == "**********" and lines[1]["detail"] == {"header": "**********"}
    assert lines[2]["word"] == "short"  # under 8 characters: not masked by value


def test_secret_values_are_every_secret_of_a_config() -> None:
    config = GatewayConfig(
        kafka=KafkaSettings(sasl_password=SecretStr("kafka-password")),
        gateway=GatewaySection(
            token_secret=SecretStr("token-secret-0123456789abcdef0123"),
            previous_token_secrets=[SecretStr("old-secret-0123456789abcdef012345")],
            admin_token=SecretStr("admin-token-0123456789abcdef01234"),
        ),
    )
    assert sorted(secret_values(config)) == [
        "admin-token-0123456789abcdef01234",
        "kafka-password",
        "old-secret-0123456789abcdef012345",
        "token-secret-0123456789abcdef0123",
    ]


class _Chatty:
    """A service that logs its config's secrets, and an episode token, then stops."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config

    async def run(self) -> None:
        section = self._config.gateway
        assert section.token_secret is not None and section.admin_token is not None
        get_logger("harnessrl.test").error(
            "oops",
            detail=f"{section.token_secret.get_secret_value()} "
            f"{section.admin_token.get_secret_value()} {TOKEN}",
        )

    async def stop(self) -> None:
        return None

    def health(self) -> dict[str, bool]:
        return {}


def test_a_served_process_masks_the_secrets_of_its_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = GatewayConfig(
        gateway=GatewaySection(
            port=0,
            token_secret=SecretStr("token-secret-0123456789abcdef0123"),
            admin_token=SecretStr("admin-token-0123456789abcdef01234"),
        )
    )
    assert serve("gateway", config, config.gateway, lambda _: _Chatty(config)) == 0
    logging.getLogger().handlers.clear()
    err = capsys.readouterr().err
    (line,) = [json.loads(x) for x in err.splitlines() if '"oops"' in x]
    assert line["detail"] == "********** ********** **********"
