"""Whether a completion the engine answered carried tool-call markup it did not parse.

An engine turns tool-call markup in a completion into the answer's `tool_calls`; markup left
in the content means the harness never saw the call (a malformed call, a format the engine's
parser does not read). The gateway counts such completions per production session (the
canary's `tool_parse` guard); `harnessrl doctor` looks for the same markup in captured calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MARKUPS = (
    "<tool_call>",  # Hermes, Qwen2.5/3 (vLLM's hermes parser, the project's engine)
    "<function=",  # Qwen3-Coder, Llama 3.x's XML style
    "[TOOL_CALLS]",  # Mistral
    "<|python_tag|>",  # Llama 3.1+
    "<\uff5ctool\u2581calls\u2581begin\uff5c>",  # DeepSeek V3/R1 (fullwidth bars)
    "<|tool_calls_section_begin|>",  # Kimi K2
    "to=functions.",  # gpt-oss (harmony)
)
"""Where a completion starts a tool call, in the tool-call formats vLLM's parsers read."""


def has_markup(text: str) -> bool:
    """Whether `text` contains the start of a tool call in a known format."""
    return any(m in text for m in MARKUPS)


@dataclass(frozen=True, slots=True)
class Answer:
    """What an engine's chat answer held, over its choices."""

    content: bool = False
    """Some choice has non-empty content."""
    tool_calls: bool = False
    """Some choice has a tool call."""
    unparsed: bool = False
    """Some choice has tool-call markup in its content and no tool call."""


def chat_answer(data: Mapping[str, Any]) -> Answer:
    """The Answer of a non-streamed chat or text completion (OpenAI's shape, as engines
    answer)."""
    parts = ChatParts()
    parts.add_body(data, "message")
    return parts.answer()


class ChatParts:
    """The content and tool calls of a chat answer's choices, fed whole messages or
    streamed deltas (`add`), read at the end (`answer`)."""

    def __init__(self) -> None:
        self._text: dict[int, list[str]] = {}
        self._calls: set[int] = set()
        self._plain = False

    def add(self, index: object, part: object) -> None:
        """One choice's message or delta (anything else is ignored)."""
        if not isinstance(part, dict):
            return
        key = index if isinstance(index, int) else 0
        content = part.get("content")
        if isinstance(content, str) and content:
            self._text.setdefault(key, []).append(content)
        if part.get("tool_calls"):
            self._calls.add(key)

    def add_body(self, data: Mapping[str, Any], key: str = "delta") -> None:
        """An answer's choices (`key`: "message" whole, "delta" a streamed chunk). A text
        completion's `text` counts as content, never as markup: its harness parses it."""
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            text = choice.get("text")
            if isinstance(text, str):
                self._plain = self._plain or bool(text)
            else:
                self.add(choice.get("index", 0), choice.get(key))

    def answer(self) -> Answer:
        texts = {i: "".join(parts) for i, parts in self._text.items()}
        return Answer(
            content=self._plain or any(texts.values()),
            tool_calls=bool(self._calls),
            unparsed=any(has_markup(t) and i not in self._calls for i, t in texts.items()),
        )
