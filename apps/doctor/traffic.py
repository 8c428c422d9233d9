"""The report's tool-call and wire sections: markup that did not parse, tools used, and
what the requests carried (routes, statuses, budgets, sampling fields, context growth)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from harnessrl.apps.doctor.attempt import EpisodeView
from harnessrl.apps.doctor.checks import FAIL, NA, OK, WARN, Check, at_most, share, stats
from harnessrl.apps.doctor.collect import Collected
from harnessrl.apps.doctor.traffic_read import (
    CallWire,
    counter_delta,
    offered_tools,
    overrides,
    requests,
    unparsed_cause,
)
from harnessrl.v1 import events_pb2 as pb


def tools_section(episodes: list[EpisodeView]) -> dict[str, Any]:
    wires = [(e, c, w) for e in episodes for c, w in zip(e.calls, e.wires, strict=True)]
    offered = any(offered_tools(w) for _, _, w in wires)
    markup = [(e, c, w) for e, c, w in wires if w.markup]
    unparsed = [(e, c, w) for e, c, w in markup if w.tool_calls == 0]
    per_episode = [sum(w.tool_calls for w in e.wires) for e in episodes]
    offered = offered or bool(markup) or any(per_episode)
    without = sum(1 for n in per_episode if n == 0)
    examples = [
        {
            "episode_id": e.episode_id,
            "seq": c.seq,
            "finish_reason": c.finish_reason,
            "text": w.text,
            "cause": unparsed_cause(c, w)[0],
        }
        for e, c, w in unparsed[:5]
    ]
    return {
        "offered": offered,
        "markup_calls": len(markup),
        "parsed_calls": sum(1 for _, _, w in wires if w.tool_calls),
        "unparsed_calls": len(unparsed),
        "unparsed_examples": examples,
        "tool_calls_per_episode": stats([float(n) for n in per_episode]),
        "episodes_without_tool_call": without,
        "_checks": [
            _parse_check(unparsed, len(markup)),
            _used_check(offered, without, len(episodes)),
        ],
    }


def _parse_check(unparsed: list[tuple[EpisodeView, pb.ModelCall, CallWire]], markup: int) -> Check:
    rate = share(len(unparsed), markup)
    detail = fix = ""
    if unparsed:
        e0, first, wire0 = unparsed[0]
        cause, fix = unparsed_cause(first, wire0)
        detail = (
            f"{cause} (first: call {first.seq} of episode {e0.episode_id}); the harness gets "
            "the call as text and never runs the tool"
        )
    return Check(
        "tools.parse",
        "tools",
        "tool-call markup that did not parse",
        NA if rate is None else at_most(rate, 0.0, 0.2),
        "no completion has tool-call markup"
        if rate is None
        else f"{len(unparsed)} of {markup} ({rate:.2f})",
        "ok: none, warn <= 0.2, fail above",
        detail,
        fix,
    )


def _used_check(offered: bool, without: int, episodes: int) -> Check:
    no_tools = share(without, episodes)
    none_call = offered and without == episodes
    return Check(
        "tools.used",
        "tools",
        "episodes without a tool call",
        NA
        if not offered or no_tools is None
        else (FAIL if without == episodes else at_most(no_tools, 0.5, 0.99)),
        "no tools offered" if not offered else f"{without} of {episodes} episodes",
        "ok <= 0.5, warn below 1, fail: no episode calls a tool",
        "every trajectory is single-turn: the model never gets a tool result to learn from"
        if none_call
        else "",
        "check the tool-call format (tools.parse) and that the harness offers its tools"
        if none_call
        else "",
    )


def wire_section(episodes: list[EpisodeView], collected: Collected, train: Any) -> dict[str, Any]:
    calls = [c for e in episodes for c in e.calls]
    wires = [w for e in episodes for w in e.wires]
    bodies = any(w.request is not None for w in wires)
    routes = requests(collected.gateway_before, collected.gateway_after)
    errors = {r: {s: n for s, n in by.items() if s[:1] in "45"} for r, by in routes.items()}
    errors = {r: by for r, by in errors.items() if by}
    clamped = int(
        sum(
            counter_delta(
                collected.gateway_before,
                collected.gateway_after,
                "harnessrl_gateway_max_tokens_clamped_total",
            ).values()
        )
    )
    finish = Counter(c.finish_reason or "?" for c in calls)
    limit = collected.context_limit
    context = _context_points(episodes)
    largest = max((p["tokens"] for p in context), default=0)
    fields = overrides(wires, train) if bodies else []
    checks = [
        _errors_check(routes, errors),
        _clamped_check(clamped, len(calls), max((w.asked or 0 for w in wires), default=0)),
        _overrides_check(bodies, fields),
        _context_check(_near_limit(episodes, limit), len(episodes), largest, limit),
        _length_check(finish["length"], len(calls)),
    ]
    return {
        "bodies": bodies,
        "dialects": dict(Counter(pb.Api.Name(c.api).removeprefix("API_").lower() for c in calls)),
        "requests": routes,
        "errors": errors,
        "clamped": clamped,
        "max_tokens_asked": stats([float(w.asked) for w in wires if w.asked]),
        "finish_reasons": dict(finish),
        "overrides": fields,
        "context_limit": limit,
        "context": context,
        "max_context_share": round(largest / limit, 4) if limit else None,
        "_checks": checks,
    }


def _context_points(episodes: list[EpisodeView]) -> list[dict[str, int]]:
    """Prompt plus completion tokens of each call, by episode index and seq (at most 5,000)."""
    return [
        {
            "episode": i,
            "seq": c.seq,
            "tokens": len(c.prompt_token_ids) + len(c.completion_token_ids),
        }
        for i, e in enumerate(episodes)
        for c in e.calls
    ][:5000]


def _near_limit(episodes: list[EpisodeView], limit: int | None) -> int:
    """Episodes whose largest call reaches 90% of the context (0 when it is unknown)."""
    return sum(
        1
        for e in episodes
        if limit
        and e.calls
        and max(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in e.calls)
        >= 0.9 * limit
    )


def _errors_check(routes: dict[str, dict[str, int]], errors: dict[str, dict[str, int]]) -> Check:
    total = sum(sum(by.values()) for by in routes.values())
    failed = sum(sum(by.values()) for by in errors.values())
    server = sum(n for by in errors.values() for s, n in by.items() if s.startswith("5"))
    return Check(
        "wire.errors",
        "wire",
        "requests answered 4xx/5xx",
        NA if not total else (FAIL if server or failed / total > 0.05 else WARN if failed else OK),
        "gateway metrics unreadable" if not total else f"{failed} of {total} ({_routes(errors)})",
        "ok: none, warn: any 4xx, fail: any 5xx or > 0.05",
    )


def _clamped_check(clamped: int, calls: int, most_asked: int) -> Check:
    return Check(
        "wire.max_tokens",
        "wire",
        "completion budgets clamped to the context",
        OK if not clamped else WARN,
        f"{clamped} of {calls} calls",
        "ok: none, warn: any",
        f"the harness asks for up to {most_asked} tokens; the gateway lowered it to the room left"
        if clamped
        else "",
        "ask for max_tokens <= the context left (or accept the clamp: the harness gets a "
        "shorter budget than it asked)"
        if clamped
        else "",
    )


def _overrides_check(bodies: bool, fields: list[dict[str, Any]]) -> Check:
    changed = ", ".join(
        f"{f['field']} {'/'.join(f['harness_values'])} -> {f['train']}" for f in fields
    )
    return Check(
        "wire.overrides",
        "wire",
        "sampling fields train mode replaces",
        NA if not bodies else (WARN if fields else OK),
        "bodies not captured (gateway.capture_bodies)" if not bodies else (changed or "none"),
        "ok: none, warn: any (training samples another distribution than production)",
        "train mode samples the policy's own distribution, so what is learned is measured at "
        "those settings"
        if fields
        else "",
        "evaluate with the same settings (gateway.val) or set gateway.train to the harness's"
        if fields
        else "",
    )


def _context_check(near: int, episodes: int, largest: int, limit: int | None) -> Check:
    return Check(
        "wire.context",
        "wire",
        "episodes reaching 90% of the context",
        NA if not limit else at_most(near / max(episodes, 1), 0.0, 0.5),
        "engine context length unknown"
        if not limit
        else f"{near} of {episodes} (largest call {largest} of {limit} tokens)",
        "ok: none, warn <= 0.5, fail above",
        "long episodes are cut by the context: their last turns are clamped or refused"
        if limit and near
        else "",
        "a longer context (max_model_len) or compaction in the harness" if limit and near else "",
    )


def _length_check(cut: int, calls: int) -> Check:
    length = share(cut, calls)
    return Check(
        "wire.length",
        "wire",
        "completions cut at their budget",
        NA if length is None else at_most(length, 0.05, 0.25),
        "no calls" if length is None else f"{cut} of {calls} ({length:.2f})",
        "ok <= 0.05, warn <= 0.25, fail above",
        "cut completions are trained as they are: unfinished turns and tool calls"
        if length and length > 0.05
        else "",
        "raise the harness's max_tokens" if length and length > 0.05 else "",
    )


def _routes(errors: dict[str, dict[str, int]]) -> str:
    return (
        "; ".join(f"{r} " + " ".join(f"{s}x{n}" for s, n in by.items()) for r, by in errors.items())
        or "none"
    )
