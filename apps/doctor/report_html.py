"""The doctor report as one self-contained HTML page: the verdict banner, the checks, each
section's figures and distributions, its own tables (top break, unparsed calls, overrides,
errors) and plots (report_plots.py, embedded as base64 PNGs), and how to read it all.

The input is the plain report mapping `doctor.analyze` returns; rendering reads nothing
else.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harnessrl.apps.doctor.report_plots import plot_breaks, plot_context, plot_rewards, png
from harnessrl.apps.doctor.report_text import figure_text, in_words, verdict_line

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
            _image("break positions", png(lambda ax: plot_breaks(ax, report["merging"]))),
            "<h3>Top break</h3>",
            _top_break(report["merging"]["top_break"]),
        ],
        "tools": ["<h3>Unparsed tool calls</h3>", _unparsed(report["tools"]["unparsed_examples"])],
        "wire": [
            _image("context per call", png(lambda ax: plot_context(ax, report["wire"]))),
            "<h3>Overrides</h3>",
            _overrides(report["wire"]["overrides"]),
            "<h3>Errors</h3>",
            _errors(report["wire"]["errors"]),
        ],
        "outcome": [_image("rewards", png(lambda ax: plot_rewards(ax, report["outcome"])))],
    }
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>harnessrl doctor</title>",
        f"<style>{_CSS}</style></head><body><h1>harnessrl doctor</h1>",
        f"<div class='banner {_verdict_class(verdict)}'>{html.escape(verdict_line(report))}</div>",
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
    return [[key, figure_text(run[key])] for key in keys] + [
        ["started (UTC)", started.strftime("%Y-%m-%dT%H:%M:%SZ")]
    ]


def _section_tables(section: Mapping[str, Any]) -> list[str]:
    """A section's headline figures, then its distributions (n, mean, percentiles)."""
    shown = {k: v for k, v in section.items() if k not in _OWN_TABLES}
    figures = [[k.replace("_", " "), in_words(v)] for k, v in shown.items() if not _is_stats(v)]
    stats = [
        [k.replace("_", " ")]
        + [figure_text(v[q]) for q in ("n", "mean", "p50", "p90", "min", "max")]
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
    table = _table([f.replace("_", " ") for f in fields], [[figure_text(top[f]) for f in fields]])
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
    rows = [[in_words(o[f]) for f in fields] for o in overrides]
    return _table(["field", "calls", "harness values", "in training"], rows)


def _errors(errors: Mapping[str, Mapping[str, Any]]) -> str:
    rows = [
        [str(route), str(status), figure_text(count)]
        for route, by_status in errors.items()
        for status, count in by_status.items()
    ]
    return _table(["route", "status", "requests"], rows)


def _image(alt: str, png: str) -> str:
    return f"<img alt='{html.escape(alt, quote=True)}' src=\"data:image/png;base64,{png}\">"
