"""The production demo's figures: the summary line, report.json and report.png.

Pure over what the demo collected: the users' outcomes (what each conversation answered and
whether its user pressed a thumb), the session groups' GroupSamples (their token books), the
trainer's dropped tokens and its step journal. A conversation's exploration is recomputed
from its id (harnessrl.production.explored), as the gateway decided it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from examples.production.users import Outcome

from harnessrl.production import explored
from harnessrl.services.trainer.journal import StepRecord
from harnessrl.v1 import events_pb2 as pb

BUCKET_S = 30.0
"""Width of the success-over-time buckets, in seconds."""
EDGE = 0.2
"""Share of the greedy conversations (by time) that make "early" and "late"."""
MIN_BUCKET = 10
"""Fewest conversations a bucket needs for its success rate to be shown."""


@dataclass(frozen=True, slots=True)
class Measured:
    captured: int
    """Completion tokens of the app's sessions on hrl.calls (each call once)."""
    builder: Mapping[str, float]
    """The sample builder's harnessrl_samples_completion_tokens_total by outcome (trained
    or the reason it dropped them): the sessions it decided."""
    groups: list[pb.GroupSamples]
    """The GroupSamples of the app's sessions on hrl.samples."""
    trainer_dropped: Mapping[str, float]
    """harnessrl_trainer_tokens_dropped_total by reason."""
    steps: list[StepRecord]
    """The steps of the trainer's journal that count as trained (journal.trained)."""


def _rate(outcomes: Sequence[Outcome]) -> float | None:
    return round(sum(o.correct for o in outcomes) / len(outcomes), 3) if outcomes else None


def summarise(
    outcomes: Sequence[Outcome],
    measured: Measured,
    *,
    app: str,
    share: float,
    started: float,
    ended: float,
) -> dict[str, Any]:
    """The report's data: "summary" (the demo's last line), "timeline", "by_kind",
    "books" and "steps". `app` and `share` are the app's name and exploration share."""
    ordered = sorted(outcomes, key=lambda o: o.answered_at)
    greedy = [o for o in ordered if not explored(app, o.conversation, share)]
    sampled = [o for o in ordered if explored(app, o.conversation, share)]
    edge = max(1, int(len(greedy) * EDGE))
    early, late = greedy[:edge], greedy[-edge:]
    accepted = [o for o in ordered if o.thumbs_status == 202 and o.thumbs_at is not None]
    delays = [o.thumbs_at - o.answered_at for o in accepted if o.thumbs_at is not None]
    summary = {
        "greedy_early": _rate(early),
        "greedy_late": _rate(late),
        "sessions": len(ordered),
        "feedback_coverage": round(len(accepted) / len(ordered), 3) if ordered else 0.0,
        "feedback_delay_s": round(statistics.median(delays), 2) if delays else None,
        "steps": len(measured.steps),
        "minutes": round((ended - started) / 60, 2),
    }
    first = ordered[0].asked_at if ordered else started
    return {
        "summary": summary,
        "app": app,
        "exploration": share,
        "explored_sessions": len(sampled),
        "greedy_sessions": len(greedy),
        "timeline": _timeline(greedy, sampled, first),
        "by_kind": {
            kind: {
                "early": _rate([o for o in early if o.kind == kind]),
                "late": _rate([o for o in late if o.kind == kind]),
            }
            for kind in sorted({o.kind for o in greedy})
        },
        "books": books(measured),
        "steps": [
            {"step": s.step, "version": s.version, "samples": len(s.samples), "at_s": s.at - first}
            for s in measured.steps
        ],
    }


def _timeline(
    greedy: Sequence[Outcome], sampled: Sequence[Outcome], first: float
) -> list[dict[str, Any]]:
    """Success per BUCKET_S of answers, greedy (as asked) and explored (sampled)."""
    last = max((o.answered_at for o in (*greedy, *sampled)), default=first)
    buckets = []
    for i in range(int((last - first) // BUCKET_S) + 1):
        low, high = first + i * BUCKET_S, first + (i + 1) * BUCKET_S
        g = [o for o in greedy if low <= o.answered_at < high]
        e = [o for o in sampled if low <= o.answered_at < high]
        buckets.append(
            {"at_s": i * BUCKET_S, "greedy": _rate(g), "greedy_n": len(g)}
            | {"explored": _rate(e), "explored_n": len(e)}
        )
    if buckets and buckets[-1]["greedy_n"] < MIN_BUCKET:
        buckets.pop()  # the last few answers, after the users stopped asking
    return buckets


def books(measured: Measured) -> dict[str, Any]:
    """Completion tokens of the app's sessions: captured = trained + dropped (by reason) +
    pending + undecided. The sample builder drops what it does not train (not_explored,
    reward_missing, ...); of what it kept, the trainer trained some in the steps of its
    journal, dropped some (`trainer:<reason>`), and held the rest in a batch not yet stepped
    when the demo ended (pending); undecided sessions were still waiting for their
    feedback."""
    dropped = {r: int(t) for r, t in measured.builder.items() if r != "trained" and t}
    kept = int(measured.builder.get("trained", 0))
    mask_tokens = {s.sample_id: sum(s.loss_mask) for g in measured.groups for s in g.samples}
    stepped = {s for record in measured.steps for s in record.samples}
    trained = sum(mask_tokens.get(s, 0) for s in stepped)
    for reason, tokens in measured.trainer_dropped.items():
        if tokens:
            dropped[f"trainer:{reason}"] = int(tokens)
    trainer_dropped = sum(int(t) for t in measured.trainer_dropped.values())
    decided = kept + sum(int(t) for r, t in measured.builder.items() if r != "trained")
    return {
        "captured": measured.captured,
        "trained": trained,
        "dropped": dict(sorted(dropped.items())),
        "pending": kept - trained - trainer_dropped,
        "undecided": measured.captured - decided,
        "trained_sessions": sum(1 for g in measured.groups if g.samples),
    }


def write_report(report: Mapping[str, Any], run_dir: Path) -> None:
    """run_dir/report.json and run_dir/report.png (success over time, token books)."""
    (run_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.5), dpi=100, layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    timeline = report["timeline"]
    minutes = [(b["at_s"] + BUCKET_S / 2) / 60 for b in timeline]
    for key, label in (("greedy", "as the app asked (temperature 0)"), ("explored", "explored")):
        left.plot(minutes, [b[key] for b in timeline], marker="o", label=label)
    for step in report["steps"]:
        left.axvline(step["at_s"] / 60, color="grey", linewidth=0.5, linestyle=":")
    left.set(xlabel="minutes", ylabel="users' success rate", ylim=(0, 1))
    left.set_title(f"Success per {BUCKET_S:.0f} s of conversations (dotted: trainer steps)")
    left.legend(loc="upper left")
    books = report["books"]
    labels = ["trained", *books["dropped"], "pending", "undecided"]
    values = [books["trained"], *books["dropped"].values(), books["pending"], books["undecided"]]
    colors = ["tab:green"] + ["tab:red"] * len(books["dropped"]) + ["grey", "lightgrey"]
    right.barh(labels, values, color=colors)
    right.invert_yaxis()
    right.set_title(f"Completion tokens: {books['captured']} captured")
    right.set_xlabel("completion tokens")
    fig.savefig(run_dir / "report.png", format="png")
