"""The path of one episode through the system, assembled from stored spans.

An episode's trace holds the controller's episode span (its root), the gateway's span per
model call, the Kafka consumers' `<topic> process` spans and the reward service's
`reward.score`. The sample builder's `samples.group` span lives in its own trace and links
to every call span it used; the trainer's `trainer.step` span lives in its own trace and
links to the group spans of its batch. This module finds the episode's trace, builds its
tree, then follows those links backwards. It is pure: spans come in as OTLP/JSON dicts (as
`harnessrl.telemetry.jsonl.read_spans` yields them) or as Jaeger query-API traces.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

EPISODE_ID = "harnessrl.episode_id"
GROUP_ID = "harnessrl.group_id"
_ERROR = 2  # OTLP StatusCode.ERROR

# The attributes shown on a span's line, per kind of span, as (label, attribute key).
_CALL_KEYS = (
    ("prompt_tokens", "harnessrl.prompt_tokens"),
    ("completion_tokens", "harnessrl.completion_tokens"),
    ("policy_version", "harnessrl.policy_version"),
    ("attempt", "harnessrl.attempt"),
)
_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "episode": (
        ("episode_id", EPISODE_ID),
        ("group_id", GROUP_ID),
        ("task_id", "harnessrl.task_id"),
    ),
    "call": _CALL_KEYS,
    "reward": (
        ("value", "harnessrl.reward.value"),
        ("missing", "harnessrl.reward.missing"),
        ("source", "harnessrl.reward.source"),
    ),
    "group": (("group_id", GROUP_ID), ("outcome", "harnessrl.samples.outcome")),
    "feedback": (("name", "harnessrl.feedback.name"), ("outcome", "harnessrl.feedback.outcome")),
    "step": (
        ("step", "harnessrl.step"),
        ("loss", "harnessrl.loss"),
        ("groups", "harnessrl.groups"),
        ("produced_version", "harnessrl.policy_version"),
    ),
    "kafka": (("event", "harnessrl.event"),),
}


_KINDS = {
    "reward.score": "reward",
    "feedback.signal": "feedback",  # a production session's: an app's signal about it
    "samples.group": "group",
    "samples.session": "group",  # a production session's group
    "trainer.step": "step",
}


@dataclass(frozen=True)
class Link:
    trace_id: str
    span_id: str
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Span:
    """One span, ids as lower-case hex; `parent_id` is "" for a trace's root."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any] = field(default_factory=dict)
    links: tuple[Link, ...] = ()
    error: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return self.trace_id, self.span_id

    @property
    def duration_ms(self) -> float:
        return max(self.end_ns - self.start_ns, 0) / 1e6

    @property
    def kind(self) -> str:
        """What the span stands for: episode, call, reward, group, step, kafka or other."""
        if self.name.startswith("episode ") and EPISODE_ID in self.attributes:
            return "episode"
        if self.name.startswith("gateway "):
            return "call"
        if self.attributes.get("messaging.system") == "kafka":
            return "kafka"
        return _KINDS.get(self.name, "other")


@dataclass
class SpanNode:
    span: Span
    children: list[SpanNode] = field(default_factory=list)
    orphan: bool = False  # its parent was not found; attached to the root instead


@dataclass
class EpisodePath:
    """An episode's trace as a tree, plus the group and step spans reached through links."""

    episode_id: str
    trace_id: str
    root: SpanNode
    groups: list[Span]
    steps: list[Span]
    seqs: dict[str, int]  # call span id -> seq, from the group spans' link attributes


# -- reading ----------------------------------------------------------------------------


def from_otlp(span: Mapping[str, Any]) -> Span:
    """A span from its OTLP/JSON dict (hex ids, plus the key "service" that read_spans adds)."""
    links = tuple(
        Link(link["traceId"], link["spanId"], _otlp_attributes(link.get("attributes", ())))
        for link in span.get("links", ())
    )
    return Span(
        trace_id=span["traceId"],
        span_id=span["spanId"],
        parent_id=span.get("parentSpanId", ""),
        name=span.get("name", ""),
        service=span.get("service", ""),
        start_ns=int(span.get("startTimeUnixNano", 0)),
        end_ns=int(span.get("endTimeUnixNano", 0)),
        attributes=_otlp_attributes(span.get("attributes", ())),
        links=links,
        error=span.get("status", {}).get("code") == _ERROR,
    )


