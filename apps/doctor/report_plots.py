"""The doctor report's plots, each drawn into one matplotlib panel and returned as a base64
PNG for the HTML page: context per call, break positions, rewards. matplotlib is imported
on first use, so importing this module stays cheap.
"""

from __future__ import annotations

import base64
import io
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes

MAX_EPISODES_DRAWN = 50
"""The context-growth plot draws at most this many episodes, so it stays readable."""


def png(draw: Callable[[Axes], None]) -> str:
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


def plot_context(ax: Axes, wire: Mapping[str, Any]) -> None:
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


def plot_breaks(ax: Axes, merging: Mapping[str, Any]) -> None:
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


def plot_rewards(ax: Axes, outcome: Mapping[str, Any]) -> None:
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
