"""Structured logging: one line per event, key=value fields, the current trace id included.

    log = get_logger(__name__)
    log.info("consumer started", topics=["hrl.calls"], group="harnessrl.sample-builder")

writes (format "json")

    {"ts": "...", "level": "info", "service": "sample-builder", "logger": "...",
     "msg": "consumer started", "topics": ["hrl.calls"], ..., "trace_id": "...", "span_id": "..."}

Fields whose name looks like a secret (password, token, secret, api key, authorization) are
masked whatever their value, so a careless call cannot leak one. Whatever the field, the
message or the traceback, anything shaped like an episode token (a base64url JSON payload, a
dot, a MAC: JWTs too) is masked, and so is every secret value the process registered
(`configure_logging(..., secrets=...)`: the SecretStr values of its config), so a token in a
request path or a secret in an exception's text never reaches a log line.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import weakref
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import IO, Any

import orjson
from opentelemetry import trace

from harnessrl.config import LogSettings

# "token" only as a whole word of the key (admin_token, token_secret, token): counts such
# as prompt_tokens or trained_tokens and words like retokenization are not secrets.
_SECRET_NAME = re.compile(
    r"password|passwd|secret|api_?key|authorization|(?:^|_)token(?:$|_)", re.I
)
_MASK = "**********"
_FIELDS = "hrl_fields"
# `<base64url of '{"...'>.<base64url MAC>`: episode tokens (harnessrl.episode_token), JWTs.
_TOKEN_SHAPE = r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{16,}(?:\.[A-Za-z0-9_-]+)?"
_MIN_SECRET = 8  # shorter registered values would mask ordinary words; they are not masked


class Redactor:
    """Masks episode tokens and the given secret values in text (as written, or as JSON
    escapes them inside a string)."""

    __slots__ = ("_needles", "_pattern")

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = {s for s in secrets if len(s) >= _MIN_SECRET}
        values |= {orjson.dumps(s).decode()[1:-1] for s in values}
        alternatives = [re.escape(v) for v in sorted(values, key=len, reverse=True)]
        self._pattern = re.compile("|".join([_TOKEN_SHAPE, *alternatives]))
        # What every match contains: a line with none of them is returned as it is, without
        # running the pattern (substring search is a fraction of the regular expression's
        # cost, and almost no line holds a secret).
        self._needles = ("eyJ", *sorted(values))

    def __call__(self, text: str) -> str:
        if not any(needle in text for needle in self._needles):
            return text
        return self._pattern.sub(_MASK, text)


_secret_names: dict[str, bool] = {}


def _is_secret_name(key: str) -> bool:
    """Whether a field's name looks like a secret's (remembered: field names repeat)."""
    known = _secret_names.get(key)
    if known is None:
        known = bool(_SECRET_NAME.search(key))
        if len(_secret_names) < 10_000:  # names come from code, but bound it anyway
            _secret_names[key] = known
    return known


class Log:
    """A named logger whose methods take the message and key=value fields."""

    __slots__ = ("_logger",)

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger

    def debug(self, msg: str, **fields: Any) -> None:
        self._log(logging.DEBUG, msg, fields)

    def info(self, msg: str, **fields: Any) -> None:
        self._log(logging.INFO, msg, fields)

    def warning(self, msg: str, **fields: Any) -> None:
        self._log(logging.WARNING, msg, fields)

    def error(self, msg: str, **fields: Any) -> None:
        self._log(logging.ERROR, msg, fields)

    def exception(self, msg: str, **fields: Any) -> None:
        """Log at ERROR with the traceback of the exception being handled."""
        if self._logger.isEnabledFor(logging.ERROR):
            self._logger.error(msg, exc_info=True, extra={_FIELDS: fields}, stacklevel=2)

    def _log(self, level: int, msg: str, fields: dict[str, Any]) -> None:
        if self._logger.isEnabledFor(level):
            self._logger.log(level, msg, extra={_FIELDS: fields}, stacklevel=3)


def get_logger(name: str) -> Log:
    return Log(logging.getLogger(name))


def _record_data(record: logging.LogRecord, service: str) -> dict[str, Any]:
    data: dict[str, Any] = {
        "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
        "level": record.levelname.lower(),
        "service": service,
        "logger": record.name,
        "msg": record.getMessage(),
    }
    for key, value in getattr(record, _FIELDS, {}).items():
        data[key] = _MASK if _is_secret_name(key) else value
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        data["trace_id"] = format(ctx.trace_id, "032x")
        data["span_id"] = format(ctx.span_id, "016x")
    return data


class JsonFormatter(logging.Formatter):
    """One JSON object per line, redacted (see the module docstring)."""

    def __init__(self, service: str, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._service = service
        self._redact = Redactor(secrets)

    def format(self, record: logging.LogRecord) -> str:
        data = _record_data(record, self._service)
        if record.exc_info:
            data["exc"] = self.formatException(record.exc_info)
        return self._redact(orjson.dumps(data, default=str).decode())


class TextFormatter(logging.Formatter):
    """`time level service message key=value ...` for people reading a terminal, redacted."""

    def __init__(self, service: str, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self._service = service
        self._redact = Redactor(secrets)

    def format(self, record: logging.LogRecord) -> str:
        data = _record_data(record, self._service)
        head = f"{data.pop('ts')[11:23]} {data.pop('level'):<7} {data.pop('service')}"
        data.pop("logger")
        msg = data.pop("msg")
        fields = " ".join(f"{k}={_text(v)}" for k, v in data.items())
        line = f"{head} {msg}" + (f" {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return self._redact(line)


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    return f'"{text}"' if " " in text else text


class BatchingHandler(logging.StreamHandler[IO[str]]):
    """Writes lines below WARNING in batches: held at most `interval_s` (or until 64 KiB
    are waiting), so a busy service makes a few writes a second instead of one per line. A
    warning or an error is written at once, after the lines before it; a fork, `flush()`
    and the interpreter's exit write what is held. What a SIGKILL loses is at most
    `interval_s` of lines below WARNING."""

    def __init__(self, stream: IO[str], interval_s: float) -> None:
        super().__init__(stream)
        self.interval_s = interval_s
        self._held: list[str] = []
        self._held_chars = 0
        _BATCHING.add(self)
        self._start()

    def emit(self, record: logging.LogRecord) -> None:  # called with self.lock held
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._held.append(line)
        self._held_chars += len(line)
        if record.levelno >= logging.WARNING or self._held_chars >= _BATCH_CHARS:
            self._write()

    def flush(self) -> None:
        self.acquire()
        try:
            self._write()
        finally:
            self.release()

    def _write(self) -> None:
        if not self._held:
            return
        text, self._held, self._held_chars = "".join(self._held), [], 0
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream: nowhere to write; the service goes on

    def _start(self) -> None:
        ref = weakref.ref(self)

        def flusher() -> None:
            while (handler := ref()) is not None:
                interval = handler.interval_s
                del handler
                threading.Event().wait(interval)
                if (handler := ref()) is not None:
                    handler.flush()
                del handler

        threading.Thread(target=flusher, name="log-flush", daemon=True).start()

    def _after_fork_in_child(self) -> None:
        self._held, self._held_chars = [], 0  # the parent writes those
        self._start()


_BATCH_CHARS = 64 * 1024
_BATCHING: weakref.WeakSet[BatchingHandler] = weakref.WeakSet()


def _before_fork() -> None:
    for handler in list(_BATCHING):
        handler.flush()


def _after_fork_in_child() -> None:
    for handler in list(_BATCHING):
        handler._after_fork_in_child()


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def configure_logging(
    service: str,
    settings: LogSettings,
    stream: IO[str] | None = None,
    secrets: Iterable[str] = (),
) -> None:
    """Route all logging (ours and libraries') through one handler in the chosen format,
    masking `secrets` (values of at least 8 characters) wherever they appear.

    Called once by a process entry point; replaces handlers installed earlier.
    """
    # What a record costs besides our formatting: no caller lookup (a walk up the stack for
    # a file name and line number no line shows), no thread, process or task names (logging's
    # documented switches; lines carry the service, logger and trace ids instead).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    handler: logging.StreamHandler[IO[str]] = (
        BatchingHandler(stream or sys.stderr, settings.batch_s)
        if settings.batch_s > 0
        else logging.StreamHandler(stream or sys.stderr)
    )
    kind = JsonFormatter if settings.format == "json" else TextFormatter
    formatter = kind(service, secrets)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in root.handlers:
        if isinstance(old, BatchingHandler):
            old.flush()
    root.handlers[:] = [handler]
    root.setLevel(settings.level)
    # aiokafka's INFO lines (every join, every fetch reset) drown the service's own.
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, root.level))
    # httpx logs every request at INFO: vllm-sync's periodic version checks would fill the log.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
