"""Canary rollouts: which policy versions serve production sessions, folded from hrl.policy.

With `production.canary.enabled`, a new version does not reach every user at once. The
stable version serves production sessions; a candidate serves a sticky `share` of new ones
beside it until the reward service's judge (services/reward/canary_judge.py, using
harnessrl.trust.canary) promotes or rolls it back, or an operator does (`harnessrl policy`).
Every decision is a `RolloutDecision` on hrl.policy, whose single partition orders them,
and every service folds the same events in the same order with `RolloutState`, so gateways,
engines, the trainer, the judge and the CLI agree on the state without talking to each
other, and a restarted service reads it back from the topic.

The fold, in the topic's order:

- `PolicyVersion` announces a version and the version its weights were trained from
  (`base`: the one before, or the stable version the trainer rewound to after a rollback).
  Before any decision, the first version announced is stable (the trainer's initial
  weights, version 0, on a new deployment). A version is retired when it or a version it
  descends from was rolled back: it never becomes a candidate, engines stop loading it, and
  the trainer trains no sample it produced.
- A decision applies only to the state it was made against (`RolloutDecision.stable` is
  still stable) and only when `refusal` finds nothing wrong with it; a refused decision
  changes nothing, on every service alike (a raced duplicate, an operator's stale command).
  A decision id applies once; a refused record delivered again stays refused, while a
  decision published again with its own `decided_at` is judged where it lands (`decided`).
  START makes an announced version newer than stable, never rolled back, the candidate
  (none pending, not pinned). PROMOTE makes the candidate stable, or, with none pending, any
  announced version not rolled back (an operator's override). ROLLBACK ends the candidate
  and every version descending from it (the trainer rewinds to stable), or, with none pending,
  replaces the stable version by the latest one stable before it that this leaves unretired.
  PIN makes a version stable and holds candidates off until UNPIN; it is refused while a
  candidate is pending, so a pin never discards a decision under way.

A session's arm is chosen once, at its first call (`assign`): the candidate when a hash of
(group id, candidate version) falls in the share and an engine serves the candidate, else
stable. The gateway records the arm and version with the session (SessionInfo), so a
session keeps its version to its end, whatever is decided meanwhile.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import Field, field_validator

from harnessrl.config import Section
from harnessrl.trust.canary import CanaryConfig, GuardRule
from harnessrl.v1 import events_pb2 as pb

Arm = Literal["stable", "candidate"]
AUTO_ACTOR = "canary"
"""`RolloutDecision.actor` of the automatic judge; an operator's is "operator:<name>"."""
GUARDS = ("error", "no_answer", "tool_parse", "slow")
"""The guard metrics a session can fail (`session_failures`)."""


class GuardSection(Section):
    """One guard: how much worse the candidate's failure rate may be, and the test's alpha."""

    margin: float = Field(default=0.02, ge=0.0, lt=1.0)
    """Rolls back when the candidate's failure rate exceeds stable's by more than this."""
    alpha: float = Field(default=0.01, gt=0.0, lt=1.0)
    """The chance this guard rolls back a candidate that is within its margin."""


