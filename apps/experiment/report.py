"""Render one experiment run's metrics as a PNG dashboard and a self-contained HTML page.

The input is the plain `metrics` mapping the experiment driver collects (schema in
`write_report`). Rendering is pure: it reads nothing but `metrics` and writes two files.
matplotlib is imported on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

BUCKET_S = 15.0
"""Width, in seconds, of the buckets the throughput panel averages over."""

_HELP = {
    "Train reward": "Each dot is one training episode's reward, placed at the minute it "
    "finished; the line is a trailing mean. Dotted verticals mark trainer steps.",
    "Val success": "Success rate on the validation set before and after training; the gap "
    "between the bars is what the run bought.",
    "Throughput": "Episodes finished per second (left axis) and model tokens, prompt plus "
    f"completion, per second (right axis), averaged over {BUCKET_S:.0f}-second buckets.",
    "Staleness": "How many policy versions behind the trainer each trained sample was; "
    "samples too stale to use are counted in the title and were not trained on.",
    "Trainer": "Loss (left axis) and policy entropy (right axis) per optimizer step; "
    "entropy falling to zero fast usually means the policy collapsed.",
    "Groups and merging": "What happened to each group of episodes (only emitted groups "
    "reach the trainer), how model calls were merged into training sequences (chains; a "
    "break starts a new one, by class), and the token books of every group, val and "
    "zero-variance ones included: completion tokens captured = trained + dropped by reason.",
}
"""One or two sentences per dashboard panel, for the HTML's "How to read this"."""

_CSS = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:2em;color:#222}"
    "table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "th,td{border:1px solid #ccc;padding:2px 8px}th{background:#f4f4f4;text-align:left}"
    "td.num{text-align:right;font-variant-numeric:tabular-nums}img{max-width:100%}"
)


def write_report(metrics: Mapping[str, Any], run_dir: Path) -> tuple[Path, Path]:
    """Write run_dir/report.png and run_dir/report.html (self-contained) from `metrics`.

    `metrics` holds `run_id`, `config`, `started_at` (unix s), `val_before`/`val_after`
    (`success`, `episodes`, `versions`, `by_kind`), `train` (`episodes`, `calls`, `steps`,
    `staleness`, `groups`, `merge`), `summary` and `trace_hint`; every key is present, lists
    may be empty and per-step numbers may be None. Times in `train` are seconds since
    training started. Creates `run_dir` if needed, overwrites both files, and returns
    (html_path, png_path).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    png_path = run_dir / "report.png"
    html_path = run_dir / "report.html"
    _render_png(metrics, png_path)
    html_path.write_text(_render_html(metrics, png_path.read_bytes()), encoding="utf-8")
    return html_path, png_path


def _render_png(metrics: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    # A bare Figure, not pyplot: nothing is registered in pyplot's global figure list, so
    # nothing leaks when reports are written repeatedly from a long-lived process.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3).flat
    train = metrics["train"]
    _plot_train_reward(axes[0], train)
    _plot_val(axes[1], metrics["val_before"], metrics["val_after"])
    _plot_throughput(axes[2], train)
    _plot_staleness(axes[3], train["staleness"])
    _plot_trainer(axes[4], train["steps"])
    _plot_groups(axes[5], train["groups"], train["merge"])
    fig.savefig(path, format="png", dpi=100)


def _no_data(ax: Axes) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", color="grey", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (over fewer at the start)."""
    means: list[float] = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        means.append(total / min(i + 1, window))
    return means


