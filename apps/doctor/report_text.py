"""Render a doctor report as a terminal summary, a self-contained HTML page, and JSON.

The input is the plain report mapping `doctor.analyze` returns (every key present, lists
possibly empty, numbers possibly None when there was no data). Rendering is pure: it reads
nothing but the report. matplotlib is imported on first use, so importing this module
stays cheap.
"""

from __future__ import annotations

import base64
import html
import io
import json
import textwrap
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

WIDTH = 100
"""The terminal summary's line width; detail and fix text is wrapped to it."""

MAX_EPISODES_DRAWN = 50
"""The context-growth plot draws at most this many episodes, so it stays readable."""

SECTIONS = ("merging", "tokens", "tools", "wire", "outcome")
"""The report's sections, in the order checks and tables are shown."""

_CHECK_FIELDS = ("verdict", "id", "title", "value", "threshold", "detail", "fix")

_STATS_KEYS = frozenset({"n", "mean", "p50", "p90", "max", "min"})

_OWN_TABLES = frozenset(
    {"top_break", "break_points", "unparsed_examples", "overrides", "errors", "context", "rewards"}
)
"""Section keys shown in tables or plots of their own, not in the section's figures."""

_HELP = {
    "Verdicts": "ok: this will train as expected; warn: it will train, but something wastes "
    "tokens or signal; fail: training on this would be wrong or useless until fixed; n/a: the "
    "run had nothing to measure. The page's verdict is the worst check's.",
    "Merging": "Each model call should extend the chain its episode already has, so the "
    "whole episode trains as one sequence. A break starts a new chain; the top break shows, "
    "side by side, the text the harness sent and the text recorded earlier, where they differ.",
    "Tokens": "Overhead is the tokens the merged chains run through the model over the least "
    "any merge could (1.0 is perfect). Trained share is the completion tokens trained over "
    "those captured; the rest were dropped for the reasons listed.",
    "Tools": "Markup calls are completions that look like tool calls; unparsed ones carried "
    "markup the gateway could not turn into a tool call, so the harness never saw the call.",
    "Wire": "What the harness asked of the gateway: dialects, routes and their errors, "
    "sampling fields training overrode, and how close calls came to the context limit.",
    "Context per call": "Prompt plus completion tokens of each call against its place in its "
    "episode, one line per episode; the dashed line is the model's context limit.",
    "Break positions": "Each dot is one chain break: the call it happened in and the token "
    "where the prompt first differed from the recorded context, coloured by its cause.",
    "Rewards": "The distribution of episode rewards. A group whose episodes all got the same "
    "reward has no advantage to learn from; the title counts those groups.",
}
"""A sentence or three per part of the page, for the HTML's "How to read this"."""

_CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:2px 8px;vertical-align:top}"
    "th{background:#f4f4f4;text-align:left}img{max-width:100%}"
    ".banner{padding:0.6em 1em;font-size:1.3em;font-weight:bold;border-radius:4px}"
    ".v-ok{background:#d4edd4}.v-warn{background:#ffe6a8}.v-fail{background:#f6c4c4}"
    ".v-na{background:#e6e6e6;color:#666}.none{color:#888}"
    ".pair{display:flex;gap:1em}.pair>div{flex:1;min-width:0}"
    "pre{background:#f7f7f7;border:1px solid #ddd;padding:6px;white-space:pre-wrap;"
    "word-break:break-all;max-height:30em;overflow:auto}"
)


def summary(report: Mapping[str, Any]) -> str:
    """The terminal summary: one line per check (warn and fail ones with their detail and
    fix below), a few headline figures, and a last line `verdict: WARN (2 warn, 0 fail)`.

    Plain text without colour codes, lines wrapped to WIDTH where they can be.
    """
    run = report["run"]
    header = f"harnessrl doctor: {run['config']} ({run['mode']}, tasks {run['tasks']}, "
    lines = _wrap(f"{header}stack {run['stack']})", "", "    ")
    checks = report["checks"]
    id_width = max((len(str(c["id"])) for c in checks), default=0)
    for check in checks:
        lines.extend(_check_lines(check, id_width))
    lines.append("" if checks else "  no checks ran")
    lines.extend(_headline_lines(report))
    lines.append(_verdict_line(report))
    return "\n".join(lines)


