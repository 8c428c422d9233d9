"""`harnessrl trace`: an episode's path from its calls to the steps, from real SDK spans.

The spans are made with the OpenTelemetry SDK and exported by `JsonLinesSpanExporter`, with
the span names, attribute keys and parenting the services use (context carried between
"services" as W3C headers, as over Kafka and the harness's traceparent)."""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags

from harnessrl.apps.cli import main
from harnessrl.telemetry import extract_context, inject_headers, span_ids
from harnessrl.telemetry.jsonl import JsonLinesSpanExporter, read_spans
from harnessrl.telemetry.tracetree import (
    EpisodePath,
    Span,
    SpanNode,
    build_tree,
    episode_path,
    from_jaeger,
    from_otlp,
    render,
)
from harnessrl.telemetry.tracetree import Link as TreeLink


@dataclass
class Ids:
    episode: tuple[str, str]
    calls: list[tuple[str, str]]
    reward: tuple[str, str]
    group: tuple[str, str]
    step: tuple[str, str]


def _tracer(path: Path, service: str) -> trace.Tracer:
    provider = TracerProvider(resource=Resource.create({"service.name": f"harnessrl-{service}"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    return provider.get_tracer(service)


def _episode(path: Path, episode_id: str, group_id: str, *, orphan: bool = False) -> Ids:
    controller, gateway = _tracer(path, "controller"), _tracer(path, "gateway")
    reward, builder = _tracer(path, "reward"), _tracer(path, "sample-builder")
    trainer = _tracer(path, "trainer")
    calls = []
    with controller.start_as_current_span(
        f"episode {episode_id}", context=trace.set_span_in_context(trace.INVALID_SPAN)
    ) as episode:
        episode.set_attributes(
            {
                "harnessrl.episode_id": episode_id,
                "harnessrl.group_id": group_id,
                "harnessrl.task_id": "t1",
            }
        )
        with controller.start_as_current_span("attempt 1"):
            traceparent = inject_headers([])  # TRACEPARENT handed to the harness
            for version in (3, 4):
                with gateway.start_as_current_span(
                    "gateway chat", context=extract_context(traceparent), kind=SpanKind.SERVER
                ) as call:
                    call.set_attributes(
                        {
                            "harnessrl.episode_id": episode_id,
                            "harnessrl.attempt": 1,
                            "harnessrl.group_id": group_id,
                            "harnessrl.policy_version": str(version),
                        }
                    )
                    calls.append(span_ids(call))
                    calls_headers = inject_headers([])
                with builder.start_as_current_span(
                    "hrl.calls process",
                    context=extract_context(calls_headers),
                    kind=SpanKind.CONSUMER,
                    attributes={"messaging.system": "kafka", "harnessrl.event": "ModelCall"},
                ):
                    pass
            episodes_headers = inject_headers([])
        with (
            reward.start_as_current_span(
                "hrl.episodes process",
                context=extract_context(episodes_headers),
                kind=SpanKind.CONSUMER,
                attributes={"messaging.system": "kafka"},
            ),
            reward.start_as_current_span("reward.score") as score,
        ):
            score.set_attribute("harnessrl.episode_id", episode_id)
            score.set_attribute("harnessrl.reward.missing", False)
            score.set_attribute("harnessrl.reward.value", 0.75)
            reward_ids = span_ids(score)
        if orphan:  # a span whose parent never reached the store
            lost = SpanContext(
                episode.get_span_context().trace_id, 0xDEAD, True, TraceFlags(TraceFlags.SAMPLED)
            )
            context = trace.set_span_in_context(trace.NonRecordingSpan(lost))
            with gateway.start_as_current_span("stray", context=context):
                pass
        episode_ids = span_ids(episode)
    links = [_link(ids, {"harnessrl.seq": seq}) for seq, ids in enumerate(calls)]
    with builder.start_as_current_span("samples.group", context=Context(), links=links) as g:
        g.set_attribute("harnessrl.group_id", group_id)
        g.set_attribute("harnessrl.samples.outcome", "emitted")
        group_ids = span_ids(g)
    with trainer.start_as_current_span(
        "trainer.step", links=[_link(group_ids, {"harnessrl.group_id": group_id})]
    ) as step:
        step.set_attribute("harnessrl.step", 7)
        step.set_attribute("harnessrl.groups", 1)
        step.set_attribute("harnessrl.loss", 0.125)
        step_ids = span_ids(step)
    return Ids(episode_ids, calls, reward_ids, group_ids, step_ids)


def _link(ids: tuple[str, str], attributes: dict[str, int | str]) -> Link:
    context = SpanContext(int(ids[0], 16), int(ids[1], 16), True, TraceFlags(TraceFlags.SAMPLED))
    return Link(context, attributes)


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, Ids]:
    path = tmp_path / "spans.jsonl"
    _episode(path, "other", "g0")  # an unrelated episode in the same file
    ids = _episode(path, "e1", "g1", orphan=True)
    return path, ids


def _path(path: Path, episode_id: str = "e1") -> EpisodePath:
    found = episode_path([from_otlp(s) for s in read_spans(path)], episode_id)
    assert found is not None
    return found


def _walk(node: SpanNode) -> list[SpanNode]:
    return [node, *(n for child in node.children for n in _walk(child))]


def test_tree_roots_at_the_episode_span_with_calls_and_reward_under_it(
    stored: tuple[Path, Ids],
) -> None:
    path, ids = stored
    found = _path(path)
    assert found.trace_id == ids.episode[0]
    assert found.root.span.key == ids.episode
    nodes = {n.span.key: n for n in _walk(found.root)}
    assert all(call in nodes for call in ids.calls)
    assert ids.reward in nodes
    attempt = found.root.children[0]
    assert attempt.span.name == "attempt 1"
    assert [c.span.key for c in attempt.children if c.span.kind == "call"] == ids.calls
    assert not any(n.span.trace_id != found.trace_id for n in nodes.values())


def test_a_span_whose_parent_is_missing_hangs_from_the_root_marked(
    stored: tuple[Path, Ids],
) -> None:
    found = _path(stored[0])
    stray = [c for c in found.root.children if c.span.name == "stray"]
    assert len(stray) == 1 and stray[0].orphan
    assert "(orphan: parent span not found)" in render(found)


def test_group_and_step_are_found_by_following_links_backwards(
    stored: tuple[Path, Ids],
) -> None:
    _, ids = stored
    found = _path(stored[0])
    assert [g.key for g in found.groups] == [ids.group]
    assert [s.key for s in found.steps] == [ids.step]
    assert found.seqs == {ids.calls[0][1]: 0, ids.calls[1][1]: 1}


def test_render_shows_each_span_and_hides_kafka_spans_unless_all(
    stored: tuple[Path, Ids],
) -> None:
    found = _path(stored[0])
    text = render(found)
    for name in ("episode e1", "attempt 1", "gateway chat", "reward.score"):
        assert name in text
    assert "seq=0" in text and "seq=1" in text and "policy_version=4" in text
    assert "value=0.75" in text and "missing=False" in text
    assert "↳ linked: samples.group" in text and "outcome=emitted  calls=2" in text
    assert "↳ linked: trainer.step" in text and "step=7  loss=0.125  groups=1" in text
    assert "hrl.calls process" not in text.split("(kafka spans hidden")[0]
    assert "hrl.calls process (2)" in text and "hrl.episodes process (1)" in text
    everything = render(found, all_spans=True)
    assert everything.count("hrl.calls process") == 2
    assert "kafka spans hidden" not in everything
    # reward.score is found under its consumer span, whichever way it is shown
    reward_line = next(line for line in everything.splitlines() if "reward.score" in line)
    consumer_line = next(line for line in everything.splitlines() if "hrl.episodes" in line)
    indent = len(reward_line) - len(reward_line.lstrip())
    assert indent == len(consumer_line) - len(consumer_line.lstrip()) + 2


def test_cli_prints_the_tree(stored: tuple[Path, Ids], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "e1", "--spans", str(stored[0])]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"episode e1  trace {stored[1].episode[0]}")
    assert "harnessrl-gateway" in out and "trainer.step" in out and "loss=0.125" in out


def test_cli_json_has_the_tree_groups_and_steps(
    stored: tuple[Path, Ids], capsys: pytest.CaptureFixture[str]
) -> None:
    path, ids = stored
    assert main(["trace", "e1", "--spans", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["episode_id"] == "e1" and data["trace_id"] == ids.episode[0]
    tree = data["tree"]
    assert tree["name"] == "episode e1" and tree["service"] == "harnessrl-controller"
    calls = [c for c in tree["children"][0]["children"] if c["kind"] == "call"]
    assert [c["key"]["seq"] for c in calls] == [0, 1]
    assert data["hidden"] == {"hrl.calls process": 2, "hrl.episodes process": 1}
    [group] = data["groups"]
    assert group["span_id"] == ids.group[1] and group["key"]["calls"] == 2
    [step] = group["steps"]
    assert step["key"] == {"step": 7, "loss": 0.125, "groups": 1}


def test_unknown_episode_exits_1_naming_the_file(
    stored: tuple[Path, Ids], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", "nope", "--spans", str(stored[0])]) == 1
    err = capsys.readouterr().err
    assert "'nope'" in err and str(stored[0]) in err


def test_missing_span_file_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none.jsonl"
    assert main(["trace", "e1", "--spans", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--jaeger" in err


def test_jaeger_prints_the_episode_group_and_step_trace_urls(
    stored: tuple[Path, Ids], capsys: pytest.CaptureFixture[str]
) -> None:
    path, ids = stored
    assert main(["trace", "e1", "--spans", str(path), "--jaeger", "http://j:16686/"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"episode e1  http://j:16686/trace/{ids.episode[0]}",
        f"samples.group g1  http://j:16686/trace/{ids.group[0]}",
        f"trainer.step 7  http://j:16686/trace/{ids.step[0]}",
    ]


def test_jaeger_query_traces_convert_with_links_as_references() -> None:
    trace_json = {
        "traceID": "aa",
        "processes": {"p1": {"serviceName": "harnessrl-trainer"}},
        "spans": [
            {
                "traceID": "aa",
                "spanID": "01",
                "operationName": "trainer.step",
                "references": [{"refType": "FOLLOWS_FROM", "traceID": "bb", "spanID": "02"}],
                "startTime": 1_000,
                "duration": 2_500,
                "tags": [{"key": "harnessrl.step", "type": "int64", "value": 3}],
                "processID": "p1",
            },
            {
                "traceID": "aa",
                "spanID": "03",
                "operationName": "child",
                "references": [{"refType": "CHILD_OF", "traceID": "aa", "spanID": "01"}],
                "startTime": 1_100,
                "duration": 10,
                "tags": [{"key": "otel.status_code", "type": "string", "value": "ERROR"}],
                "processID": "p1",
            },
        ],
    }
    step, child = from_jaeger(trace_json)
    assert step.kind == "step" and step.service == "harnessrl-trainer"
    assert step.duration_ms == 2.5 and step.attributes["harnessrl.step"] == 3
    assert [(link.trace_id, link.span_id) for link in step.links] == [("bb", "02")]
    assert child.parent_id == "01" and child.error and not child.links


def test_a_running_episode_without_its_episode_span_gets_a_placeholder_root() -> None:
    call = Span("t", "c1", "gone", "gateway chat", "harnessrl-gateway", 10, 20,
                {"harnessrl.episode_id": "e9"})  # fmt: skip
    root = build_tree([call], "t")
    assert root.span.name == "(root not exported)"
    assert root.children[0].span is call and root.children[0].orphan
    found = episode_path([call], "e9")
    assert found is not None and found.trace_id == "t" and not found.groups


def _jaeger_span(trace_id: str, span_id: str, name: str, refs: list[tuple[str, str, str]],
                 tags: dict[str, object]) -> dict[str, object]:  # fmt: skip
    return {
        "traceID": trace_id,
        "spanID": span_id,
        "operationName": name,
        "references": [{"refType": r, "traceID": t, "spanID": s} for r, t, s in refs],
        "startTime": 1_700_000_000_000_000,
        "duration": 1_000,
        "tags": [{"key": k, "value": v} for k, v in tags.items()],
        "processID": "p1",
    }


@pytest.fixture
def jaeger() -> Iterator[tuple[str, list[dict[str, list[str]]]]]:
    """A stand-in for Jaeger's query API (`GET /api/traces`), which cannot run here: it
    answers each search with canned traces for the service and operation asked."""
    episode = [
        _jaeger_span("e" * 32, "1" * 16, "episode e1", [],
                     {"harnessrl.episode_id": "e1", "harnessrl.group_id": "g1"}),
        _jaeger_span("e" * 32, "2" * 16, "gateway chat", [("CHILD_OF", "e" * 32, "1" * 16)],
                     {"harnessrl.episode_id": "e1"}),
    ]  # fmt: skip
    group = [
        _jaeger_span("a" * 32, "3" * 16, "samples.group", [("FOLLOWS_FROM", "e" * 32, "2" * 16)],
                     {"harnessrl.group_id": "g1"}),
    ]  # fmt: skip
    steps = [
        _jaeger_span("b" * 32, "4" * 16, "trainer.step", [("FOLLOWS_FROM", "a" * 32, "3" * 16)],
                     {"harnessrl.step": 5}),
        _jaeger_span("c" * 32, "5" * 16, "trainer.step", [("FOLLOWS_FROM", "f" * 32, "6" * 16)],
                     {"harnessrl.step": 6}),
    ]  # fmt: skip
    answers = {
        "harnessrl-controller": [episode],
        "harnessrl-sample-builder": [group],
        "harnessrl-trainer": [[s] for s in steps],
    }
    queries: list[dict[str, list[str]]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            query = urllib.parse.parse_qs(url.query)
            queries.append(query)
            traces = answers.get(query["service"][0], []) if url.path == "/api/traces" else []
            processes = {"p1": {"serviceName": query["service"][0]}}
            data = [
                {"traceID": t[0]["traceID"], "spans": t, "processes": processes} for t in traces
            ]
            body = json.dumps({"data": data}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", queries
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_jaeger_without_a_span_file_finds_the_traces_through_its_query_api(
    jaeger: tuple[str, list[dict[str, list[str]]]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, queries = jaeger
    assert main(["trace", "e1", "--jaeger", url]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"episode e1  {url}/trace/{'e' * 32}",
        f"samples.group g1  {url}/trace/{'a' * 32}",
        f"trainer.step 5  {url}/trace/{'b' * 32}",
    ]
    assert json.loads(queries[0]["tags"][0]) == {"harnessrl.episode_id": "e1"}
    assert json.loads(queries[1]["tags"][0]) == {"harnessrl.group_id": "g1"}
    assert queries[2]["operation"] == ["trainer.step"]


def test_jaeger_unknown_episode_exits_1(
    jaeger: tuple[str, list[dict[str, list[str]]]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = jaeger
    assert main(["trace", "nope", "--jaeger", url]) == 1
    assert f"Jaeger at {url}" in capsys.readouterr().err


def test_a_production_sessions_thumbs_up_leads_to_the_step_that_used_it() -> None:
    """A session's trace has no root span (its parent id is derived from the session, and no
    service records it): its calls, its feedback and its group hang from the session, not
    as orphans, and the step that trained the group is linked."""
    from harnessrl.production import session_traceparent

    _, trace_id, session_span, _ = session_traceparent("desk", "t-1").split("-")

    def span(span_id: str, name: str, start: int, **kw: object) -> Span:
        return Span(
            kw.pop("trace", trace_id),  # type: ignore[arg-type]
            span_id,
            kw.pop("parent", session_span),  # type: ignore[arg-type]
            name,
            kw.pop("service", "svc"),  # type: ignore[arg-type]
            start,
            start + 10,
            kw.pop("attributes", {}),  # type: ignore[arg-type]
            kw.pop("links", ()),  # type: ignore[arg-type]
        )

    group = "s.desk.t-1"
    spans = [
        span("a" * 16, "gateway chat", 1, attributes={"harnessrl.episode_id": group}),
        span("b" * 16, "feedback.signal", 2, attributes={"harnessrl.feedback.name": "thumbs"}),
        span(
            "c" * 16,
            "samples.session",
            3,
            attributes={"harnessrl.group_id": group},
            links=(TreeLink(trace_id, "a" * 16),),
        ),
        span(
            "d" * 16,
            "trainer.step",
            4,
            trace="e" * 32,
            parent="",
            attributes={"harnessrl.step": 3},
            links=(TreeLink(trace_id, "c" * 16),),
        ),
    ]
    found = episode_path(spans, group)
    assert found is not None and [s.name for s in found.steps] == ["trainer.step"]
    text = render(found)
    assert "(production session)" in text and "orphan" not in text
    assert "feedback.signal" in text and "name=thumbs" in text and "step=3" in text
