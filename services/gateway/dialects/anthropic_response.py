"""The engine's chat-completions answers as Anthropic's: a whole `Message`, a stream of
Messages events, or an error.

Pure translation of parsed JSON: no I/O, no clock, no randomness (ids derive from the
engine's). vLLM's extra fields (`prompt_token_ids`, `token_ids`, `logprobs`) are read for
usage only and never passed on. Only the first choice is translated: a Messages request asks
for one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from harnessrl.services.gateway.errors import ANTHROPIC

RAW_ARGUMENTS_KEY = "_raw_arguments"
"""The `tool_use` input key holding tool-call arguments that are not a JSON object."""

StreamEvent = tuple[str, dict[str, Any]]
"""(SSE event name, data): one Anthropic stream event."""

_STOP_REASONS = {"length": "max_tokens", "content_filter": "refusal"}


def chat_to_message(chat: dict[str, Any], *, model: str) -> dict[str, Any]:
    """The Anthropic `Message` for an engine's chat completion (its first choice).

    `model` is the name the harness asked for. Content is a text block when the engine
    produced text, then one `tool_use` block per tool call, its `input` parsed from the
    arguments JSON; arguments that are not a JSON object are kept as text under
    `RAW_ARGUMENTS_KEY`, so the harness sees the call and can answer it with an error.
    Usage comes from `usage`, else from the token ids. Raises ValueError when `chat` has
    no choice.
    """
    choices = chat.get("choices") or []
    if not choices:
        raise ValueError("the chat completion has no choices")
    choice = choices[0]
    reply = choice.get("message") or {}
    msg_id = _message_id(chat)
    content: list[dict[str, Any]] = []
    if reply.get("content"):
        content.append({"type": "text", "text": reply["content"]})
    calls = reply.get("tool_calls") or []
    for index, call in enumerate(calls):
        function = call.get("function") or {}
        block = _tool_use(call.get("id"), function.get("name"), msg_id, index)
        content.append({**block, "input": tool_input(function.get("arguments"))})
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("stop_reason"), calls)
    usage = chat.get("usage") or {}
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(
            usage.get("prompt_tokens", len(chat.get("prompt_token_ids") or ())),
            usage.get("completion_tokens", len(choice.get("token_ids") or ())),
        ),
    }


def tool_input(arguments: object) -> dict[str, Any]:
    """The `tool_use` input for OpenAI tool-call arguments (JSON text): the object they
    encode, `{}` when empty, else `{RAW_ARGUMENTS_KEY: arguments}`."""
    if isinstance(arguments, dict):
        return arguments
    text = "" if arguments is None else str(arguments)
    if not text.strip():
        return {}
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        value = None
    return value if isinstance(value, dict) else {RAW_ARGUMENTS_KEY: text}


def stop_reason(finish: object, matched: object, tool_calls: object) -> tuple[str, str | None]:
    """(Anthropic stop_reason, stop_sequence) for an OpenAI finish reason.

    `matched` is vLLM's `stop_reason`: the stop string that ended the output (an int when a
    stop token did). `length` is `max_tokens` even mid tool call, as in Anthropic's API; any
    tool call otherwise makes it `tool_use` (vLLM finishes a forced call with `stop`);
    `content_filter` is `refusal`; everything else ends the turn.
    """
    if finish in _STOP_REASONS:
        return _STOP_REASONS[str(finish)], None
    if tool_calls or finish == "tool_calls":
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def chat_error_to_anthropic(status: int, body: object) -> tuple[int, dict[str, Any]]:
    """(status, Anthropic error body) for an engine's error answer (parsed): the status is
    kept, the type follows it; a context-length error reads "prompt is too long: ...",
    Anthropic's words, which harnesses such as Claude Code look for before compacting."""
    code, data = ANTHROPIC.engine(status, body)
    return code, data


def encode_sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event: `event: <name>\\ndata: <json>\\n\\n`."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


@dataclass(slots=True)
class _ToolCall:
    index: int  # OpenAI's tool-call index
    arguments: list[str] = field(default_factory=list)


