"""`POST /v1/messages`: Anthropic's Messages API, served through the engine's chat completions.

vLLM serves `/v1/messages` but returns no token ids there, so the gateway translates: the
request becomes a chat completion (anthropic_request.py), is forwarded and captured exactly
like an OpenAI chat call (the same exact ids), and the answer is translated back
(anthropic_response.py), streamed as Anthropic's event sequence when asked. Server tools
(web search, code execution: run by Anthropic's API, not by any engine) are left out, as
OpenAI's hosted tools are (gateway.unserved_tools).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harnessrl.episode_token import EpisodeClaims
from harnessrl.services.gateway.dialects.anthropic_request import messages_to_chat
from harnessrl.services.gateway.dialects.anthropic_response import (
    MessageStream,
    chat_to_message,
    encode_sse,
    message_id,
)
from harnessrl.services.gateway.dialects.base import EngineCall
from harnessrl.services.gateway.errors import ANTHROPIC, ErrorShape
from harnessrl.trust.contract import CHAT_PATH
from harnessrl.v1 import events_pb2 as pb


class MessagesDialect:
    kind: str = "messages"
    api: int = pb.API_ANTHROPIC_MESSAGES
    errors: ErrorShape = ANTHROPIC

    def __init__(
        self, *, drop_unserved: bool = True, on_dropped: Callable[[str], None] = lambda k: None
    ) -> None:
        self._drop = drop_unserved
        self._on_dropped = on_dropped

    def translate(self, body: dict[str, Any], claims: EpisodeClaims) -> EngineCall:
        tools = body.get("tools")
        if self._drop and isinstance(tools, list):
            served = [t for t in tools if not _server_tool(t)]
            if len(served) != len(tools):
                for tool in tools:
                    if _server_tool(tool):
                        self._on_dropped(str(tool["type"]))
                body = {**body, "tools": served}
        chat = messages_to_chat(body)
        return EngineCall(
            CHAT_PATH, chat.body, chat.stream, chat.model, _Message(chat.model), "max_tokens"
        )


def _server_tool(tool: object) -> bool:
    """An Anthropic server tool (web search, code execution, ...), run by Anthropic's API:
    its `type` is set and not `custom`."""
    return isinstance(tool, dict) and isinstance(tool.get("type"), str) and tool["type"] != "custom"


class _Message:
    def __init__(self, model: str) -> None:
        self._model = model

    def body(self, data: dict[str, Any]) -> Any:
        return chat_to_message(data, model=self._model)

    def stream(self) -> _Events:
        return _Events(MessageStream(model=self._model))

    def response_id(self, engine_id: str) -> str:
        return message_id(engine_id)


class _Events:
    """Anthropic's SSE events for one engine stream."""

    __slots__ = ("_stream",)

    def __init__(self, stream: MessageStream) -> None:
        self._stream = stream

    def feed(self, chunk: dict[str, Any]) -> bytes:
        return b"".join(encode_sse(event, data) for event, data in self._stream.feed(chunk))

    def fail(self, error: dict[str, Any]) -> bytes:
        return self.feed(error)  # MessageStream turns an error chunk into its error event

    def finish(self) -> bytes:
        return b"".join(encode_sse(event, data) for event, data in self._stream.finish())
