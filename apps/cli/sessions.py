"""`harnessrl sessions`: production sessions as the topics tell them, one line each.

Everything comes from the event topics, joined per session group ("s.<app>.<session>"):

    hrl.episodes  EpisodeStarted / EpisodeFinished with `session`: app, kind, explored, end
    hrl.rewards   RewardAssigned with `session`: its signals, decided_at, missing
    hrl.samples   GroupSamples (estimator session_baseline): the token books, dropped episodes
    hrl.policy    PolicyVersion.session_groups: the versions that trained it;
                  SessionDeleted / SessionDeletionApplied: deletions and the trainer's answer

A session's state is the furthest of: open (started) -> awaiting_feedback (ended) ->
rewarded (reward decided, no samples yet) -> built (samples published, not trained yet) ->
trained (the versions whose steps trained it); or dropped (why: reward_missing,
not_explored, or the reason the sample builder dropped its episode), or deleted. Signals
are known once the reward is decided (they travel in RewardAssigned).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any

from harnessrl.command import CliError, add_kafka_options, load

STATES = ("open", "awaiting_feedback", "rewarded", "built", "trained", "dropped", "deleted")
_COLUMNS = ("APP", "SESSION", "KIND", "EXPLORED", "STATE", "SIGNALS", "DELAY")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "sessions",
        help="production sessions as the topics tell them: state, feedback, training",
        description="Read hrl.episodes, hrl.rewards, hrl.samples and hrl.policy to their "
        "ends and print one line per production session (app, session id, kind, explored, "
        f"state: {' | '.join(STATES)}, signals, feedback delay), then a summary: sessions "
        "by state, feedback coverage (share of sessions whose reward is decided that got a "
        "signal), feedback delay p50/p90 (a signal's arrival minus the session's end) and "
        "where the captured tokens went (trained + dropped by reason).",
    )
    add_kafka_options(parser)
    parser.add_argument("--app", help="only this app's sessions")
    parser.add_argument("--state", choices=STATES, help="only sessions in this state")
    parser.add_argument(
        "--limit", type=int, default=50, metavar="N", help="lines printed, newest first (50)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


@dataclass(slots=True)
class SessionLine:
    """One session, joined from its events. Times are seconds since the epoch."""

    group_id: str
    app: str = ""
    session: str = ""
    kind: str = ""
    explored: bool = False
    started_at: float | None = None
    ended_at: float | None = None
    ended_by: str = ""
    decided_at: float | None = None
    value: float | None = None
    missing: bool = False
    signals: list[float] = field(default_factory=list)
    """Arrival time of each signal."""
    samples: int | None = None
    """Samples of its GroupSamples, None when none was published."""
    dropped: str = ""
    """Why the sample builder dropped its episode (its GroupSamples' first dropped one)."""
    captured: int = 0
    """Completion tokens its calls captured, and of them trained and dropped by reason."""
    trained_tokens: int = 0
    dropped_tokens: Counter[str] = field(default_factory=Counter)
    trained_versions: list[int] = field(default_factory=list)
    deleted_at: float | None = None
    deletion_applied: bool = False

    @property
    def state(self) -> str:
        if self.deleted_at is not None:
            return "deleted"
        if self.trained_versions:
            return "trained"
        if self.samples:
            return "built"
        if self.dropped or self.missing or (self.decided_at and not self.explored):
            return "dropped"
        if self.decided_at is not None:
            return "rewarded"
        return "open" if self.ended_at is None else "awaiting_feedback"

    @property
    def reason(self) -> str:
        """What the state's parenthesis says: the versions, or why it was dropped."""
        state = self.state
        if state == "trained":
            return ",".join(f"v{v}" for v in self.trained_versions)
        if state == "dropped":
            return self.dropped or ("reward_missing" if self.missing else "not_explored")
        if state == "deleted":
            return "applied" if self.deletion_applied else "pending"
        return ""

    @property
    def delay_s(self) -> float | None:
        """From the end to the first signal after it."""
        return min(self.delays, default=None)

    @property
    def delays(self) -> list[float]:
        end = self.ended_at
        return [] if end is None else [t - end for t in self.signals if t >= end]


@dataclass(slots=True)
class SessionsBook:
    """The sessions joined so far; `add` takes each event once."""

    lines: dict[str, SessionLine] = field(default_factory=dict)

    def line(self, group_id: str) -> SessionLine:
        found = self.lines.get(group_id)
        if found is None:
            found = self.lines[group_id] = SessionLine(group_id)
            app, _, session = group_id[2:].partition(".")
            found.app, found.session = app, session
        return found

    def add(self, kind: str, event: Any) -> None:
        """Join one event (of any kind: those that are no session's are skipped)."""
        if kind == "policy_version":
            for group_id in event.session_groups:
                versions = self.line(group_id).trained_versions
                if event.version not in versions:  # a republished version counts once
                    versions.append(event.version)
                    versions.sort()
            return
        group_id = getattr(event, "group_id", "")
        if not group_id.startswith("s."):
            return
        if kind in ("episode_started", "episode_finished", "reward_assigned"):
            if not event.HasField("session"):
                return
            line = self.line(group_id)
            info = event.session
            line.kind, line.explored = info.kind, info.explored
            line.app, line.session = info.app, info.session_id
            if kind == "episode_started":
                line.started_at = _seconds(event.started_at)
            elif kind == "episode_finished":
                line.ended_at, line.ended_by = _seconds(event.finished_at), info.ended_by
            else:
                line.decided_at = _seconds(event.decided_at) or 0.0
                line.missing = event.missing
                line.value = None if event.missing else event.value
                line.signals = [_seconds(s.received_at) or 0.0 for s in event.signals]
        elif kind == "group_samples" and event.estimator == "session_baseline":
            line = self.line(group_id)
            line.samples = len(event.samples)
            if event.dropped_reason:  # the session trains nothing, and this is why
                line.dropped = event.dropped_reason
            elif event.dropped:
                line.dropped = event.dropped[0].reason
            line.captured = event.books.captured  # the same for a republished one
            line.trained_tokens = event.books.trained
            line.dropped_tokens = Counter(dict(event.books.dropped))
        elif kind == "session_deleted":
            self.line(group_id).deleted_at = _seconds(event.requested_at) or 0.0
        elif kind == "session_deletion_applied":
            self.line(group_id).deletion_applied = True


def summary(lines: list[SessionLine]) -> dict[str, Any]:
    """Sessions by state, feedback coverage and delay, token books, over `lines`."""
    by_state = Counter(line.state for line in lines)
    decided = [line for line in lines if line.decided_at is not None]
    covered = sum(1 for line in decided if line.signals)
    delays = sorted(d for line in lines for d in line.delays)
    dropped: Counter[str] = Counter()
    for line in lines:
        dropped.update(line.dropped_tokens)
    return {
        "sessions": len(lines),
        "by_state": {state: by_state[state] for state in STATES if by_state[state]},
        "decided": len(decided),
        "feedback_coverage": covered / len(decided) if decided else None,
        "delay_p50_s": _quantile(delays, 0.5),
        "delay_p90_s": _quantile(delays, 0.9),
        "tokens": {
            "captured": sum(line.captured for line in lines),
            "trained": sum(line.trained_tokens for line in lines),
            "dropped": dict(sorted(dropped.items())),
        },
    }


def _seconds(stamp: Any) -> float | None:
    nanos: int = stamp.ToNanoseconds()
    return nanos / 1e9 or None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def select(book: SessionsBook, app: str | None, state: str | None) -> list[SessionLine]:
    """The sessions that pass the filters, newest start first."""
    lines = [
        line
        for line in book.lines.values()
        if line.app and (app is None or line.app == app) and (state is None or line.state == state)
    ]
    return sorted(lines, key=lambda s: (-(s.started_at or s.ended_at or 0.0), s.group_id))


def line_json(line: SessionLine) -> dict[str, Any]:
    return {
        "app": line.app,
        "session": line.session,
        "kind": line.kind,
        "explored": line.explored,
        "state": line.state,
        "reason": line.reason,
        "started_at": line.started_at,
        "ended_at": line.ended_at,
        "ended_by": line.ended_by,
        "signals": len(line.signals),
        "delay_s": line.delay_s,
        "decided_at": line.decided_at,
        "value": line.value,
        "missing": line.missing,
        "samples": line.samples,
        "trained_versions": line.trained_versions,
        "tokens": {
            "captured": line.captured,
            "trained": line.trained_tokens,
            "dropped": dict(sorted(line.dropped_tokens.items())),
        },
    }


def render(lines: list[SessionLine], totals: dict[str, Any]) -> str:
    """The table and the summary, as text."""
    rows = [
        (
            line.app,
            line.session,
            line.kind or "-",
            "yes" if line.explored else "no",
            f"{line.state} ({line.reason})" if line.reason else line.state,
            str(len(line.signals)) if line.decided_at is not None else "-",
            _duration(line.delay_s),
        )
        for line in lines
    ]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_COLUMNS)]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
           for row in [_COLUMNS, *rows]]  # fmt: skip
    coverage = totals["feedback_coverage"]
    tokens = totals["tokens"]
    dropped = ", ".join(f"{reason} {n}" for reason, n in tokens["dropped"].items()) or "none"
    states = ", ".join(f"{state} {n}" for state, n in totals["by_state"].items()) or "none"
    out += [
        "",
        f"sessions: {totals['sessions']} ({states})",
        "feedback coverage: "
        + ("-" if coverage is None else f"{coverage:.0%}")
        + f" of {totals['decided']} decided sessions got a signal",
        f"feedback delay: p50 {_duration(totals['delay_p50_s'])}, "
        f"p90 {_duration(totals['delay_p90_s'])}",
        f"tokens: captured {tokens['captured']} = trained {tokens['trained']} + dropped "
        f"{sum(tokens['dropped'].values())} ({dropped})",
    ]
    return "\n".join(out)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


