"""OpenAI's chat and completions answers, as the engine gave them, made the API's again.

The engine already speaks these two formats (vLLM's dialect of them), so the harness's
request goes to it nearly as sent, and its answer comes back with vLLM's extra fields
removed unless the harness asked for them (`return_token_ids`, `logprobs`) and the model
name the harness asked for restored. An engine error event is passed on in OpenAI's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from harnessrl.services.gateway.errors import OPENAI, invalid

MODEL_CHARS = 256
"""Longest model name accepted (it is recorded in every ModelCall of the call)."""
_EXTRA_TOP = ("prompt_token_ids", "prompt_logprobs", "kv_transfer_params")
DONE = b"data: [DONE]\n\n"


def check_model(value: object, param: str = "model") -> str:
    """The model name a request gives; GatewayError unless a string of at most 256."""
    if not isinstance(value, str):
        raise invalid(param, "required, a string")
    if len(value) > MODEL_CHARS:
        raise invalid(param, f"longer than {MODEL_CHARS} characters")
    return value


def check_flags(body: dict[str, Any], *names: str) -> None:
    """Fields the gateway reads itself must be booleans when given: the engine's own parser
    is lenient (`"stream": "yes"` streams), and the gateway must read them as it does."""
    for name in names:
        if not isinstance(body.get(name, False), bool):
            raise invalid(name, "must be a boolean")


@dataclass(frozen=True, slots=True)
class Passthrough:
    """Renders an engine answer for a harness that asked in the same format."""

    model: str
    token_ids: bool
    """The harness asked for vLLM's token ids itself."""
    logprobs: bool
    """The harness asked for log-probs itself."""

    def body(self, data: dict[str, Any]) -> Any:
        return self.harness(data)

    def stream(self) -> PassthroughStream:
        return PassthroughStream(self)

    def response_id(self, engine_id: str) -> str:
        return engine_id

    def harness(self, data: dict[str, Any]) -> dict[str, Any]:
        """`data` (an answer or a chunk) as the API would give it: modified in place."""
        data["model"] = self.model or data.get("model")
        if not self.token_ids:
            for name in _EXTRA_TOP:
                data.pop(name, None)
        for choice in data.get("choices") or ():
            choice.pop("stop_reason", None)
            if not self.token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            if not self.logprobs and "logprobs" in choice:
                choice["logprobs"] = None
        return data


class PassthroughStream:
    """Each engine chunk as one `data:` event; `[DONE]` at the end, also after an error."""

    __slots__ = ("_render",)

    def __init__(self, render: Passthrough) -> None:
        self._render = render

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return b"data: %b\n\n" % orjson.dumps(self._render.harness(chunk))

    def fail(self, error: dict[str, Any]) -> bytes:
        _, body = OPENAI.engine(500, error)
        return b"data: " + orjson.dumps(body) + b"\n\n" + DONE

    def finish(self) -> bytes:
        return DONE