class CanarySection(Section):
    """Canary rollout of new policy versions on production sessions (ARCHITECTURE.md,
    "Canary rollout"). Off: every engine serves the newest version, as without sessions."""

    enabled: bool = False
    """Serve new versions to a share of production sessions first, promote or roll back."""
    share: float = Field(default=0.1, gt=0.0, lt=1.0)
    """Share of new production sessions the candidate serves."""
    alpha: float = Field(default=0.05, gt=0.0, lt=1.0)
    """The chance of a wrong reward decision (promotion or rollback), however often looked at."""
    delta: float = Field(default=0.05, ge=0.0)
    """Non-inferiority margin in reward units: a candidate worse by less may be promoted."""
    min_sessions: int = Field(default=100, ge=1)
    """Rewarded sessions each arm needs before a reward decision (guards: ended sessions)."""
    mixture_sessions: float = Field(default=300.0, gt=0.0)
    """Where the confidence sequence is tightest, in sessions (any value keeps the guarantee)."""
    slow_ms: float = Field(default=60_000.0, gt=0.0)
    """A session fails the `slow` guard when one of its calls took longer than this."""
    signals: list[str] | None = Field(default=None, min_length=1)
    """Compare the arms on these feedback signals alone (their weighted mean), e.g. a
    held-out outcome (`train: false`) the policy is never paid for, so it cannot game its
    own release; unset: on the session's reward."""
    candidate_after_versions: int = Field(default=1, ge=1)
    """A version becomes the candidate once it is this many versions past stable along the
    versions it was trained from (larger: fewer canaries when the trainer publishes often)."""
    keep_s: float = Field(default=3600.0, ge=0.0)
    """How long engines keep serving a version the rollout stopped needing (a stable
    replaced by a promotion, a rolled-back candidate), so the sessions assigned to it end on
    it; a session still open later moves to stable (counted by the gateway as a switch)."""
    guards: dict[str, GuardSection] = {name: GuardSection() for name in GUARDS}
    """The guards checked, by name (a subset of error, no_answer, tool_parse, slow)."""

    @field_validator("guards")
    @classmethod
    def _known_guards(cls, value: dict[str, GuardSection]) -> dict[str, GuardSection]:
        for name in value:
            if name not in GUARDS:
                raise ValueError(f"guards.{name}: unknown guard; known: {', '.join(GUARDS)}")
        return value

    def rule(self, low: float, high: float) -> CanaryConfig:
        """The decision rule's settings for rewards in [low, high]."""
        config = CanaryConfig(
            alpha=self.alpha,
            delta=self.delta,
            low=low,
            high=high,
            min_sessions=self.min_sessions,
            mixture_sessions=self.mixture_sessions,
            guards={n: GuardRule(margin=g.margin, alpha=g.alpha) for n, g in self.guards.items()},
        )
        config.validate()
        return config


def session_failures(stats: pb.SessionStats, slow_ms: float) -> dict[str, bool]:
    """Which guards a finished session failed, from what its gateway saw."""
    return {
        "error": stats.errors > 0,
        "no_answer": not stats.answered,
        "tool_parse": stats.tool_parse_failures > 0,
        "slow": stats.latency_ms_max > slow_ms,
    }


ACTION_NAMES = {
    pb.ROLLOUT_ACTION_START: "start",
    pb.ROLLOUT_ACTION_PROMOTE: "promote",
    pb.ROLLOUT_ACTION_ROLLBACK: "rollback",
    pb.ROLLOUT_ACTION_PIN: "pin",
    pb.ROLLOUT_ACTION_UNPIN: "unpin",
}


class _Lineage:
    """Every PolicyVersion one fold announced, append-only and shared by all its snapshots
    (each sees its first `upto` announcements), so an announcement costs O(1) rather than
    a copy of every version before it: a fold over a long hrl.policy stays linear."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.position: dict[int, int] = {}
        self.base: dict[int, int] = {}
        self.based: list[int] = [0]
        """based[n]: how many of the first n announcements name a base."""

    def add(self, version: int, base: int | None) -> int:
        """Append `version` (not announced before); returns the new `upto`."""
        self.position[version] = len(self.order)
        self.order.append(version)
        if base is not None:
            self.base[version] = base
        self.based.append(self.based[-1] + (base is not None))
        return len(self.order)

    def has(self, version: int, upto: int) -> bool:
        position = self.position.get(version)
        return position is not None and position < upto


class _Announced(AbstractSet[int]):
    """The versions among a lineage's first `upto` announcements (an immutable view)."""

    __slots__ = ("_lineage", "_upto")

    def __init__(self, lineage: _Lineage, upto: int) -> None:
        self._lineage, self._upto = lineage, upto

    def __contains__(self, version: object) -> bool:
        return isinstance(version, int) and self._lineage.has(version, self._upto)

    def __iter__(self) -> Iterator[int]:
        return iter(self._lineage.order[: self._upto])

    def __len__(self) -> int:
        return self._upto

    __hash__ = AbstractSet._hash

    @classmethod
    def _from_iterable(cls, values: Iterable[Any]) -> AbstractSet[Any]:  # `|`, `&`, `-`
        return frozenset(values)

    def __repr__(self) -> str:
        return f"{{{', '.join(map(str, self))}}}"