def _bucket_rates(
    times: Sequence[float], weights: Sequence[float], horizon_s: float
) -> list[float]:
    """Per-second rate of `weights` in each BUCKET_S bucket covering [0, horizon_s]."""
    sums = [0.0] * (int(horizon_s // BUCKET_S) + 1)
    for t, weight in zip(times, weights, strict=True):
        sums[min(max(int(t // BUCKET_S), 0), len(sums) - 1)] += weight
    return [total / BUCKET_S for total in sums]


def _plot_train_reward(ax: Axes, train: Mapping[str, Any]) -> None:
    ax.set_title("Train reward")
    episodes = sorted(train["episodes"], key=lambda e: float(e["t"]))
    if not episodes:
        _no_data(ax)
        return
    minutes = [float(e["t"]) / 60 for e in episodes]
    rewards = [float(e["reward"]) for e in episodes]
    window = max(8, len(rewards) // 15)
    for step in train["steps"]:
        ax.axvline(float(step["t"]) / 60, linestyle=":", color="grey", alpha=0.3, linewidth=0.8)
    ax.scatter(minutes, rewards, s=8, alpha=0.25, color="C0")
    ax.plot(minutes, _rolling_mean(rewards, window), color="C1", label=f"mean of {window}")
    ax.set_xlabel("minutes since training started")
    ax.set_ylabel("reward")
    ax.legend(loc="lower right", fontsize=8)


def _plot_val(ax: Axes, before: Mapping[str, Any], after: Mapping[str, Any]) -> None:
    ax.set_title("Val success")
    if not before["episodes"] and not after["episodes"]:
        _no_data(ax)
        return
    labels = [f"before\n(n={before['episodes']})", f"after\n(n={after['episodes']})"]
    values = [float(before["success"]), float(after["success"])]
    ax.bar(labels, values, color=["C7", "C2"])
    for x, value in enumerate(values):
        ax.text(x, value + 0.02, f"{value:.2f}", ha="center", va="bottom")
    ax.set_ylim(0, 1)
    ax.set_ylabel("success rate")


def _plot_throughput(ax: Axes, train: Mapping[str, Any]) -> None:
    ax.set_title("Throughput")
    episode_t = [float(e["t"]) for e in train["episodes"]]
    call_t = [float(c["t"]) for c in train["calls"]]
    if not episode_t and not call_t:
        _no_data(ax)
        return
    tokens = [float(c["prompt_tokens"] + c["completion_tokens"]) for c in train["calls"]]
    horizon = max(episode_t + call_t)
    episodes_s = _bucket_rates(episode_t, [1.0] * len(episode_t), horizon)
    tokens_s = _bucket_rates(call_t, tokens, horizon)
    minutes = [(i + 0.5) * BUCKET_S / 60 for i in range(len(episodes_s))]
    ax.plot(minutes, episodes_s, color="C0")
    ax.set_ylabel("episodes/s", color="C0")
    ax.set_xlabel("minutes since training started")
    right = ax.twinx()
    right.plot(minutes, tokens_s, color="C3")
    right.set_ylabel("tokens/s", color="C3")


def _plot_staleness(ax: Axes, staleness: Mapping[str, Any]) -> None:
    ax.set_title(f"Staleness (dropped as stale: {int(staleness['dropped_stale'])})")
    histogram = sorted((int(k), int(v)) for k, v in staleness["histogram"].items())
    if not any(count for _, count in histogram):
        _no_data(ax)
        return
    ax.bar([str(k) for k, _ in histogram], [v for _, v in histogram], color="C4")
    ax.set_xlabel("versions behind")
    ax.set_ylabel("samples")


def _plot_trainer(ax: Axes, steps: Sequence[Mapping[str, Any]]) -> None:
    ax.set_title("Trainer")
    loss = [(int(s["step"]), float(s["loss"])) for s in steps if s["loss"] is not None]
    entropy = [(int(s["step"]), float(s["entropy"])) for s in steps if s["entropy"] is not None]
    if not loss and not entropy:
        _no_data(ax)
        return
    ax.plot([x for x, _ in loss], [y for _, y in loss], marker=".", color="C0")
    ax.set_ylabel("loss", color="C0")
    ax.set_xlabel("step")
    right = ax.twinx()
    right.plot([x for x, _ in entropy], [y for _, y in entropy], marker=".", color="C1")
    right.set_ylabel("entropy", color="C1")


def _plot_groups(ax: Axes, groups: Mapping[str, Any], merge: Mapping[str, Any]) -> None:
    ax.set_title("Groups and merging")
    if not groups and not merge.get("calls"):
        _no_data(ax)
        return
    names = list(groups)
    counts = [int(groups[name]) for name in names]
    ax.barh(names, counts, color="C5")
    ax.invert_yaxis()
    # Leave the right part of the panel free for the merge text.
    ax.set_xlim(0, max([*counts, 1]) * 2.8)
    ax.set_xlabel("groups")
    lines = [f"{key.replace('_', ' '):<21}{int(value):>6}" for key, value in merge.items()]
    ax.text(
        0.42,
        0.97,
        "merge\n" + "\n".join(lines),
        transform=ax.transAxes,
        ha="left",
        va="top",
        family="monospace",
        fontsize=8,
        bbox={"facecolor": "white", "edgecolor": "#ccc", "alpha": 0.9},
    )


def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], text_cols: int = 1) -> str:
    """An HTML table; the first `text_cols` columns are text, the rest right-aligned numbers."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{'' if i < text_cols else ' class=num'}>{html.escape(cell)}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _summary_rows(metrics: Mapping[str, Any]) -> list[list[str]]:
    summary = metrics["summary"]
    before, after = float(summary["val_before"]), float(summary["val_after"])
    started = datetime.fromtimestamp(float(metrics["started_at"]), tz=UTC)
    return [
        ["val success before", f"{before:.3f}"],
        ["val success after", f"{after:.3f}"],
        ["delta", f"{after - before:+.3f}"],
        ["train episodes", str(summary["episodes"])],
        ["trainer steps", str(summary["steps"])],
        ["minutes", f"{float(summary['minutes']):.1f}"],
        ["config", str(metrics["config"])],
        ["started (UTC)", started.strftime("%Y-%m-%dT%H:%M:%SZ")],
    ]


def _step_rows(steps: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    return [
        [
            str(s["step"]),
            str(s["version"]),
            f"{float(s['t']) / 60:.1f}",
            _fmt(s["loss"], ".4f"),
            _fmt(s["entropy"], ".4f"),
            _fmt(s["kl"], ".3g"),
            _fmt(s["clip_fraction"], ".3f"),
            _fmt(s["grad_norm"], ".3g"),
            _fmt(s["tokens_per_second"], ".0f"),
        ]
        for s in steps
    ]


def _kind_rows(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for kind in sorted(set(before) | set(after)):
        b, a = before.get(kind), after.get(kind)
        delta = None if a is None or b is None else a["success"] - b["success"]
        rows.append(
            [
                kind,
                "" if b is None else str(b["n"]),
                "" if b is None else f"{b['success']:.3f}",
                "" if a is None else str(a["n"]),
                "" if a is None else f"{a['success']:.3f}",
                _fmt(delta, "+.3f"),
            ]
        )
    return rows


def _render_html(metrics: Mapping[str, Any], png: bytes) -> str:
    title = html.escape(f"harnessrl run {metrics['run_id']}")
    image = base64.b64encode(png).decode("ascii")
    help_items = "".join(
        f"<li><b>{html.escape(name)}</b>: {html.escape(text)}</li>" for name, text in _HELP.items()
    )
    hint = str(metrics["trace_hint"])
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{title}</title>",
        f"<style>{_CSS}</style></head><body><h1>{title}</h1>",
        _table(["", "value"], _summary_rows(metrics)),
        f"<img alt='run dashboard' src=\"data:image/png;base64,{image}\">",
        "<h2>Trainer steps</h2>",
        _table(
            [
                "step",
                "version",
                "minute",
                "loss",
                "entropy",
                "kl",
                "clip fraction",
                "grad norm",
                "tokens/s",
            ],
            _step_rows(metrics["train"]["steps"]),
            text_cols=0,
        ),
        "<h2>Validation by kind</h2>",
        _table(
            ["kind", "n before", "success before", "n after", "success after", "delta"],
            _kind_rows(metrics["val_before"]["by_kind"], metrics["val_after"]["by_kind"]),
        ),
        f"<h2>How to read this</h2><ul>{help_items}</ul>",
        f"<h2>Traces</h2><p>{html.escape(hint)}</p>" if hint else "",
        "</body></html>\n",
    ]
    return "\n".join(parts)