def _check_lines(check: Mapping[str, Any], id_width: int) -> list[str]:
    head = f"  {check['verdict']:<4} {check['id']:<{id_width}}  {check['title']}: {check['value']}"
    pad = " " * (9 + id_width)
    threshold = f"({check['threshold']})" if check["threshold"] else ""
    if len(head) + 2 + len(threshold) <= WIDTH:
        lines = [f"{head}  {threshold}".rstrip()]
    else:
        lines = [head, *_wrap(threshold, pad, pad)]
    if check["verdict"] in ("warn", "fail"):
        fix = f"fix: {check['fix']}" if check["fix"] else ""
        for text, hang in ((check["detail"], pad), (fix, pad + "     ")):
            lines.extend(_wrap(text, pad, hang))
    return lines


def _wrap(text: str, indent: str, hang: str) -> list[str]:
    """`text` wrapped to WIDTH at spaces only, so paths and identifiers stay whole."""
    return textwrap.wrap(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=hang,
        break_long_words=False,
        break_on_hyphens=False,
    )


def _headline_lines(report: Mapping[str, Any]) -> list[str]:
    run, merging, tokens = report["run"], report["merging"], report["tokens"]
    tools, outcome = report["tools"], report["outcome"]
    overhead = tokens["overhead"]
    return [
        f"  episodes {run['episodes']} ({run['mode']}, {_num(run['minutes'])} min)   "
        f"calls/episode mean {_num(merging['calls_per_episode']['mean'])}   "
        f"chains/episode mean {_num(merging['chains_per_episode']['mean'])}",
        f"  trained share {_num(tokens['trained_share'], '.2f')}   "
        f"overhead {'-' if overhead is None else f'{overhead:.2f}x'}   "
        f"tool calls/episode mean {_num(tools['tool_calls_per_episode']['mean'])}",
        f"  reward mean {_num(outcome['reward']['mean'])}   zero-variance groups "
        f"{outcome['zero_variance_groups']} of {outcome['groups']}",
    ]


def _verdict_line(report: Mapping[str, Any]) -> str:
    counts = Counter(str(c["verdict"]) for c in report["checks"])
    return (
        f"verdict: {str(report['verdict']).upper()} ({counts['warn']} warn, {counts['fail']} fail)"
    )


def write_json(report: Mapping[str, Any], path: Path) -> Path:
    """Write `report` as indented JSON with a trailing newline; creates the parent directory,
    overwrites the file, and returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return path


def write_html(report: Mapping[str, Any], path: Path) -> Path:
    """Write `report` as one self-contained HTML page (plots embedded as base64 PNGs);
    creates the parent directory, overwrites the file, and returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_render_html(report), encoding="utf-8")
    return path


def _render_html(report: Mapping[str, Any]) -> str:
    verdict = str(report["verdict"])
    help_items = "".join(
        f"<li><b>{html.escape(name)}</b>: {html.escape(text)}</li>" for name, text in _HELP.items()
    )
    extras: dict[str, list[str]] = {
        "merging": [
            _image("break positions", _png(lambda ax: _plot_breaks(ax, report["merging"]))),
            "<h3>Top break</h3>",
            _top_break(report["merging"]["top_break"]),
        ],
        "tools": ["<h3>Unparsed tool calls</h3>", _unparsed(report["tools"]["unparsed_examples"])],
        "wire": [
            _image("context per call", _png(lambda ax: _plot_context(ax, report["wire"]))),
            "<h3>Overrides</h3>",
            _overrides(report["wire"]["overrides"]),
            "<h3>Errors</h3>",
            _errors(report["wire"]["errors"]),
        ],
        "outcome": [_image("rewards", _png(lambda ax: _plot_rewards(ax, report["outcome"])))],
    }
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>harnessrl doctor</title>",
        f"<style>{_CSS}</style></head><body><h1>harnessrl doctor</h1>",
        f"<div class='banner {_verdict_class(verdict)}'>{html.escape(_verdict_line(report))}</div>",
        _table(["", "value"], _run_rows(report["run"])),
        "<h2>Checks</h2>",
        _table(_CHECK_FIELDS, [[str(c[f]) for f in _CHECK_FIELDS] for c in report["checks"]], 0),
    ]
    for name in SECTIONS:
        parts.append(f"<h2>{name.capitalize()}</h2>")
        parts.extend(_section_tables(report[name]))
        parts.extend(extras.get(name, []))
    parts += [f"<h2>How to read this</h2><ul>{help_items}</ul>", "</body></html>\n"]
    return "\n".join(parts)