class _Bases(Mapping[int, int]):
    """Version -> its base, among a lineage's first `upto` announcements (an immutable view)."""

    __slots__ = ("_lineage", "_upto")

    def __init__(self, lineage: _Lineage, upto: int) -> None:
        self._lineage, self._upto = lineage, upto

    def __getitem__(self, version: int) -> int:
        if not self._lineage.has(version, self._upto):
            raise KeyError(version)
        return self._lineage.base[version]

    def __iter__(self) -> Iterator[int]:
        return (v for v in self._lineage.order[: self._upto] if v in self._lineage.base)

    def __len__(self) -> int:
        return self._lineage.based[self._upto]

    def __repr__(self) -> str:
        return repr(dict(self))


_UNKNOWN = -1
"""`Rollout._current` not computed yet (a Rollout built by hand, not by RolloutState)."""


@dataclass(frozen=True, slots=True)
class Rollout:
    """The state at one point of hrl.policy (immutable: a reader's snapshot never changes)."""

    stable: int | None = None
    """The stable version; None before any version was announced."""
    candidate: int | None = None
    share: float = 0.0
    """The candidate's share of new sessions (0 when none is pending)."""
    pinned: bool = False
    newest: int | None = None
    """The newest version announced."""
    announced: AbstractSet[int] = frozenset()
    bases: Mapping[int, int] = field(default_factory=dict, compare=False)
    """Version -> the version its weights were trained from (absent: none known)."""
    rolled_back: frozenset[int] = frozenset()
    stables: tuple[int, ...] = ()
    """Every version that was stable, in order (an operator's rollback of stable returns to
    the one before)."""
    last: pb.RolloutDecision | None = field(default=None, compare=False)
    """The last decision applied."""
    _retired: frozenset[int] | None = field(default=None, compare=False, repr=False)
    """The announced versions retired, kept by RolloutState (None: walk `bases`)."""
    _current: int | None = field(default=_UNKNOWN, compare=False, repr=False)
    """`current()`, kept by RolloutState."""

    def retired(self, version: int) -> bool:
        """Whether `version` was rolled back or descends from a version that was."""
        if self._retired is not None and version in self.announced:
            return version in self._retired
        seen = 0
        current: int | None = version
        while current is not None and seen <= len(self.bases):
            if current in self.rolled_back:
                return True
            current = self.bases.get(current)
            seen += 1
        return False

    def current(self) -> int | None:
        """The head of the trainer's line: the newest version not retired (controller
        episodes are served it; it is the next candidate)."""
        if self._current != _UNKNOWN:
            return self._current
        for version in sorted(self.announced, reverse=True):
            if not self.retired(version):
                return version
        return None

    def serving(self) -> frozenset[int]:
        """The versions engines that serve several keep loaded: stable, candidate, current."""
        versions = (self.stable, self.candidate, self.current())
        return frozenset(v for v in versions if v is not None)


