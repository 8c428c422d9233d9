"""What crossed the wire: tool calls in completions and responses, the requests' sampling
fields against train mode's overrides, budgets, routes and statuses."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.v1 import events_pb2 as pb

NOT_HARNESS = frozenset({"/metrics", "/healthz"})
"""Routes of the gateway's port that no harness call takes."""

_BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


@dataclass(frozen=True, slots=True)
class CallWire:
    """One captured call as the wire checks see it."""

    request: dict[str, Any] | None
    """The harness's request body (None when bodies were not captured or were cut)."""
    response: dict[str, Any] | None
    markup: bool
    """The completion contains tool-call markup."""
    tool_calls: int
    """Tool calls the harness was answered with."""
    asked: int | None
    """The completion budget the harness asked for."""
    text: str = ""
    """The completion decoded, when it has tool-call markup (for the report's examples)."""


def read_call(
    call: pb.ModelCall, decode: Callable[[Sequence[int]], str] | None, markups: Sequence[str]
) -> CallWire:
    request = _body(call.request_body, call.bodies_truncated)
    response = _body(call.response_body, call.bodies_truncated)
    text = decode(list(call.completion_token_ids)) if decode is not None else ""
    asked = next(
        (v for k in _BUDGETS if isinstance(v := (request or {}).get(k), int) and v > 0), None
    )
    markup = any(m in text for m in markups)
    return CallWire(
        request=request,
        response=response,
        markup=markup,
        tool_calls=_tool_calls(call, response),
        asked=asked,
        text=text[:400] if markup else "",
    )


def offered_tools(wire: CallWire) -> bool:
    tools = (wire.request or {}).get("tools")
    return isinstance(tools, list) and bool(tools)


def _body(raw: bytes, truncated: bool) -> dict[str, Any] | None:
    if not raw or truncated:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _tool_calls(call: pb.ModelCall, response: dict[str, Any] | None) -> int:
    """Tool calls in the answer: from the response body when it has one choice (chat,
    Anthropic's content blocks, Responses output items), else from the finish reason."""
    if response is not None:
        choices = response.get("choices")
        if isinstance(choices, list) and len(choices) == 1:
            message = choices[0].get("message") if isinstance(choices[0], dict) else None
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            return len(calls) if isinstance(calls, list) else 0
        for key, kind in (("content", "tool_use"), ("output", "_call")):
            items = response.get(key)
            if isinstance(items, list) and "choices" not in response:
                # Responses output items: function_call, custom_tool_call, local_shell_call
                return sum(
                    1 for i in items if isinstance(i, dict) and str(i.get("type")).endswith(kind)
                )
    return int(call.finish_reason == "tool_calls")


def unparsed_cause(call: pb.ModelCall, wire: CallWire) -> tuple[str, str]:
    """(cause, fix) of a completion whose tool-call markup did not parse."""
    if call.finish_reason == "length":
        return "the completion hit its budget inside the tool call", "raise max_tokens"
    if (wire.request or {}).get("stop"):
        return (
            "the harness's stop sequence cuts the tool call",
            "keep stop strings out of the tool-call syntax (or send none)",
        )
    return (
        "the model's tool-call format is not the one the engine parses",
        "match the engine's tool-call parser (vLLM --tool-call-parser) to the model family "
        "(hermes for Qwen2.5/Qwen3, ...)",
    )


def overrides(wires: Sequence[CallWire], train: Any) -> list[dict[str, Any]]:
    """Sampling fields the harness sets that train mode replaces (forced or neutral values
    that differ from the harness's) or removes, with the values the harness sent."""
    forced: dict[str, Any] = dict(train.neutral)
    if train.temperature is not None:
        forced["temperature"] = train.temperature
    if train.top_p is not None:
        forced["top_p"] = train.top_p
    seen: dict[str, Counter[str]] = {}
    for wire in wires:
        for name, value in (wire.request or {}).items():
            if value is None:
                continue
            if name in train.drop or (name in forced and _differs(value, forced[name])):
                seen.setdefault(name, Counter())[json.dumps(value)[:40]] += 1
    return [
        {
            "field": name,
            "calls": sum(values.values()),
            "harness_values": [v for v, _ in values.most_common(5)],
            "train": "dropped" if name in train.drop else f"forced to {forced[name]}",
        }
        for name, values in sorted(seen.items())
    ]


def _differs(value: Any, forced: Any) -> bool:
    if isinstance(value, int | float) and isinstance(forced, int | float):
        return abs(float(value) - float(forced)) > 1e-9
    return bool(value != forced)


def counter_delta(
    before: dict[str, float], after: dict[str, float], name: str
) -> dict[tuple[tuple[str, str], ...], float]:
    """Increase of counter sample `name` between two scrapes, by label set."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for key, value in after.items():
        sample, _, labels = key.partition("{")
        if sample != name:
            continue
        delta = value - before.get(key, 0.0)
        if delta > 0:
            pairs = [p.split("=", 1) for p in labels.rstrip("}").split(",") if p]
            out[tuple((k, v) for k, v in pairs)] = delta
    return out


def requests(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, int]]:
    """Harness requests on the gateway's port during the run: route -> status -> count (the
    admin API's, the scrapes' and the health checks' left out)."""
    out: dict[str, dict[str, int]] = {}
    for labels, value in counter_delta(before, after, "harnessrl_gateway_requests_total").items():
        got = dict(labels)
        name = got.get("route", "?")
        if name.startswith("/admin") or name in NOT_HARNESS:
            continue
        route = out.setdefault(name, {})
        route[got.get("status", "?")] = int(value)
    return out