async def read(kafka: Any, progress: IO[str]) -> SessionsBook:
    """Every session event now on the four topics, joined. Records keyed by a group that is
    no session's are skipped before they are decoded (hrl.policy is keyed "policy")."""
    from harnessrl import events
    from harnessrl.bus.snapshot import raw_to_end

    book = SessionsBook()
    for topic in (events.EPISODES, events.REWARDS, events.SAMPLES, events.POLICY):
        read_n = 0
        async for record in raw_to_end(kafka, topic, client_id="harnessrl-sessions"):
            read_n += 1
            if read_n % 1000 == 0:
                print(f"\rreading {topic}: {read_n} records", end="", file=progress, flush=True)
            if topic != events.POLICY and not (record.key or b"").startswith(b"s."):
                continue
            try:
                _, kind, event = events.unwrap(events.decode(topic, record.value))
            except events.DecodeError:
                continue
            book.add(kind, event)
        print(f"\rread {topic}: {read_n} records", file=progress, flush=True)
    return book


def run(args: argparse.Namespace) -> int:
    from harnessrl.config import ServiceConfig

    if args.limit < 1:
        raise CliError("--limit: must be at least 1")
    config = load(ServiceConfig, args)
    from aiokafka.errors import KafkaError

    try:
        book = asyncio.run(read(config.kafka, sys.stderr))
    except (KafkaError, OSError) as err:
        where = config.kafka.bootstrap_servers
        raise CliError(f"cannot read the topics at {where}: {err!r}") from None
    lines = select(book, args.app, args.state)
    totals = summary(lines)
    shown = lines[: args.limit]
    if args.json:
        out = {"sessions": [line_json(line) for line in shown], "summary": totals}
        print(json.dumps(out, indent=2))
    else:
        print(render(shown, totals))
    return 0