class RolloutState:
    """The fold of hrl.policy's PolicyVersion and RolloutDecision events (idempotent)."""

    def __init__(self) -> None:
        self._lineage = _Lineage()
        self.state = Rollout(
            announced=_Announced(self._lineage, 0),
            bases=_Bases(self._lineage, 0),
            _retired=frozenset(),
            _current=None,
        )
        self._outcomes: dict[str, str | None] = {}
        """decision_id -> None once applied, else its latest refusal."""
        self._refused: dict[bytes, str] = {}
        """Digest of each refused decision's bytes -> why: the same record delivered again
        (a consumer replaying what the history already folded, a producer's duplicate)
        keeps its first outcome wherever it lands."""

    def announced(self, event: pb.PolicyVersion) -> None:
        """Fold a PolicyVersion (a copy of one announced before changes nothing). O(1)."""
        state = self.state
        version = int(event.version)
        if version in state.announced:
            return
        base: int | None = None
        if event.HasField("base"):
            base = int(event.base)
        elif version - 1 in state.announced:
            base = version - 1
        retired = version in state.rolled_back or (base is not None and state.retired(base))
        upto = self._lineage.add(version, base)
        known = state._retired if state._retired is not None else frozenset()
        current = state.current()
        self.state = replace(
            state,
            announced=_Announced(self._lineage, upto),
            bases=_Bases(self._lineage, upto),
            newest=version if state.newest is None else max(state.newest, version),
            stable=version if state.stable is None else state.stable,
            stables=state.stables or (version,),
            _retired=known | {version} if retired else known,
            _current=current if retired or (current is not None and current > version) else version,
        )

    def decided(self, decision: pb.RolloutDecision) -> str | None:
        """Apply `decision`; returns None when it applied, else the reason every service
        refuses it for. Replay-safe, so a service folds hrl.policy's history and then its
        consumer's records without deduplicating: a decision id applies once (a copy of an
        applied one returns None and changes nothing), and the same refused decision, byte
        for byte, stays refused. One published again (its own `decided_at`: the judge
        retrying under its deterministic id) is judged where it lands."""
        decision_id = decision.decision_id
        if decision_id in self._outcomes and self._outcomes[decision_id] is None:
            return None
        digest = hashlib.sha256(decision.SerializeToString(deterministic=True)).digest()
        if digest in self._refused:
            return self._refused[digest]
        reason = refusal(self.state, decision)
        if decision_id:  # without an id it is refused, and nothing names it
            self._outcomes[decision_id] = reason
        if reason is None:
            self.state = _apply(self.state, decision)
        else:
            self._refused[digest] = reason
        return reason

    def outcome(self, decision_id: str) -> tuple[bool, str | None]:
        """(seen, refusal) of a decision id: (False, None) before it was folded, (True, None)
        once applied, (True, reason) when its latest copy was refused (`harnessrl policy`
        waits on it)."""
        if decision_id not in self._outcomes:
            return False, None
        return True, self._outcomes[decision_id]

    def assign(self, group_id: str, served: Callable[[int], bool]) -> tuple[Arm, int] | None:
        """The arm and version of a new session (None before any version is announced):
        the candidate for the share whose hash falls in it while some engine serves it
        (`served(version)`), else stable."""
        state = self.state
        if state.stable is None:
            return None
        candidate = state.candidate
        if (
            candidate is not None
            and served(candidate)
            and _point(group_id, candidate) < state.share
        ):
            return "candidate", candidate
        return "stable", state.stable


