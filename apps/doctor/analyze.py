"""From a doctor run's captured events to its report: figures per section, and a verdict per
check with the threshold it used (the report's shape: docs in doctor/report_text.py).

Pure: the events, the settings and a decoder in, a JSON-ready dict out. The token books are
the sample builder's own (`build` on each group, as if it were a train group, so a val run
still says what training would use) and the chains its own merge, so the doctor cannot
disagree with what training would do.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from harnessrl.apps.doctor import chains, traffic
from harnessrl.apps.doctor.attempt import EpisodeView
from harnessrl.apps.doctor.checks import (
    FAIL,
    NA,
    Check,
    at_least,
    at_most,
    share,
    stats,
    worst,
)
from harnessrl.apps.doctor.collect import Collected
from harnessrl.apps.doctor.traffic_read import read_call
from harnessrl.services.gateway.tool_markup import MARKUPS
from harnessrl.services.sample_builder.config import SampleBuilderSection
from harnessrl.trust.group import Group
from harnessrl.trust.merging import merge
from harnessrl.trust.samples import build, to_call
from harnessrl.trust.tree import ids_of
from harnessrl.v1 import events_pb2 as pb

Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class Settings:
    builder: SampleBuilderSection = field(default_factory=SampleBuilderSection)
    train: Any = None
    """The gateway's train-mode SamplingOverrides (None: the gateway's defaults)."""
    markups: tuple[str, ...] = MARKUPS


def analyze(collected: Collected, settings: Settings, decode: Decode | None) -> dict[str, Any]:
    from harnessrl.services.gateway.config import GatewaySection

    train = settings.train if settings.train is not None else GatewaySection().train
    episodes: list[EpisodeView] = []
    books: Counter[str] = Counter()
    group_rewards: list[list[float]] = []
    for group_id, held in collected.groups.items():
        group = Group(group_id, 0.0)
        for kind, event in held:
            group.add(kind, event)
        group.mode = pb.MODE_TRAIN  # what training would make of it, whatever the run's mode
        built = build(group, settings.builder, decode)
        books["captured"] += built.books.captured
        books["trained"] += built.books.trained
        for reason, tokens in built.books.dropped.items():
            books[f"dropped:{reason}"] += tokens
        rewards = []
        for episode in group.episodes():
            state = episode.state
            view = EpisodeView(
                episode.episode_id, group_id, episode.calls, state.finished, state.reward
            )
            if view.calls:
                view.merged = merge([to_call(c) for c in view.calls], decode=decode)
            view.wires = [read_call(c, decode, settings.markups) for c in view.calls]
            episodes.append(view)
            if state.reward is not None and not state.reward.missing:
                rewards.append(state.reward.value)
        group_rewards.append(rewards)
    sections = {
        "merging": chains.section(episodes, decode),
        "tokens": _tokens(episodes, books),
        "tools": traffic.tools_section(episodes),
        "wire": traffic.wire_section(episodes, collected, train),
        "outcome": _outcome(episodes, group_rewards),
    }
    checks = [c for name in sections for c in sections[name].pop("_checks")]
    return {
        "run": {
            "started_at": collected.started_at,
            "minutes": round((collected.finished_at - collected.started_at) / 60, 2),
            "mode": collected.mode,
            "episodes": len(episodes),
            "incomplete_groups": len(collected.incomplete),
        },
        "verdict": worst(checks),
        "checks": [c.to_dict() for c in checks],
        **sections,
    }


# --- tokens -----------------------------------------------------------------------------------


def _tokens(episodes: list[EpisodeView], books: Counter[str]) -> dict[str, Any]:
    calls = [c for e in episodes for c in e.calls]
    sequence = sum(len(s.token_ids) for e in episodes if e.merged for s in e.merged.segments)
    minimum = sum(_distinct_prefix_tokens([ids_of(to_call(c)) for c in e.calls]) for e in episodes)
    per_call = sum(len(c.prompt_token_ids) + len(c.completion_token_ids) for c in calls)
    dropped = {
        k.removeprefix("dropped:"): v for k, v in books.items() if k.startswith("dropped:") and v
    }
    captured, trained = books["captured"], books["trained"]
    overhead = share(sequence, minimum)
    trained_share = share(trained, captured)
    # Groups dropped for their rewards are outcome.signal's finding, not the harness's: the
    # verdict is on the tokens of the groups that would be trained.
    signal = sum(dropped.get(reason, 0) for reason in GROUP_REASONS)
    kept_share = share(trained, captured - signal)
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(dropped.items(), key=lambda kv: -kv[1]))
    value = "nothing captured"
    if trained_share is not None:
        value = f"{trained} of {captured} ({trained_share:.2f})"
        if signal:
            value += f"; of the groups with a reward signal {_fmt_share(kept_share)}"
    checks = [
        Check(
            "tokens.trained",
            "tokens",
            "captured completion tokens training would use",
            NA if kept_share is None else at_least(kept_share, 0.9, 0.5),
            value,
            "ok >= 0.9, warn >= 0.5, fail below (groups without a signal: outcome.signal)",
            f"not trained, by reason (tokens): {reasons}" if reasons else "",
            _books_fix({k: v for k, v in dropped.items() if k not in GROUP_REASONS}),
        ),
        Check(
            "tokens.overhead",
            "tokens",
            "sequence tokens against the prefix-shared minimum",
            NA if overhead is None else at_most(overhead, 1.25, 2.0),
            "no calls" if overhead is None else f"{sequence} vs {minimum} ({overhead:.2f}x)",
            "ok <= 1.25x, warn <= 2x, fail above",
            "each chain re-runs the context it shares with others"
            if overhead and overhead > 1.25
            else "",
            "fewer chain breaks (see merging) bring it down"
            if overhead and overhead > 1.25
            else "",
        ),
    ]
    return {
        "prompt_per_call": stats([float(len(c.prompt_token_ids)) for c in calls]),
        "completion_per_call": stats([float(len(c.completion_token_ids)) for c in calls]),
        "prompt_per_episode": stats(
            [float(sum(len(c.prompt_token_ids) for c in e.calls)) for e in episodes]
        ),
        "completion_per_episode": stats(
            [float(sum(len(c.completion_token_ids) for c in e.calls)) for e in episodes]
        ),
        "per_call_tokens": per_call,
        "sequence_tokens": sequence,
        "minimum_tokens": minimum,
        "overhead": None if overhead is None else round(overhead, 4),
        "captured": captured,
        "trained": trained,
        "trained_share": None if trained_share is None else round(trained_share, 4),
        "dropped": dropped,
        "_checks": checks,
    }


GROUP_REASONS = ("zero_variance", "too_few_episodes")
"""Token-book reasons that drop a whole group for its rewards."""


def _fmt_share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _books_fix(dropped: dict[str, int]) -> str:
    if not dropped:
        return ""
    top = max(dropped, key=dropped.__getitem__)
    return {
        "truncated": "sequences exceed sample_builder.max_tokens: raise it or shorten episodes",
        "retried": "the harness retries calls: look for 4xx/5xx and timeouts under wire",
        "failed": "episodes fail: see outcome.status",
        "reward_missing": "the reward raised or timed out: see outcome.reward",
    }.get(top, f"most are dropped as {top}")


def _distinct_prefix_tokens(sequences: list[np.ndarray]) -> int:
    """Nodes of the prefix tree of `sequences`: the fewest tokens any merge could run."""
    ordered = sorted(sequences, key=lambda s: s.astype(">u4").tobytes())
    total, previous = 0, np.zeros(0, dtype=np.uint32)
    for ids in ordered:
        n = min(len(ids), len(previous))
        differ = np.flatnonzero(ids[:n] != previous[:n])
        total += len(ids) - (int(differ[0]) if differ.size else n)
        previous = ids
    return total


# --- outcome ----------------------------------------------------------------------------------


def _outcome(episodes: list[EpisodeView], group_rewards: list[list[float]]) -> dict[str, Any]:
    statuses = Counter(
        pb.EpisodeStatus.Name(e.finished.status).removeprefix("EPISODE_STATUS_").lower()
        if e.finished
        else "unfinished"
        for e in episodes
    )
    rewards = [r for g in group_rewards for r in g]
    missing = sum(1 for e in episodes if e.reward is None or e.reward.missing)
    graded = [g for g in group_rewards if len(g) >= 2]
    flat = sum(1 for g in graded if max(g) - min(g) <= 1e-9)
    bad = len(episodes) - statuses["succeeded"]
    seconds = [
        (e.finished.finished_at.ToMicroseconds() - e.finished.started_at.ToMicroseconds()) / 1e6
        for e in episodes
        if e.finished and e.finished.finished_at.seconds
    ]
    rate = share(bad, len(episodes))
    flat_rate = share(flat, len(graded))
    values = sorted(set(round(r, 6) for r in rewards))
    checks = [
        Check(
            "outcome.status",
            "outcome",
            "episodes that did not succeed",
            NA if rate is None else at_most(rate, 0.1, 0.5),
            "no episodes" if rate is None else f"{bad} of {len(episodes)} ({_counts(statuses)})",
            "ok <= 0.1, warn <= 0.5, fail above",
        ),
        Check(
            "outcome.reward",
            "outcome",
            "episodes without a reward",
            NA if not episodes else at_most(missing / len(episodes), 0.0, 0.1),
            f"{missing} of {len(episodes)}",
            "ok: none, warn <= 0.1, fail above",
        ),
        Check(
            "outcome.signal",
            "outcome",
            "groups whose rewards are all equal (no GRPO signal)",
            NA
            if flat_rate is None
            else (FAIL if flat == len(graded) else at_most(flat_rate, 0.5, 0.99)),
            "no group has two rewarded episodes"
            if flat_rate is None
            else f"{flat} of {len(graded)} groups; rewards seen {_values(values)}",
            "ok <= 0.5, warn below 1, fail: every group",
            "the reward gives every episode of a task the same value: GRPO's advantages are all "
            "0 and nothing is learned"
            if flat_rate is not None and flat == len(graded)
            else "",
            "make the reward discriminate (partial credit, tests passed), or use harder or more "
            "varied tasks, or larger groups"
            if flat_rate is not None and flat == len(graded)
            else "",
        ),
    ]
    return {
        "statuses": dict(statuses),
        "rewards": rewards,
        "reward": stats(rewards),
        "groups": len(group_rewards),
        "zero_variance_groups": flat,
        "missing_rewards": missing,
        "call_seconds": stats([c.latency_ms / 1000 for e in episodes for c in e.calls]),
        "episode_seconds": stats(seconds),
        "_checks": checks,
    }


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.most_common())


def _values(values: list[float]) -> str:
    shown = ", ".join(f"{v:g}" for v in values[:6] if math.isfinite(v))
    return "{" + shown + (", ..." if len(values) > 6 else "") + "}"
