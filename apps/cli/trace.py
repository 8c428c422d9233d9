"""`harnessrl trace EPISODE_ID`: one episode's path, from its model calls to the gradient
steps that trained on them, read from stored spans or from a Jaeger."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harnessrl.command import CliError
from harnessrl.registry import BY_NAME

if TYPE_CHECKING:
    from harnessrl.telemetry.tracetree import Span

DEFAULT_SPANS = Path(".harnessrl/traces.jsonl")
"""Where services write spans with `telemetry.exporter: jsonl` (telemetry.jsonl_path's
default), and where `harnessrl up`'s local OTLP receiver is to store them."""

# Service names as the services' tracer providers set them (`harnessrl-<service>`).
_CONTROLLER, _GATEWAY = BY_NAME["controller"].tracer_name, BY_NAME["gateway"].tracer_name
_SAMPLE_BUILDER, _TRAINER = BY_NAME["sample-builder"].tracer_name, BY_NAME["trainer"].tracer_name
_STEP_WINDOW_US = 3600 * 1_000_000  # steps are searched for up to 1 h after the group
_LOOKBACK_US = 7 * 24 * 3600 * 1_000_000


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "trace",
        help="show an episode's path from model calls to gradient steps",
        description="Print the episode's trace as a tree (episode span, model calls, reward), "
        "then the sample-builder group span linked to its calls and the trainer step spans "
        "linked to that group. Spans come from OTLP-JSON-lines files (what `harnessrl up` "
        "stores), or with --jaeger from a Jaeger query API, printing trace URLs.",
    )
    parser.add_argument("episode_id", metavar="EPISODE_ID")
    parser.add_argument(
        "--spans",
        type=Path,
        nargs="+",
        metavar="FILE",
        help=f"OTLP-JSON-lines span files (default: {DEFAULT_SPANS})",
    )
    parser.add_argument(
        "--jaeger",
        metavar="URL",
        help="Jaeger UI/query base URL, e.g. http://localhost:16686: print the URLs of the "
        "episode, group and step traces (spans are looked up there unless --spans is given)",
    )
    parser.add_argument("--json", action="store_true", help="print the tree as JSON")
    parser.add_argument(
        "--all", action="store_true", help="show the Kafka `<topic> process` spans too"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.telemetry import tracetree

    if args.jaeger and not args.spans:
        spans, source = _jaeger_spans(args.jaeger, args.episode_id), f"Jaeger at {args.jaeger}"
    else:
        paths = args.spans or [DEFAULT_SPANS]
        spans, source = _file_spans(paths), ", ".join(str(p) for p in paths)
    path = tracetree.episode_path(spans, args.episode_id)
    if path is None:
        print(
            f"harnessrl: error: no span names episode {args.episode_id!r} in {source}",
            file=sys.stderr,
        )
        return 1
    if args.jaeger:
        links = tracetree.jaeger_links(path, args.jaeger)
        if args.json:
            print(json.dumps([{"what": label, "url": url} for label, url in links], indent=2))
        else:
            for label, url in links:
                print(f"{label}  {url}")
    elif args.json:
        print(json.dumps(tracetree.to_json(path, all_spans=args.all), indent=2, default=str))
    else:
        print(tracetree.render(path, all_spans=args.all))
    return 0


def _file_spans(paths: list[Path]) -> list[Span]:
    from harnessrl.telemetry.jsonl import read_spans
    from harnessrl.telemetry.tracetree import from_otlp

    spans: list[Span] = []
    for path in paths:
        if not path.is_file():
            raise CliError(
                f"{path}: no such span file (services write {DEFAULT_SPANS} with "
                "HARNESSRL_TELEMETRY__EXPORTER=jsonl; for spans sent to a Jaeger use --jaeger URL)"
            )
        spans.extend(from_otlp(s) for s in read_spans(path))
    return spans


def _jaeger_spans(base: str, episode_id: str) -> list[Span]:
    """The episode's trace, its group traces and the step traces that may link to them, from
    Jaeger's query API. Steps are searched for in the hour after each group span started."""
    from harnessrl.telemetry.tracetree import EPISODE_ID, GROUP_ID, episode_trace

    now_us = int(time.time() * 1_000_000)
    since_us = now_us - _LOOKBACK_US
    spans: list[Span] = []
    for service in (_CONTROLLER, _GATEWAY):  # a running episode has no episode span yet
        tags = {EPISODE_ID: episode_id}
        spans = _query(base, service, tags=tags, start_us=since_us, end_us=now_us)
        if episode_trace(spans, episode_id) is not None:
            break
    trace_id = episode_trace(spans, episode_id)
    if trace_id is None:
        return spans
    members = [s for s in spans if s.trace_id == trace_id]
    group_ids = {s.attributes[GROUP_ID] for s in members if GROUP_ID in s.attributes}
    start_us = min(s.start_ns for s in members) // 1000
    groups: list[Span] = []
    for group_id in sorted(group_ids):
        groups += _query(
            base,
            _SAMPLE_BUILDER,
            operation="samples.group",
            tags={GROUP_ID: str(group_id)},
            start_us=start_us,
            end_us=now_us,
        )
    steps: list[Span] = []
    for built_us in {s.start_ns // 1000 for s in groups if s.name == "samples.group"}:
        end_us = min(built_us + _STEP_WINDOW_US, now_us)
        steps += _query(
            base,
            _TRAINER,
            operation="trainer.step",
            start_us=built_us,
            end_us=end_us,
            limit=1000,
        )
    return spans + groups + steps


def _query(
    base: str,
    service: str,
    *,
    operation: str | None = None,
    tags: dict[str, str] | None = None,
    start_us: int,
    end_us: int,
    limit: int = 20,
) -> list[Span]:
    import httpx

    from harnessrl.telemetry.tracetree import from_jaeger

    params: dict[str, str | int] = {
        "service": service,
        "start": start_us,
        "end": end_us,
        "limit": limit,
    }
    if operation:
        params["operation"] = operation
    if tags:
        params["tags"] = json.dumps(tags)
    url = f"{base.rstrip('/')}/api/traces"
    try:
        response = httpx.get(url, params=params, timeout=30)
        response.raise_for_status()
        data = response.json()
    except httpx.HTTPStatusError as err:
        status = err.response
        raise CliError(
            f"Jaeger query {err.request.url} answered {status.status_code} {status.reason_phrase}"
        ) from err
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as err:
        raise CliError(f"Jaeger at {base} cannot be reached: {err}") from err
    return [span for trace in data.get("data") or () for span in from_jaeger(trace)]