class MessageStream:
    """Anthropic's stream events for one engine chat-completion stream.

    Feed every parsed chunk in order (`feed`), then call `finish` once the engine's stream
    has ended (`data: [DONE]`). Together they yield Anthropic's sequence: `message_start`;
    for each content block `content_block_start`, `content_block_delta`*,
    `content_block_stop`; then `message_delta` (stop reason, usage) and `message_stop`.

    Text is passed on as it arrives (`text_delta`). A tool call's block starts when the call
    does, but its arguments are held until the call is complete and then sent as one
    `input_json_delta`: the SDK parses partial JSON as it arrives and raises on malformed
    arguments, which a policy in training does produce; held back, they reach the harness
    as `RAW_ARGUMENTS_KEY` input, as in a whole message.

    Output tokens are counted from the chunks' `token_ids` when present, else taken from
    the usage chunk; input tokens from the first chunk's `prompt_token_ids`, else the usage
    chunk. An engine error chunk, or a stream that ends before a finish reason, gives one
    `error` event instead of the rest; the stream is then over. `finish` is idempotent;
    `feed` after the end raises ValueError, as does a chunk for a choice other than 0 or a
    tool call that resumes after another began.
    """

    def __init__(self, *, model: str) -> None:
        self._model = model
        self._started = False
        self._over = False
        self._blocks = 0  # content blocks started
        self._text_open = False
        self._tool: _ToolCall | None = None
        self._tools_seen: set[int] = set()
        self._finish: tuple[object, object] | None = None
        self._output_ids: int | None = None
        self._input_tokens: int | None = None
        self._usage: dict[str, Any] = {}
        self._msg_id = ""

    def feed(self, chunk: dict[str, Any]) -> list[StreamEvent]:
        """The events one engine chunk produces (possibly none)."""
        if self._over:
            raise ValueError("the message stream is over; no chunk can follow")
        if "error" in chunk or chunk.get("object") == "error":
            return self._error(_engine_status(chunk), chunk)
        events: list[StreamEvent] = []
        if not self._started:
            events.append(self._start(chunk))
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                raise ValueError(f"choice {choice.get('index')}: a message has one choice")
            if (ids := choice.get("token_ids")) is not None:
                self._output_ids = (self._output_ids or 0) + len(ids)
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                events += self._tool_call(call)
            if choice.get("finish_reason") is not None:
                events += self._close_block()
                self._finish = (choice["finish_reason"], choice.get("stop_reason"))
        return events

    def finish(self) -> list[StreamEvent]:
        """The closing events, once the engine's stream has ended; [] when already over."""
        if self._over:
            return []
        if self._finish is None:
            message = "the engine's stream ended before the message was complete"
            return self._error(502, {"error": {"message": message}})
        self._over = True
        reason, sequence = stop_reason(*self._finish, self._tools_seen)
        output = self._output_ids
        if output is None:
            output = int(self._usage.get("completion_tokens", 0))
        usage: dict[str, Any] = {"output_tokens": output}
        if (prompt := self._input_tokens or self._usage.get("prompt_tokens")) is not None:
            usage["input_tokens"] = prompt
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        return [
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def _start(self, chunk: dict[str, Any]) -> StreamEvent:
        self._started = True
        self._msg_id = _message_id(chunk)
        if (prompt := chunk.get("prompt_token_ids")) is not None:
            self._input_tokens = len(prompt)
        message: dict[str, Any] = {
            "id": self._msg_id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self._input_tokens or 0, 0),
        }
        return "message_start", {"type": "message_start", "message": message}

    def _text(self, text: str) -> list[StreamEvent]:
        events = []
        if not self._text_open:
            events = self._close_block()
            events.append(self._block_start({"type": "text", "text": ""}))
            self._text_open = True
        delta = {"type": "text_delta", "text": text}
        events.append(("content_block_delta", self._block_event("content_block_delta", delta)))
        return events

    def _tool_call(self, call: dict[str, Any]) -> list[StreamEvent]:
        index = int(call.get("index", 0))
        function = call.get("function") or {}
        events: list[StreamEvent] = []
        if self._tool is None or self._tool.index != index:
            if index in self._tools_seen:
                raise ValueError(f"tool call {index} resumed after another tool call began")
            if not function.get("name"):
                raise ValueError(f"tool call {index} starts without a function name")
            events = self._close_block()
            block = _tool_use(call.get("id"), function["name"], self._msg_id, index)
            events.append(self._block_start({**block, "input": {}}))
            self._tool = _ToolCall(index)
            self._tools_seen.add(index)
        if function.get("arguments"):
            self._tool.arguments.append(function["arguments"])
        return events

    def _close_block(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self._tool is not None:
            arguments = "".join(self._tool.arguments)
            value = tool_input(arguments)
            if value:
                text = arguments if RAW_ARGUMENTS_KEY not in value else orjson.dumps(value).decode()
                delta = {"type": "input_json_delta", "partial_json": text}
                events.append(
                    ("content_block_delta", self._block_event("content_block_delta", delta))
                )
            self._tool = None
        elif not self._text_open:
            return events
        self._text_open = False
        events.append(("content_block_stop", self._block_event("content_block_stop")))
        self._blocks += 1
        return events

    def _block_start(self, block: dict[str, Any]) -> StreamEvent:
        data = {"type": "content_block_start", "index": self._blocks, "content_block": block}
        return "content_block_start", data

    def _block_event(self, kind: str, delta: dict[str, Any] | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {"type": kind, "index": self._blocks}
        if delta is not None:
            data["delta"] = delta
        return data

    def _error(self, status: int, body: object) -> list[StreamEvent]:
        self._over = True
        return [("error", chat_error_to_anthropic(status, body)[1])]


def _message_id(chat: dict[str, Any]) -> str:
    return message_id(str(chat.get("id", "")))


def message_id(engine_id: str) -> str:
    """The Anthropic message id of the engine's chat completion `engine_id`."""
    return "msg_" + engine_id.removeprefix("chatcmpl-")


def _tool_use(call_id: object, name: object, msg_id: str, index: int) -> dict[str, Any]:
    """A `tool_use` block without its input. The engine's call id is kept so the harness's
    `tool_result.tool_use_id` leads back to it; one is derived when the engine gave none."""
    block_id = call_id if isinstance(call_id, str) and call_id else f"toolu_{msg_id}_{index}"
    return {"type": "tool_use", "id": block_id, "name": name or ""}


def _usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    # This engine keeps no prompt cache to bill, so the cache counts are 0, not unknown.
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def _engine_status(chunk: dict[str, Any]) -> int:
    """The HTTP status an in-stream engine error stands for (vLLM puts it in `code`)."""
    error = chunk.get("error", chunk)
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code < 600 else 500
