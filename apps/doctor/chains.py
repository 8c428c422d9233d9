"""The report's merging section: how an episode's calls become chains, and why a chain
breaks, in words (causes.py) for the most common break."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from harnessrl.apps.doctor import causes
from harnessrl.apps.doctor.attempt import EpisodeView
from harnessrl.apps.doctor.checks import NA, OK, WARN, Check, at_most, share, stats
from harnessrl.trust.merging import Break
from harnessrl.trust.samples import to_call
from harnessrl.trust.tree import ids_of

Decode = Callable[[Sequence[int]], str]

FIXABLE = ("other", "chat_template", "retokenization")
"""Break kinds the harness (or its template) can avoid; side chains and compactions are the
harness's structure."""


def section(episodes: list[EpisodeView], decode: Decode | None) -> dict[str, Any]:
    merged = [e for e in episodes if e.merged is not None]
    calls = sum(len(e.calls) for e in merged)
    later = sum(len(e.calls) - 1 for e in merged)
    breaks: Counter[str] = Counter()
    points: list[dict[str, Any]] = []
    found: dict[str, list[tuple[EpisodeView, Break]]] = {}
    for index, episode in enumerate(episodes):
        if episode.merged is None:
            continue
        prompts = {c.seq: len(c.prompt_token_ids) for c in episode.calls}
        for b in episode.merged.breaks:
            breaks[str(b.kind)] += 1
            found.setdefault(str(b.kind), []).append((episode, b))
            if len(points) < 2000:
                points.append(
                    {
                        "episode": index,
                        "seq": b.seq,
                        "kind": str(b.kind),
                        "position": b.position,
                        "prompt_tokens": prompts.get(b.seq, 0),
                    }
                )
    chains = [len(e.merged.segments) for e in merged if e.merged is not None]
    extended = sum(
        len(e.calls) - sum(e.merged.dropped_calls.values()) for e in merged if e.merged
    ) - sum(chains)
    fixable = sum(breaks[k] for k in FIXABLE)
    top = _top_break(found, later, decode)
    checks = [
        _rate_check(
            "merge.breaks",
            "chains the harness breaks (history re-rendered or edited)",
            fixable,
            later,
            ok=0.02,
            warn=0.2,
            top=top if top and top["kind"] in FIXABLE else None,
        ),
        _count_check(
            "merge.side_chains",
            "sub-agents and side calls",
            "side_chain",
            n=breaks["side_chain"],
            episodes=len(merged),
            found=found,
            later=later,
            decode=decode,
        ),
        _count_check(
            "merge.compaction",
            "history compacted",
            "compaction",
            n=breaks["compaction"],
            episodes=len(merged),
            found=found,
            later=later,
            decode=decode,
        ),
    ]
    return {
        "episodes": len(episodes),
        "calls": calls,
        "calls_per_episode": stats([float(len(e.calls)) for e in episodes]),
        "chains_per_episode": stats([float(c) for c in chains]),
        "extend_share": share(max(extended, 0), later),
        "breaks": {
            kind: breaks[kind]
            for kind in ("chat_template", "retokenization", "compaction", "side_chain", "other")
        },
        "temperature_breaks": sum(e.merged.temperature_breaks for e in merged if e.merged),
        "top_break": top,
        "break_points": points,
        "_checks": checks,
    }


def _top_break(
    found: dict[str, list[tuple[EpisodeView, Break]]],
    later: int,
    decode: Decode | None,
    kind: str | None = None,
) -> dict[str, Any] | None:
    """The most common break (a fixable one first), described by its first instance."""
    if kind is None:
        fixable = [k for k in FIXABLE if k in found]
        pool = fixable or list(found)
        if not pool:
            return None
        kind = max(pool, key=lambda k: len(found[k]))
    if kind not in found:
        return None
    episode, b = found[kind][0]
    where = None
    if decode is not None:
        by_seq = {c.seq: c for c in episode.calls}
        nearest, call = by_seq.get(b.nearest_seq), by_seq.get(b.seq)
        if nearest is not None and call is not None:
            context = ids_of(to_call(nearest)).tolist()
            where = causes.locate(context, list(call.prompt_token_ids), b.position, decode)
    count = len(found[kind])
    cause, fix = causes.explain(
        kind, where, temperature_change=b.temperature_change, share=count / max(later, 1)
    )
    return {
        "kind": kind,
        "count": count,
        "episode_id": episode.episode_id,
        "seq": b.seq,
        "nearest_seq": b.nearest_seq,
        "position": b.position,
        "role": where.role if where else "",
        "line": where.line if where else None,
        "sent": b.sent,
        "recorded": b.recorded,
        "cause": cause,
        "fix": fix,
    }


def _rate_check(
    id_: str, title: str, n: int, of: int, *, ok: float, warn: float, top: dict[str, Any] | None
) -> Check:
    rate = share(n, of)
    if rate is None:
        return Check(id_, "merging", title, NA, "no episode made two calls", "")
    return Check(
        id_,
        "merging",
        title,
        at_most(rate, ok, warn),
        f"{n} of {of} later calls ({rate:.2f}) start a new chain",
        f"ok <= {ok}, warn <= {warn}, fail above",
        top["cause"] if top and n else "",
        top["fix"] if top and n else "",
    )


def _count_check(
    id_: str,
    title: str,
    kind: str,
    *,
    n: int,
    episodes: int,
    found: dict[str, Any],
    later: int,
    decode: Decode | None,
) -> Check:
    if not episodes:
        return Check(id_, "merging", title, NA, "no episode made a call", "")
    detail = fix = ""
    if n:
        top = _top_break(found, later, decode, kind)
        assert top is not None
        detail, fix = (
            f"{top['cause']} (first: call {top['seq']} of episode {top['episode_id']})",
            top["fix"],
        )
    return Check(
        id_,
        "merging",
        title,
        OK if n == 0 else WARN,
        f"{n} in {episodes} episodes",
        "ok: none, warn: any (it trains, as separate chains)",
        detail,
        fix,
    )
