"""A chain break in words: where in the conversation the prompt changed, and what to do.

The merge (libs/harnessrl/trust/merging.py) says what kind of break started a chain and
the token position of the first difference. Here both sides are decoded in full to find the
message the difference falls in (its role, from the chat template's role headers) and the
line within it, so the report can say "the system prompt changes on every call at line 3:
`x-request-id: ...`" instead of a token index.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[Sequence[int]], str]

_ROLE = re.compile(
    r"(?:<\|im_start\|>|<\|start_header_id\|>|<\|(?=system|user|assistant|tool|developer)"
    r"|\[INST\]|<start_of_turn>)"
    r"\s*(system|developer|user|assistant|tool|ipython|model)\b"
)
"""Role headers of the common chat templates (ChatML/Qwen, Llama 3, Gemma, Phi, ...)."""

_LINE = 160
"""Characters of a differing line kept for the report."""


@dataclass(frozen=True, slots=True)
class Where:
    """The first difference between a recorded context and a prompt sent after it."""

    role: str
    """Role of the message it falls in ("" when the template's headers are not known)."""
    line: int | None
    """1-based line within that message (within the prompt without a role)."""
    sent: str
    """The prompt's line there."""
    recorded: str
    """The recorded context's line there."""


def locate(
    context_ids: Sequence[int], prompt_ids: Sequence[int], position: int, decode: Decode
) -> Where:
    """Where `prompt_ids` first differs from `context_ids` (at token `position`)."""
    at = len(decode(list(prompt_ids[:position])))
    sent_text = decode(list(prompt_ids))
    recorded_text = decode(list(context_ids))
    role, start = "", 0
    for match in _ROLE.finditer(sent_text, 0, at + 1):
        role, start = match.group(1), match.end()
    line = sent_text.count("\n", start, at) + (0 if role else 1)
    return Where(
        role=role,
        line=max(line, 1),
        sent=_line_at(sent_text, at),
        recorded=_line_at(recorded_text, at),
    )


def _line_at(text: str, at: int) -> str:
    at = min(at, len(text))
    begin = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    return text[begin : end if end >= 0 else len(text)][:_LINE]


_ROLE_NAMES = {
    "system": "the system prompt",
    "developer": "the developer message",
    "user": "an earlier user message",
    "tool": "an earlier tool result",
    "ipython": "an earlier tool result",
    "assistant": "an earlier assistant turn",
    "model": "an earlier assistant turn",
}


def explain(
    kind: str, where: Where | None, *, temperature_change: bool, share: float
) -> tuple[str, str]:
    """(cause, fix) of the most common break, in plain words. `share` is the share of the
    episode's later calls that start a chain this way."""
    often = "on every call" if share >= 0.9 else f"at {share:.0%} of calls"
    at = ""
    if where is not None and where.line is not None:
        sent, recorded = where.sent.strip(), where.recorded.strip()
        at = f" at line {where.line}: sent `{sent}` where the recorded context had `{recorded}`"
    if kind == "other" and temperature_change:
        return (
            f"the harness changes the sampling temperature between calls ({often}); a sequence "
            "is trained at one temperature, so each change starts a new chain",
            "keep one temperature per conversation, or let train mode force one "
            "(gateway.train.temperature, the default)",
        )
    if kind == "other":
        part = _ROLE_NAMES.get(where.role if where else "", "an earlier part of the prompt")
        verb = "changes" if part == "the system prompt" else "is rewritten in place"
        fix = (
            "keep per-request values (request ids, timestamps, dates, counters) out of the "
            "system prompt: put them in the latest user turn or an HTTP header"
            if part == "the system prompt"
            else "append to the history instead of editing it (do not re-truncate, re-format "
            "or refresh earlier messages)"
        )
        return (
            f"{part} {verb} {often}{at}; every such call starts a new chain that re-trains "
            "its whole context as prompt",
            fix,
        )
    if kind == "chat_template":
        return (
            f"the chat template renders an earlier assistant turn differently from how it was "
            f"generated ({often}{at}); Qwen3-style templates drop <think> reasoning from "
            "turns before the latest user message",
            "use a template that renders past assistant turns as generated, or accept one "
            "chain per user turn (each is still trained)",
        )
    if kind == "retokenization":
        return (
            f"the harness sends back text that tokenizes into other ids than the engine "
            f"produced ({often}{at}): the same text, re-encoded",
            "send assistant messages back byte for byte (content and tool-call arguments "
            "unchanged; no re-serialised JSON or stripped whitespace)",
        )
    if kind == "compaction":
        return (
            f"the harness drops or summarises its history ({often}{at}); the conversation "
            "goes on as a new chain",
            "expected of compaction; if it happens every few calls, raise the harness's "
            "compaction threshold or the engine's context length",
        )
    return (
        f"sub-agents or side calls ({often}): a call starts its own conversation while an "
        "older one goes on; each conversation is trained as its own chain",
        "nothing to fix when the side calls should be trained; a harness's own helper calls "
        "(titles, summaries) can be sent with another model name or outside the gateway",
    )
