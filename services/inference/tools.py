"""Tool calls in model output: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The Hermes/Qwen convention the project's chat template teaches. Text outside the blocks is
the message content. A block that is not a JSON object with a string "name" leaves the whole
output as plain content, as vLLM's hermes parser does, so a malformed call is never lost.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)" + re.escape(END), re.DOTALL)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it

    def to_openai(self, index: int | None = None) -> dict[str, object]:
        data: dict[str, object] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            data["index"] = index
        return data


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a complete model output. Content is None when the output is
    only tool calls."""
    if START not in text:
        return text, []
    calls = []
    for block in _BLOCK.findall(text):
        try:
            data = json.loads(block)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return text, []
        arguments = data.get("arguments", {})
        text_args = (
            arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        )
        calls.append(ToolCall(f"call_{secrets.token_hex(12)}", data["name"], text_args))
    if not calls:
        return text, []
    content = _BLOCK.sub("", text).strip()
    return (content or None), calls


class StreamingToolParser:
    """Splits a growing output into content that is safe to stream now, holding back anything
    that is, or may become, a tool call; the calls are resolved when the output ends."""

    def __init__(self) -> None:
        self._emitted = 0

    def content_delta(self, text: str) -> str:
        """New content that can be streamed, given the whole output so far."""
        cut = text.find(START)
        if cut < 0:
            cut = len(text) - _partial_start(text)
        delta = text[self._emitted : cut] if cut > self._emitted else ""
        self._emitted = max(self._emitted, cut)
        return delta

    def finish(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content not streamed yet, tool calls) once the output is complete."""
        content, calls = parse_tool_calls(text)
        if calls:
            return "", calls
        rest = (content or "")[self._emitted :]
        self._emitted = len(text)
        return rest, []


def _partial_start(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of START."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:n]):
            return n
    return 0
