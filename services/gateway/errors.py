"""Errors the gateway answers, and the two shapes they are written in.

Every refusal inside the gateway is a `GatewayError` (status, message, the field at fault);
the route that was asked decides its shape: OpenAI's error object for the OpenAI routes,
Anthropic's for `/v1/messages...` and for Anthropic-flavoured requests elsewhere. An
engine's own error answer is put in the same shape (vLLM's older flat one included), so a
harness never sees an error body its SDK cannot parse.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from harnessrl.http import Response

JSON = [("content-type", "application/json")]

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
CONTEXT_LENGTH = "maximum context length"
PROMPT_TOO_LONG = "prompt is too long: "
"""Anthropic's words for a prompt over the context, which harnesses such as Claude Code
look for before compacting their context."""


class GatewayError(Exception):
    """A request the gateway refuses: HTTP `status`, a message that names the field at
    fault, that field (`param`, for APIs that also give it apart), extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        headers: list[tuple[str, str]] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.headers = headers or []
        self.code = code


def invalid(param: str, reason: str) -> GatewayError:
    """A 400 for the field `param` (its path in the body, dotted: `input.2.content`)."""
    return GatewayError(400, f"{param}: {reason}", param)


class ErrorShape(Protocol):
    """How one API writes its errors."""

    def body(self, status: int, message: str, param: str | None, code: str | None) -> Any:
        """The JSON body of an error answer (also a streamed error event's data)."""

    def engine(self, status: int, body: object) -> tuple[int, Any]:
        """(status, body) for an engine's error answer, parsed (or not JSON: None)."""


class OpenAIShape:
    """`{"error": {"message", "type", "param", "code"}}`."""

    def body(self, status: int, message: str, param: str | None, code: str | None) -> Any:
        kind = _OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}

    def engine(self, status: int, body: object) -> tuple[int, Any]:
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return status, body
        if isinstance(body, dict) and body.get("object") == "error":  # vLLM's flat shape
            keys = ("message", "type", "param", "code")
            return status, {"error": {k: body.get(k) for k in keys}}
        return status, self.body(status, engine_message(status, body), None, None)


class AnthropicShape:
    """`{"type": "error", "error": {"type", "message"}}`; the field is in the message."""

    def body(self, status: int, message: str, param: str | None, code: str | None) -> Any:
        kind = _ANTHROPIC_TYPES.get(
            status, "invalid_request_error" if status < 500 else "api_error"
        )
        return {"type": "error", "error": {"type": kind, "message": message}}

    def engine(self, status: int, body: object) -> tuple[int, Any]:
        message = engine_message(status, body)
        if CONTEXT_LENGTH in message and not message.startswith(PROMPT_TOO_LONG):
            message = PROMPT_TOO_LONG + message
        return status, self.body(status, message, None, None)


OPENAI = OpenAIShape()
ANTHROPIC = AnthropicShape()


def render(shape: ErrorShape, err: GatewayError) -> Response:
    """The HTTP answer for `err` in `shape`."""
    return respond(err.status, shape.body(err.status, str(err), err.param, err.code), err.headers)


def render_engine(shape: ErrorShape, status: int, raw: bytes) -> Response:
    """The HTTP answer for an engine's error answer (`raw`: its body)."""
    try:
        parsed: object = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = None if not raw else raw.decode("utf-8", "replace")[:500]
    code, body = shape.engine(status, parsed)
    return respond(code, body)


def respond(status: int, data: Any, headers: list[tuple[str, str]] | None = None) -> Response:
    """A JSON answer."""
    return Response(status, [*JSON, *(headers or [])], orjson.dumps(data))


def engine_message(status: int, body: object) -> str:
    """The message of an engine's error body, whatever its shape."""
    if isinstance(body, str) and body:
        return body
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, str):
            return error
        if isinstance(error, dict):
            for key in ("message", "detail"):
                if isinstance(error.get(key), str):
                    return str(error[key])
    return f"the engine answered HTTP {status}"
