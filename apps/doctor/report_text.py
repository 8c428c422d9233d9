"""A doctor report in plain text: the terminal summary, the JSON file, and the way a figure
is written in words (report_html.py writes its tables with the same words).

The input is the plain report mapping `doctor.analyze` returns (every key present, lists
possibly empty, numbers possibly None when there was no data); nothing else is read.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

WIDTH = 100
"""The terminal summary's line width; detail and fix text is wrapped to it."""


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
    lines.append(verdict_line(report))
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
        f"  episodes {run['episodes']} ({run['mode']}, {figure_text(run['minutes'])} min)   "
        f"calls/episode mean {figure_text(merging['calls_per_episode']['mean'])}   "
        f"chains/episode mean {figure_text(merging['chains_per_episode']['mean'])}",
        f"  trained share {figure_text(tokens['trained_share'], '.2f')}   "
        f"overhead {'-' if overhead is None else f'{overhead:.2f}x'}   "
        f"tool calls/episode mean {figure_text(tools['tool_calls_per_episode']['mean'])}",
        f"  reward mean {figure_text(outcome['reward']['mean'])}   zero-variance groups "
        f"{outcome['zero_variance_groups']} of {outcome['groups']}",
    ]


def verdict_line(report: Mapping[str, Any]) -> str:
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


def figure_text(value: Any, spec: str = ".4g") -> str:
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


def in_words(value: Any) -> str:
    """A figure, a list, or a count map such as {'200': 12} (nested too) as one line of text."""
    if isinstance(value, Mapping):
        if not value:
            return "none"
        return ", ".join(
            f"{k}: ({in_words(v)})" if isinstance(v, Mapping) else f"{k}: {figure_text(v)}"
            for k, v in value.items()
        )
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return figure_text(value)