def _verdict_class(verdict: str) -> str:
    return "v-" + html.escape(verdict.replace("/", ""), quote=True)


def _num(value: Any, spec: str = ".4g") -> str:
    """A figure in words: '-' for no data, yes/no, ints with separators, floats by `spec`
    (4 significant digits unless told; whole numbers from 10,000 on)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return format(value, spec) if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _words(value: Any) -> str:
    """A figure, a list, or a count map such as {'200': 12} (nested too) as one line of text."""
    if isinstance(value, Mapping):
        if not value:
            return "none"
        return ", ".join(
            f"{k}: ({_words(v)})" if isinstance(v, Mapping) else f"{k}: {_num(v)}"
            for k, v in value.items()
        )
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return _num(value)


def _is_stats(value: Any) -> bool:
    return isinstance(value, Mapping) and set(value) == _STATS_KEYS


def _table(
    headers: Sequence[str], rows: Sequence[Sequence[str]], verdict_col: int | None = None
) -> str:
    """An HTML table of escaped text (column `verdict_col` coloured by the verdict it holds),
    or a 'no data' line when there are no rows."""
    if not rows:
        return "<p class=none>no data</p>"

    def cell(i: int, text: str) -> str:
        colour = f" class='{_verdict_class(text)}'" if i == verdict_col else ""
        return f"<td{colour}>{html.escape(text)}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(f"<tr>{''.join(cell(i, c) for i, c in enumerate(row))}</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _run_rows(run: Mapping[str, Any]) -> list[list[str]]:
    started = datetime.fromtimestamp(float(run["started_at"]), tz=UTC)
    keys = ("config", "tasks", "mode", "stack", "episodes", "minutes")
    return [[key, _num(run[key])] for key in keys] + [
        ["started (UTC)", started.strftime("%Y-%m-%dT%H:%M:%SZ")]
    ]


def _section_tables(section: Mapping[str, Any]) -> list[str]:
    """A section's headline figures, then its distributions (n, mean, percentiles)."""
    shown = {k: v for k, v in section.items() if k not in _OWN_TABLES}
    figures = [[k.replace("_", " "), _words(v)] for k, v in shown.items() if not _is_stats(v)]
    stats = [
        [k.replace("_", " ")] + [_num(v[q]) for q in ("n", "mean", "p50", "p90", "min", "max")]
        for k, v in shown.items()
        if _is_stats(v)
    ]
    return [
        _table(["", "value"], figures),
        _table(["distribution", "n", "mean", "p50", "p90", "min", "max"], stats),
    ]


def _top_break(top: Mapping[str, Any] | None) -> str:
    if top is None:
        return "<p class=none>no breaks</p>"
    fields = ("kind", "count", "episode_id", "seq", "nearest_seq", "position", "role", "line")
    table = _table([f.replace("_", " ") for f in fields], [[_num(top[f]) for f in fields]])
    windows = "".join(
        f"<div><b>{key}</b><pre>{html.escape(str(top[key]))}</pre></div>"
        for key in ("sent", "recorded")
    )
    return (
        f"{table}<div class=pair>{windows}</div>"
        f"<p><b>cause</b>: {html.escape(str(top['cause']))}</p>"
        f"<p><b>fix</b>: {html.escape(str(top['fix']))}</p>"
    )