def _otlp_attributes(attributes: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    return {a["key"]: _otlp_value(a.get("value", {})) for a in attributes}


def _otlp_value(value: Mapping[str, Any]) -> Any:
    if "intValue" in value:  # int64 is a string in OTLP/JSON
        return int(value["intValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values", ())]
    if "kvlistValue" in value:
        return _otlp_attributes(value["kvlistValue"].get("values", ()))
    for kind in ("stringValue", "boolValue", "doubleValue", "bytesValue"):
        if kind in value:
            return value[kind]
    return None


def from_jaeger(trace: Mapping[str, Any]) -> list[Span]:
    """The spans of one trace from Jaeger's query API (`GET /api/traces`). Jaeger keeps an
    OTLP link as a FOLLOWS_FROM reference and drops the link's attributes."""
    processes = trace.get("processes", {})
    spans = []
    for span in trace.get("spans", ()):
        parent, links = "", []
        for ref in span.get("references", ()):
            same_trace = ref["traceID"] == span["traceID"]
            if ref.get("refType") == "CHILD_OF" and same_trace and not parent:
                parent = ref["spanID"]
            else:
                links.append(Link(ref["traceID"], ref["spanID"]))
        tags = {t["key"]: t.get("value") for t in span.get("tags", ())}
        start_ns = int(span.get("startTime", 0)) * 1000  # Jaeger times are microseconds
        service = processes.get(span.get("processID", ""), {}).get("serviceName", "")
        spans.append(
            Span(
                trace_id=span["traceID"],
                span_id=span["spanID"],
                parent_id=parent,
                name=span.get("operationName", ""),
                service=service,
                start_ns=start_ns,
                end_ns=start_ns + int(span.get("duration", 0)) * 1000,
                attributes=tags,
                links=tuple(links),
                error=tags.get("otel.status_code") == "ERROR" or tags.get("error") is True,
            )
        )
    return spans


# -- assembling -------------------------------------------------------------------------


def episode_trace(spans: Iterable[Span], episode_id: str) -> str | None:
    """The trace id of the episode: the trace of its controller episode span (the latest one
    if a restarted controller opened another), else of any span carrying its id (a call of
    an episode still running, whose episode span is not exported yet); None if unknown."""
    best: Span | None = None
    fallback: Span | None = None
    for span in spans:
        if span.attributes.get(EPISODE_ID) != episode_id:
            continue
        if span.kind == "episode":
            if best is None or span.start_ns > best.start_ns:
                best = span
        elif fallback is None or span.start_ns > fallback.start_ns:
            fallback = span
    found = best or fallback
    return found.trace_id if found else None


def build_tree(spans: Iterable[Span], trace_id: str) -> SpanNode:
    """The parent/child tree of one trace, children in start order. The root is the parentless
    span (the earliest if several); spans whose parent is missing hang from the root, marked
    orphan. When no span is parentless, a placeholder root named "(root not exported)" is
    made. Raises ValueError for a trace with no spans."""
    members = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start_ns)
    if not members:
        raise ValueError(f"no spans in trace {trace_id}")
    nodes = {s.span_id: SpanNode(s) for s in members}
    roots = [s for s in members if not s.parent_id]
    if roots:
        root = nodes[roots[0].span_id]
    else:
        # A production session's trace has no root span by design: every span of it
        # descends from one parent id derived from the session (production.py), which no
        # service records; the placeholder stands for it, so its children are not orphans.
        session = any(str(s.attributes.get(EPISODE_ID, "")).startswith("s.") for s in members)
        missing = Counter(s.parent_id for s in members if s.parent_id not in nodes)
        common = missing.most_common(1)[0][0] if session and missing else ""
        first, last = members[0], max(members, key=lambda s: s.end_ns)
        name = "(production session)" if session else "(root not exported)"
        placeholder = Span(trace_id, common, "", name, "", first.start_ns, last.end_ns)
        root = SpanNode(placeholder)
        if common:
            nodes[common] = root
    for span in members:
        node = nodes[span.span_id]
        if node is root:
            continue
        parent = nodes.get(span.parent_id)
        if parent is None:
            node.orphan = True
            parent = root
        parent.children.append(node)
    return root


def linking_to(spans: Iterable[Span], targets: set[tuple[str, str]]) -> list[Span]:
    """Spans with at least one link to a (trace id, span id) in `targets`, in start order."""
    found = [s for s in spans if any((k.trace_id, k.span_id) in targets for k in s.links)]
    return sorted(found, key=lambda s: s.start_ns)


def episode_path(spans: Iterable[Span], episode_id: str) -> EpisodePath | None:
    """The episode's tree and the group and step spans linked to it; None when no span
    names the episode."""
    spans = list(spans)
    trace_id = episode_trace(spans, episode_id)
    if trace_id is None:
        return None
    root = build_tree(spans, trace_id)
    in_trace = {s.key for s in spans if s.trace_id == trace_id}
    groups = linking_to(spans, in_trace)
    steps = linking_to(spans, {g.key for g in groups})
    seqs = {
        link.span_id: int(link.attributes["harnessrl.seq"])
        for group in groups
        for link in group.links
        if link.trace_id == trace_id and "harnessrl.seq" in link.attributes
    }
    return EpisodePath(episode_id, trace_id, root, groups, steps, seqs)


