"""Anthropic's Messages API over an engine that speaks OpenAI chat completions.

vLLM serves `/v1/messages` but returns no token ids there, so the gateway translates: a
Messages request becomes a chat-completions request (`messages_to_chat`), the engine's
completion becomes a `Message` (`chat_to_message`), its stream chunks become Anthropic's
stream events (`MessageStream`), its errors Anthropic's errors (`chat_error_to_anthropic`).
Everything here is pure: no I/O, no clock, no randomness.

Conventions, where the two APIs do not map one to one:

- Text blocks of one message are joined with a newline into one string, as vLLM joins text
  parts for chat templates that take string content (not every template takes lists).
- A `system` message inside `messages` (the SDK's `SystemMessageParam`) stays where it is,
  as an OpenAI system message; the chat template decides what it makes of it.
- A user message's `tool_result` blocks become `tool` messages, placed before the rest of
  that message (OpenAI wants them right after the assistant's `tool_calls`); a failed
  result's text starts with `TOOL_ERROR_PREFIX`.
- `thinking` and `redacted_thinking` blocks sent back are dropped; reasoning the engine
  produces (`reasoning_content`) is not returned.
- Claude Code's `x-anthropic-billing-header: ...` system line changes on every request; it
  is not meant for the model, and would stop consecutive prompts from extending each other
  (sample merging), so it is dropped.
- A conversation ending with an assistant turn is a prefill: the engine is asked to continue
  that turn (vLLM's `continue_final_message`), and the answer holds only the continuation.
- Tool-call arguments that are not a JSON object are kept, as text, under
  `RAW_ARGUMENTS_KEY` in the `tool_use` input, so the harness can answer with an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from harnessrl.services.gateway.dialects.anthropic_models import (
    CustomTool,
    InputMessage,
    MessagesRequest,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    invalid,
    parse_request,
)
from harnessrl.services.gateway.dialects.anthropic_response import (
    RAW_ARGUMENTS_KEY,
    MessageStream,
    StreamEvent,
    chat_error_to_anthropic,
    chat_to_message,
    encode_sse,
)

__all__ = [
    "RAW_ARGUMENTS_KEY",
    "TOOL_ERROR_PREFIX",
    "ChatRequest",
    "MessageStream",
    "StreamEvent",
    "chat_error_to_anthropic",
    "chat_to_message",
    "encode_sse",
    "messages_to_chat",
]

TOOL_ERROR_PREFIX = "Error: "
_BILLING_HEADER = "x-anthropic-billing-header:"


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A Messages request translated for the engine."""

    body: dict[str, Any]
    """The chat-completions request, as a harness would send it: the gateway still sets the
    engine's model name and the fields of the inference contract (`return_token_ids`,
    `logprobs`). Streaming requests ask for a final usage chunk."""
    model: str
    """The model name the harness asked for; answers carry it back."""
    stream: bool
    """Whether the harness asked for a stream of events (then feed a `MessageStream`)."""


def messages_to_chat(body: object) -> ChatRequest:
    """The chat-completions request for an Anthropic Messages request body (parsed JSON).

    Unknown top-level fields are ignored. Raises GatewayError(400)
    naming the field and the reason for anything invalid or that this engine cannot honour
    (structured output, image and document blocks, server tools). `top_k` goes to the
    engine as on the OpenAI routes (train calls drop it: gateway.train.drop).
    """
    request = parse_request(body)
    if request.output_config is not None and request.output_config.format is not None:
        raise invalid("output_config.format: structured output is not supported by this engine")
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": _system(request.system) + _conversation(request.messages),
        "max_tokens": request.max_tokens,
        "stream": request.stream,
    }
    if request.stream:
        chat["stream_options"] = {"include_usage": True}
    if request.stop_sequences:
        chat["stop"] = list(request.stop_sequences)
    if request.temperature is not None:
        chat["temperature"] = request.temperature
    if request.top_p is not None:
        chat["top_p"] = request.top_p
    if request.top_k is not None:
        chat["top_k"] = request.top_k
    chat.update(_tools(request))
    last = chat["messages"][-1]
    if last["role"] == "assistant" and last["content"] and "tool_calls" not in last:
        chat["continue_final_message"] = True
        chat["add_generation_prompt"] = False
    return ChatRequest(chat, request.model, request.stream)


def _system(blocks: list[TextBlock] | None) -> list[dict[str, Any]]:
    texts = []
    for block in blocks or ():
        text = block.text
        if text.startswith(_BILLING_HEADER):
            text = text.partition("\n")[2].lstrip("\n")
        if text:
            texts.append(text)
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def _conversation(messages: list[InputMessage]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if message.role == "user":
            out.extend(_user(i, message))
        elif message.role == "assistant":
            out.append(_assistant(i, message))
        else:
            out.append({"role": "system", "content": _text_only(i, message)})
    return out


def _text_only(i: int, message: InputMessage) -> str:
    for j, block in enumerate(message.content):
        if not isinstance(block, TextBlock):
            raise invalid(
                f"messages.{i}.content.{j}.type: {block.type!r} blocks do not belong in "
                "system messages"
            )
    return "\n".join(block.text for block in message.content if isinstance(block, TextBlock))


def _user(i: int, message: InputMessage) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            results.append(
                {"role": "tool", "tool_call_id": block.tool_use_id, "content": _result(block)}
            )
        elif isinstance(block, ToolUseBlock):
            raise invalid(
                f"messages.{i}.content.{j}.type: 'tool_use' blocks belong in assistant messages"
            )
    if texts or not results:
        results.append({"role": "user", "content": "\n".join(texts)})
    return results


def _result(block: ToolResultBlock) -> str:
    text = "\n".join(part.text for part in block.content)
    if block.is_error:
        return TOOL_ERROR_PREFIX + text
    return text


def _assistant(i: int, message: InputMessage) -> dict[str, Any]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, ToolResultBlock):
            raise invalid(
                f"messages.{i}.content.{j}.type: 'tool_result' blocks belong in user messages"
            )
    chat: dict[str, Any] = {
        "role": "assistant",
        "content": "\n".join(texts) if texts or not calls else None,
    }
    if calls:
        chat["tool_calls"] = calls
    return chat


def _tools(request: MessagesRequest) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of the chat request."""
    tools: list[CustomTool] = request.tools or []
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools: tool names must be unique")
    choice = request.tool_choice
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not tools:
        raise invalid(f"tool_choice: type {choice.type!r} requires tools")
    if not tools:
        return {}
    out: dict[str, Any] = {"tools": [_function(t) for t in tools]}
    if choice is None:
        return out
    if isinstance(choice, ToolChoiceTool):
        if choice.name not in names:
            raise invalid(f"tool_choice.name: no tool named {choice.name!r} in tools")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use and not isinstance(choice, ToolChoiceNone):
        out["parallel_tool_calls"] = False
    return out


def _function(tool: CustomTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}