def _unparsed(examples: Sequence[Mapping[str, Any]]) -> str:
    if not examples:
        return "<p class=none>none</p>"
    return "".join(
        f"<p>episode {html.escape(str(e['episode_id']))}, call {html.escape(str(e['seq']))}, "
        f"finish reason {html.escape(str(e['finish_reason']))}</p>"
        f"<pre>{html.escape(str(e['text']))}</pre>"
        for e in examples
    )


def _overrides(overrides: Sequence[Mapping[str, Any]]) -> str:
    fields = ("field", "calls", "harness_values", "train")
    rows = [[_words(o[f]) for f in fields] for o in overrides]
    return _table(["field", "calls", "harness values", "in training"], rows)


def _errors(errors: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [
        [str(route), str(status), _num(count)]
        for route, by_status in errors.items()
        for status, count in by_status.items()
    ]
    return _table(["route", "status", "requests"], rows)


def _image(alt: str, png: str) -> str:
    return f"<img alt='{html.escape(alt, quote=True)}' src=\"data:image/png;base64,{png}\">"


def _png(draw: Callable[[Axes], None]) -> str:
    """Draw one panel and return it as base64 PNG."""
    # A bare Figure, not pyplot: nothing is registered in pyplot's global figure list, and
    # savefig renders PNG through Agg whatever backend the process has selected.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 3.8), dpi=100, layout="constrained")
    draw(fig.subplots())
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _placeholder(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", color="grey", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _whole_numbers(ax: Axes) -> None:
    """Tick call seqs and token counts at whole numbers only (never at 2.25 calls)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _plot_context(ax: Axes, wire: Mapping[str, Any]) -> None:
    by_episode: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
    for point in wire["context"]:
        by_episode[int(point["episode"])].append((int(point["seq"]), int(point["tokens"])))
    drawn = sorted(by_episode)[:MAX_EPISODES_DRAWN]
    capped = len(by_episode) > len(drawn)
    drawn_note = f" ({len(drawn)} of {len(by_episode)} episodes drawn)" if capped else ""
    ax.set_title("Context per call" + drawn_note)
    if not drawn:
        _placeholder(ax, "no data")
        return
    for episode in drawn:
        seqs, tokens = zip(*sorted(by_episode[episode]), strict=True)
        ax.plot(seqs, tokens, ".-", markersize=3, linewidth=0.8, alpha=0.6)
    limit = wire["context_limit"]
    largest = max(int(p["tokens"]) for p in wire["context"])
    if limit is not None and largest >= int(limit) / 4:
        ax.axhline(int(limit), linestyle="--", color="C3", label=f"context limit {int(limit):,}")
        ax.legend(loc="upper left", fontsize=8)
    elif limit is not None:  # far below the limit: drawing it would flatten every line
        ax.set_title(f"Context per call{drawn_note} (limit {int(limit):,}, off the scale)")
    ax.set_xlabel("call seq")
    ax.set_ylabel("prompt + completion tokens")
    _whole_numbers(ax)


def _plot_breaks(ax: Axes, merging: Mapping[str, Any]) -> None:
    points = merging["break_points"]
    ax.set_title(f"Break positions ({len(points)} breaks)")
    if not points:
        _placeholder(ax, "no breaks")
        return
    by_kind: defaultdict[str, list[tuple[int, int]]] = defaultdict(list)
    for point in points:
        by_kind[str(point["kind"])].append((int(point["seq"]), int(point["position"])))
    for kind, at in sorted(by_kind.items()):
        seqs, positions = zip(*at, strict=True)
        ax.scatter(seqs, positions, s=12, alpha=0.6, label=f"{kind} ({len(at)})")
    ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("call seq")
    ax.set_ylabel("break position (token)")
    _whole_numbers(ax)


def _plot_rewards(ax: Axes, outcome: Mapping[str, Any]) -> None:
    ax.set_title(
        f"Rewards ({outcome['zero_variance_groups']} of {outcome['groups']} groups zero-variance)"
    )
    rewards = [float(r) for r in outcome["rewards"]]
    if not rewards:
        _placeholder(ax, "no data")
        return
    ax.hist(rewards, bins=20, color="C2")
    ax.set_xlabel("reward")
    ax.set_ylabel("episodes")