def refusal(state: Rollout, decision: pb.RolloutDecision) -> str | None:
    """Why `decision` does not apply to `state`, in words naming the field; None when it does."""
    action = ACTION_NAMES.get(decision.action)
    version = int(decision.version)
    if action is None:
        return f"action: {decision.action} is not a rollout action"
    if not decision.decision_id:
        return "decision_id: required"
    if state.stable is None:
        return "no policy version has been announced yet"
    if int(decision.stable) != state.stable:
        return (
            f"stable: the decision was made against version {decision.stable}, "
            f"but {state.stable} is stable"
        )
    if action == "unpin":
        return None if state.pinned else "unpin: no version is pinned"
    if version not in state.announced:
        return f"version: {version} was never announced by the trainer"
    if action == "start":
        if state.pinned:
            return f"version: stable version {state.stable} is pinned; unpin first"
        if state.candidate is not None:
            return f"version: candidate {state.candidate} is still pending"
        if version <= state.stable:
            return f"version: {version} is not newer than stable version {state.stable}"
        if state.retired(version):
            return f"version: {version} was rolled back or descends from a version that was"
        if not 0.0 < decision.share < 1.0:
            return f"share: {decision.share} is not in (0, 1)"
        return None
    if action == "promote":
        if state.candidate is not None and version != state.candidate:
            return f"version: candidate {state.candidate} is pending, not {version}"
        if state.retired(version):
            return f"version: {version} was rolled back or descends from a version that was"
        if version == state.stable:
            return f"version: {version} is already stable"
        if state.pinned:
            return f"version: stable version {state.stable} is pinned; unpin first"
        return None
    if action == "rollback":
        if state.candidate is not None:
            return (
                None
                if version == state.candidate
                else (f"version: candidate {state.candidate} is pending, not {version}")
            )
        if version != state.stable:
            return f"version: no candidate is pending and {version} is not stable"
        if _stables_after_rollback(state) is None:
            return f"version: {version} is the first stable version; nothing to roll back to"
        if state.pinned:
            return f"version: stable version {state.stable} is pinned; unpin first"
        return None
    # pin
    if state.candidate is not None:
        return f"version: candidate {state.candidate} is pending; promote or roll it back first"
    if state.retired(version):
        return f"version: {version} was rolled back or descends from a version that was"
    return None


def _apply(state: Rollout, decision: pb.RolloutDecision) -> Rollout:
    action = ACTION_NAMES[decision.action]
    version = int(decision.version)
    if action == "start":
        return replace(state, candidate=version, share=decision.share, last=decision)
    if action == "unpin":
        return replace(state, pinned=False, last=decision)
    if action == "rollback" and state.candidate is None:
        stables = _stables_after_rollback(state)
        assert stables is not None  # refusal() admitted it
        return replace(_retire(state, version), stable=stables[-1], stables=stables, last=decision)
    if action == "rollback":
        return replace(_retire(state, version), candidate=None, share=0.0, last=decision)
    stables = state.stables if state.stable == version else (*state.stables, version)
    return replace(
        state,
        stable=version,
        stables=stables,
        candidate=None,
        share=0.0,
        pinned=action == "pin",
        last=decision,
    )


def _stables_after_rollback(state: Rollout) -> tuple[int, ...] | None:
    """The stable versions once stable is rolled back: back to the latest earlier stable
    that the rollback leaves unretired (an operator may have promoted an older version, so
    an earlier stable can descend from the one rolled back); None when there is none."""
    assert state.stable is not None
    after = _retire(state, state.stable)
    stables = state.stables[:-1]
    while stables and after.retired(stables[-1]):
        stables = stables[:-1]
    return stables or None


def _retire(state: Rollout, version: int) -> Rollout:
    """`state` with `version` rolled back: it and every announced version descending from
    it retired, `current` found again (O(versions); rollbacks are rare)."""
    after = replace(state, rolled_back=state.rolled_back | {version}, _retired=None)
    if state._retired is None:
        return replace(after, _current=_UNKNOWN)
    retired = set(state._retired) | {version}
    for later in sorted(state.announced):  # a base is older than what was trained from it
        base = state.bases.get(later)
        if base is not None and (base in retired or (base >= later and after.retired(later))):
            retired.add(later)
    current = max((v for v in state.announced if v not in retired), default=None)
    return replace(after, _retired=frozenset(retired), _current=current)


def _point(group_id: str, candidate: int) -> float:
    digest = hashlib.sha256(f"{group_id}\0canary\0{candidate}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def describe(state: Rollout) -> Mapping[str, object]:
    """The state as JSON-ready values (`harnessrl policy status`, logs)."""
    return {
        "stable": state.stable,
        "candidate": state.candidate,
        "share": state.share,
        "pinned": state.pinned,
        "newest": state.newest,
        "current": state.current(),
        "serving": sorted(state.serving()),
        "rolled_back": sorted(state.rolled_back),
        "stables": list(state.stables),
    }
