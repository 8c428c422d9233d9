"""Feedback: an app's signals about a session become its reward, and credit for its turns.

Signals arrive in any order, more than once, before or long after the session ended. What
they are worth is decided here, from the signals alone (no clock but the one passed in):

- **One signal per idempotency key.** The first accepted copy counts; a repeat is the same
  signal (the store refuses it before it gets here; `dedupe` holds the rule).
- **Latest value per name.** Of a session's signals with the same name and target (the
  session, or one response), the one received last counts (ties: the later key), so a user
  who changes a thumbs-down into a thumbs-up is counted once, as up.
- **The session reward** is the weighted mean, over the names present, of the session-wide
  signals (those naming no response): R = Σ w_n v_n / Σ w_n. With none, but per-response
  ones, it is the weighted mean of those, each response's counted once. Only names that
  train count; a held-out name (`train: false`) is recorded and can judge a canary
  (`session_reward(..., names=...)`), so a policy is never paid for it.
- **Per-response credit.** A signal naming a response is that turn's own reward r_t (a
  weighted mean of the names present for it); the turn is credited R's advantage plus its
  own (services/sample_builder: A_t = A(R) + A(r_t), each against its own baseline); turns
  no signal names get A(R) alone.
- **When it is decided.** After the session ended, once every required signal name is in
  (session-wide or for any response); or when its window ends: then with what arrived
  (`at_window_end: train`, nothing arrived: missing) or missing (`drop`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Decision = Literal["wait", "decide", "missing"]


@dataclass(frozen=True, slots=True)
class Signal:
    """One accepted signal."""

    name: str
    value: float
    response_id: str
    """"" for the whole session."""
    key: str
    """The app's idempotency key."""
    received_at: float
    """Seconds (the accepting service's wall clock)."""


class SignalWeight(Protocol):
    @property
    def weight(self) -> float: ...

    @property
    def required(self) -> bool: ...

    @property
    def train(self) -> bool: ...


class FeedbackRules(Protocol):
    """What the configuration says (production.feedback)."""

    @property
    def signals(self) -> Mapping[str, SignalWeight]: ...

    @property
    def window_s(self) -> float: ...

    @property
    def at_window_end(self) -> str: ...


@dataclass(slots=True)
class SessionReward:
    """What a session's signals are worth."""

    value: float | None
    """The session reward R; None when no signal counts (then it is missing)."""
    components: dict[str, float] = field(default_factory=dict)
    """The counted session-wide value of each name."""
    turns: dict[str, float] = field(default_factory=dict)
    """Response id -> that turn's own reward r_t."""


def dedupe(signals: Sequence[Signal]) -> list[Signal]:
    """The signals with the first copy of each idempotency key, in their order."""
    seen: set[str] = set()
    out = []
    for s in signals:
        if s.key not in seen:
            seen.add(s.key)
            out.append(s)
    return out


def _latest(signals: Sequence[Signal]) -> dict[tuple[str, str], Signal]:
    """(response id, name) -> the signal that counts."""
    out: dict[tuple[str, str], Signal] = {}
    for s in dedupe(signals):
        slot = (s.response_id, s.name)
        held = out.get(slot)
        if held is None or (s.received_at, s.key) >= (held.received_at, held.key):
            out[slot] = s
    return out


def _mean(values: Mapping[str, float], rules: FeedbackRules) -> float | None:
    weights = {n: rules.signals[n].weight if n in rules.signals else 1.0 for n in values}
    total = sum(weights.values())
    if not values or total <= 0:
        return None
    return sum(weights[n] * v for n, v in sorted(values.items())) / total


def session_reward(
    signals: Sequence[Signal], rules: FeedbackRules, names: Sequence[str] | None = None
) -> SessionReward:
    """The session's reward and its turns' rewards, from its signals (any order): over the
    names that train, or over `names` (a canary's outcome). `components` has every name."""
    counted = _latest(signals)
    session = {name: s.value for (rid, name), s in counted.items() if not rid}
    counts = _counting(rules, names)
    by_turn: dict[str, dict[str, float]] = {}
    for (rid, name), s in counted.items():
        if rid and counts(name):
            by_turn.setdefault(rid, {})[name] = s.value
    turns = {
        rid: v for rid, names in sorted(by_turn.items()) if (v := _mean(names, rules)) is not None
    }
    value = _mean({n: v for n, v in session.items() if counts(n)}, rules)
    if value is None and turns:
        value = sum(turns.values()) / len(turns)
    return SessionReward(value=value, components=dict(sorted(session.items())), turns=turns)


def _counting(rules: FeedbackRules, names: Sequence[str] | None) -> Callable[[str], bool]:
    if names is not None:
        chosen = frozenset(names)
        return chosen.__contains__
    return lambda name: name not in rules.signals or rules.signals[name].train


def decide(
    signals: Sequence[Signal],
    rules: FeedbackRules,
    *,
    ended_at: float | None,
    now: float,
) -> Decision:
    """Whether the session's reward can be decided now: "decide", "wait", or "missing"
    (its window ended with nothing to train on). `ended_at` is None while it is open."""
    if ended_at is None:
        return "wait"
    names = {s.name for s in dedupe(signals)}
    required = {n for n, rule in rules.signals.items() if rule.required}
    if names and required <= names:
        return "decide"
    if now < ended_at + rules.window_s:
        return "wait"
    if rules.at_window_end == "train" and names:
        return "decide"
    return "missing"
