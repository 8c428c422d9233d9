"""The output of one choice as it grows: text deltas, stop strings, tool calls.

Text is decoded from all ids generated so far (so multi-byte characters split across
tokens come out whole), and a delta is released only once it cannot change: never a
trailing partial character, never a possible start of a stop string, never (with tools)
a possible start of a tool call.
"""

from __future__ import annotations

from collections.abc import Callable

from harnessrl.services.inference.engine import Token
from harnessrl.services.inference.tools import StreamingToolParser, ToolCall, parse_tool_calls


class ChoiceOutput:
    """Accumulates one choice's tokens; `step()` per token, `finish()` at the end."""

    def __init__(
        self, decode: Callable[[list[int]], str], stops: tuple[str, ...], parse_tools: bool
    ) -> None:
        self._decode = decode
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._tools = StreamingToolParser() if parse_tools else None
        self._released = 0
        self.ids: list[int] = []
        self.tokens: list[Token] = []
        self.finish_reason: str | None = None

    def add(self, token: Token) -> None:
        """Add a token without releasing text (for outputs read only once complete)."""
        self.ids.append(token.token_id)
        self.tokens.append(token)
        if token.finish_reason is not None:
            self.finish_reason = token.finish_reason

    def step(self, token: Token) -> str:
        """Add a token; returns the content that can be released now ("" if none)."""
        self.add(token)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        safe = text[: max(self._released, len(text) - self._holdback)] if self._stops else text
        if self._tools is not None:
            return self._tools.content_delta(safe)
        delta = safe[self._released :]
        self._released = max(self._released, len(safe))
        return delta

    def text(self) -> str:
        """The whole output text, cut before the first stop string."""
        text = self._decode(self.ids)
        for stop in self._stops:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return text

    def finish(self) -> tuple[str, list[ToolCall], str]:
        """(content not released yet, tool calls, finish reason) once the choice is done."""
        text = self.text()
        reason = self.finish_reason or "length"
        if self._tools is not None:
            rest, calls = self._tools.finish(text)
            return rest, calls, "tool_calls" if calls else reason
        rest = text[self._released :]
        self._released = len(text)
        return rest, [], reason

    def message(self) -> tuple[str | None, list[ToolCall], str]:
        """(content, tool calls, finish reason) of the complete, non-streamed output."""
        text = self.text()
        reason = self.finish_reason or "length"
        if self._tools is None:
            return text, [], reason
        content, calls = parse_tool_calls(text)
        return content, calls, "tool_calls" if calls else reason