# -- showing ----------------------------------------------------------------------------


def key_attributes(span: Span, seqs: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The few attributes worth a glance for this kind of span (only those present)."""
    shown: dict[str, Any] = {}
    if span.kind == "call" and seqs and span.span_id in seqs:
        shown["seq"] = seqs[span.span_id]
    for label, key in _KEYS.get(span.kind, ()):
        value = span.attributes.get(key)
        if value is not None and value != "":
            shown[label] = round(value, 4) if isinstance(value, float) else value
    if span.kind == "group":
        shown["calls"] = len(span.links)
    return shown


def _visible(node: SpanNode, all_spans: bool, hidden: Counter[str]) -> list[SpanNode]:
    """The node's children, with Kafka spans replaced by their children unless `all_spans`;
    each replaced span is counted in `hidden` by name."""
    out: list[SpanNode] = []
    for child in node.children:
        if child.span.kind == "kafka" and not all_spans:
            hidden[child.span.name] += 1
            out.extend(_visible(child, all_spans, hidden))
        else:
            out.append(child)
    return sorted(out, key=lambda n: n.span.start_ns)


def _line(span: Span, seqs: Mapping[str, int], orphan: bool = False) -> str:
    parts = [span.name, f"[{span.service or '?'}]", f"{span.duration_ms:.1f} ms"]
    parts += [f"{k}={v}" for k, v in key_attributes(span, seqs).items()]
    if span.error:
        parts.append("ERROR")
    if orphan:
        parts.append("(orphan: parent span not found)")
    return "  ".join(parts)


def render(path: EpisodePath, *, all_spans: bool = False) -> str:
    """The path as an indented tree, one line per span, then the linked group and step
    spans as `↳ linked:` lines."""
    lines = [f"episode {path.episode_id}  trace {path.trace_id}"]
    hidden: Counter[str] = Counter()

    def walk(node: SpanNode, depth: int) -> None:
        lines.append("  " * depth + _line(node.span, path.seqs, node.orphan))
        for child in _visible(node, all_spans, hidden):
            walk(child, depth + 1)

    walk(path.root, 1)
    if hidden:
        counts = ", ".join(f"{name} ({n})" for name, n in sorted(hidden.items()))
        lines.append(f"  (kafka spans hidden: {counts}; --all shows them)")
    for group in path.groups:
        lines.append(f"  ↳ linked: {_line(group, path.seqs)}  trace {group.trace_id}")
        for step in _steps_of(path, group):
            lines.append(f"    ↳ linked: {_line(step, path.seqs)}  trace {step.trace_id}")
    if not path.groups:
        lines.append("  (no samples.group span links to this episode yet)")
    return "\n".join(lines)


def _steps_of(path: EpisodePath, group: Span) -> list[Span]:
    return [s for s in path.steps if any((k.trace_id, k.span_id) == group.key for k in s.links)]


def _span_json(span: Span, seqs: Mapping[str, int]) -> dict[str, Any]:
    return {
        "name": span.name,
        "service": span.service,
        "kind": span.kind,
        "trace_id": span.trace_id,
        "span_id": span.span_id,
        "duration_ms": round(span.duration_ms, 3),
        "error": span.error,
        "key": key_attributes(span, seqs),
        "attributes": dict(span.attributes),
    }


def to_json(path: EpisodePath, *, all_spans: bool = False) -> dict[str, Any]:
    """The same structure as `render`, as JSON-ready data."""
    hidden: Counter[str] = Counter()

    def node_json(node: SpanNode) -> dict[str, Any]:
        children = [node_json(c) for c in _visible(node, all_spans, hidden)]
        return {**_span_json(node.span, path.seqs), "orphan": node.orphan, "children": children}

    tree = node_json(path.root)
    groups = [
        {
            **_span_json(g, path.seqs),
            "steps": [_span_json(s, path.seqs) for s in _steps_of(path, g)],
        }
        for g in path.groups
    ]
    return {
        "episode_id": path.episode_id,
        "trace_id": path.trace_id,
        "tree": tree,
        "hidden": dict(hidden),
        "groups": groups,
    }


def jaeger_links(path: EpisodePath, base_url: str) -> list[tuple[str, str]]:
    """(label, URL) of the episode, group and step traces in a Jaeger UI at `base_url`."""
    base = base_url.rstrip("/")
    out = [(f"episode {path.episode_id}", f"{base}/trace/{path.trace_id}")]
    for group in path.groups:
        label = f"samples.group {group.attributes.get(GROUP_ID, '')}".rstrip()
        out.append((label, f"{base}/trace/{group.trace_id}"))
    for step in path.steps:
        label = f"trainer.step {step.attributes.get('harnessrl.step', '')}".rstrip()
        out.append((label, f"{base}/trace/{step.trace_id}"))
    return out
