"""When a canary policy version is promoted or rolled back: an anytime-valid sequential rule.

A candidate version serves a share of production sessions beside the stable one. Each
session adds to its arm's running sums: sessions, rewarded sessions, the sum and the sum of
squares of its reward (rewards lie in [low, high], width B = high - low), and one failure
count per guard (error, no answer). With mu_c, mu_s the arms' mean rewards and
D = mu_c - mu_s, the two hypotheses each decision rejects are

    promote   rejects  H_worse:  D <= -delta   (the candidate is worse by delta or more)
    rollback  rejects  H_good:   D >= 0        (the candidate is not worse at all)

Rule. Each arm's mean has a confidence sequence, a normal-mixture boundary for a
sub-Gaussian sum (Robbins; Howard et al. 2021): a reward in [low, high] is sub-Gaussian
with sigma = B / 2 (Hoeffding's lemma), so for every lambda exp(lambda S_n - lambda^2 n
sigma^2 / 2) is a supermartingale in the arm's n rewards (S_n: their sum minus n mu), and so
is its mixture over lambda ~ N(0, 1 / (m sigma^2)):

    M_n = sqrt(m / (n + m)) * exp(S_n^2 / (2 sigma^2 (n + m)))

Ville's inequality gives P(exists n: M_n >= 1/a) <= a, that is, with probability >= 1 - a,
for every n at once, |mean_n - mu| <= r(n) with

    r(n) = sigma * sqrt((n + m) * log((n + m) / (m * a^2))) / n

Each arm gets a = alpha / 2, so with probability >= 1 - alpha both sequences hold at every
moment and D lies in [L, U] = [d - r_c - r_s, d + r_c + r_s] (d: the difference of the
running means) at every moment, however the sessions interleave and however often `decide`
is called. Once both arms have `min_sessions` rewarded sessions: rollback when U < 0,
promote when L > -delta, else continue. A wrong promotion (L > -delta while D <= -delta)
or a wrong rollback (U < 0 while D >= 0) needs D outside [L, U], so each has probability at
most alpha, and so has their union. Between -delta and 0 both decisions are right (the
indifference zone); the rule stops once U - L < delta, since [L, U] then cannot hold both
0 and -delta. m (`mixture_sessions`) only places where the boundary is tightest; any m > 0
keeps the guarantee.

Guards. A guard's failures are 0 or 1 and rare, so a range bound would be wide: each
arm's failure rate p has its own sequence from the Bernoulli likelihood, a uniform (Beta(1,
1)) mixture of likelihood ratios against p0, M_n(p0) = B(F + 1, n - F + 1) / (p0^F (1 -
p0)^(n - F)) (F failures in n sessions), a martingale under p = p0 with M_0 = 1; by Ville,
the p0 with M_n(p0) < 2/a form a sequence valid at every n with probability >= 1 - a/2
(`failure_bounds`; it narrows with the rate, as a KL bound does). Guard g's interval for
p_c - p_s is the difference of the arms' at its own `alpha`, and it rolls the candidate back
on its own when its lower bound exceeds its `margin` (it rejects p_c - p_s <= margin; a false
rollback by g has probability at most g's alpha). A guard
never holds a promotion back: it is a tripwire, checked before the reward. The reward test
and the guards together wrongly roll back with probability at most alpha + the guards'
alphas (a union bound).

Late rewards. A session's guards are known when it ends, its reward hours later:
`observe_session` counts it at its end, `observe_reward` adds its reward once decided (or
never). The guarantees stand: each arm's sequence is over its rewards in the order they
arrive, and Ville's inequality holds at any stopping time of that order; the guards count
sessions, rewarded or not.

The reward's bound uses the range, not the observed variance, so it is conservative for
rewards that spread little within their range (docs/benchmarks.md has
`harnessrl bench canary`'s simulation). Pure and deterministic: the state is the sums,
serialised as canonical JSON (`to_json`, `from_json`), so a service resumes it after a
restart.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt
import orjson

ARMS = ("stable", "candidate")
Floats = npt.NDArray[np.float64]
Action = Literal["promote", "rollback", "continue"]


@dataclass(frozen=True, slots=True)
class GuardRule:
    """One guard metric: a session either failed it or did not."""

    margin: float = 0.02
    """How much higher the candidate's failure rate may be than stable's (a rate, >= 0)."""
    alpha: float = 0.01
    """The chance of a rollback by this guard while the candidate is within the margin."""


@dataclass(frozen=True, slots=True)
class CanaryConfig:
    """The rule's settings; `validate` names the field of a bad one."""

    alpha: float = 0.05
    """The chance of a wrong reward decision (promotion or rollback), at any stopping time."""
    delta: float = 0.05
    """Non-inferiority margin, in reward units: a candidate worse by less may be promoted."""
    low: float = -1.0
    """The least reward a session can have."""
    high: float = 1.0
    """The largest reward a session can have."""
    min_sessions: int = 100
    """Rewarded sessions each arm needs before any decision (guards: sessions)."""
    mixture_sessions: float = 300.0
    """m of the normal mixture, in sessions: where the boundary is tightest (any m > 0 is valid)."""
    guards: Mapping[str, GuardRule] = field(
        default_factory=lambda: {"error": GuardRule(), "no_answer": GuardRule()}
    )

    def validate(self) -> None:
        """Raises ValueError naming the field that is out of range."""
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha: {self.alpha} is not in (0, 1)")
        if not (math.isfinite(self.delta) and self.delta >= 0.0):
            raise ValueError(f"delta: {self.delta} is not a finite margin >= 0")
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"low, high: [{self.low}, {self.high}] is not a finite range")
        if self.min_sessions < 1:
            raise ValueError(f"min_sessions: {self.min_sessions} is not >= 1")
        if not (math.isfinite(self.mixture_sessions) and self.mixture_sessions > 0.0):
            raise ValueError(f"mixture_sessions: {self.mixture_sessions} is not > 0")
        for name, rule in self.guards.items():
            if not 0.0 < rule.alpha < 1.0:
                raise ValueError(f"guards.{name}.alpha: {rule.alpha} is not in (0, 1)")
            if not (math.isfinite(rule.margin) and 0.0 <= rule.margin < 1.0):
                raise ValueError(f"guards.{name}.margin: {rule.margin} is not in [0, 1)")


def radius(n: Floats, sigma: float, mixture: float, alpha: float) -> Floats:
    """r(n), elementwise: with probability >= 1 - alpha, |mean_n - mu| <= r(n) for every
    n >= 1 at once (n rewards, each sub-Gaussian with `sigma`; the module docstring). The
    benchmark calls it on every session of many runs at once."""
    v = n + mixture  # (...)
    r: Floats = sigma * np.sqrt(v * (np.log(v) - math.log(mixture * alpha * alpha))) / n
    return r


@dataclass(slots=True)
class ArmSums:
    """One arm's running sums."""

    sessions: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)

    def mean(self) -> float:
        return self.reward_sum / self.rewarded if self.rewarded else math.nan


@dataclass(frozen=True, slots=True)
class Interval:
    """A confidence interval for candidate minus stable, valid at every moment."""

    estimate: float
    lower: float
    upper: float


@dataclass(frozen=True, slots=True)
class CanaryDecision:
    """What `decide` concluded and the evidence behind it."""

    action: Action
    reason: str
    """"reward"; the guard that rolled back; or why it continues: "min_sessions", "undecided"."""
    sessions: dict[str, int]
    rewarded: dict[str, int]
    means: dict[str, float]
    reward: Interval
    promote_above: float
    """Promote when reward.lower exceeds this (-delta)."""
    rollback_below: float
    """Roll back when reward.upper falls below this (0)."""
    guards: dict[str, Interval]
    """Per guard, candidate's failure rate minus stable's; rolls back when lower > margin."""


def evidence(decision: CanaryDecision) -> bytes:
    """Canonical JSON (sorted keys; nan and infinite bounds as null) of a decision."""
    return orjson.dumps(asdict(decision), option=orjson.OPT_SORT_KEYS)


class Canary:
    """The running state of one canary; `observe` each session, `decide` at any moment."""

    def __init__(self, config: CanaryConfig, arms: Mapping[str, ArmSums] | None = None) -> None:
        config.validate()
        self.config = config
        self.arms = {arm: ArmSums(failures=dict.fromkeys(config.guards, 0)) for arm in ARMS}
        if arms is not None:
            self.arms.update(arms)

    def observe(self, arm: str, reward: float | None, guard_failures: Mapping[str, bool]) -> None:
        """Add one finished session (`reward` None: it has none, yet its guards count).
        `guard_failures` names every configured guard. Raises ValueError, changing nothing,
        for an unknown arm or guard, a missing guard, or a reward outside [low, high]."""
        self._check(arm, reward)
        self.observe_session(arm, guard_failures)
        if reward is not None:
            self.observe_reward(arm, reward)

    def observe_session(self, arm: str, guard_failures: Mapping[str, bool]) -> None:
        """Count one ended session and its guards, before its reward is known. Raises
        ValueError, changing nothing, as `observe`."""
        self._check(arm, None)
        if set(guard_failures) != set(self.config.guards):
            raise ValueError(
                f"guard_failures: names {sorted(guard_failures)}, the guards are "
                f"{sorted(self.config.guards)}"
            )
        sums = self.arms[arm]
        sums.sessions += 1
        for name, failed in guard_failures.items():
            sums.failures[name] += bool(failed)

    def observe_reward(self, arm: str, reward: float) -> None:
        """Add the reward of a session `observe_session` counted. Raises ValueError, changing
        nothing, for an unknown arm, a reward outside [low, high], or more rewards than
        sessions."""
        self._check(arm, reward)
        sums = self.arms[arm]
        if sums.rewarded >= sums.sessions:
            raise ValueError(f"arm: {arm} has {sums.sessions} sessions, all rewarded already")
        sums.rewarded += 1
        sums.reward_sum += reward
        sums.reward_sq += reward * reward

    def _check(self, arm: str, reward: float | None) -> None:
        if arm not in self.arms:
            raise ValueError(f"arm: {arm!r} is not one of {ARMS}")
        c = self.config
        if reward is not None and not c.low <= reward <= c.high:
            raise ValueError(f"reward: {reward} is not in [{c.low}, {c.high}]")

    def decide(self) -> CanaryDecision:
        """promote, rollback or continue, by the rule of the module docstring. Pure: the
        same sums give the same decision, however often it is called."""
        c, s, k = self.config, self.arms["stable"], self.arms["candidate"]
        sigma = (c.high - c.low) / 2.0
        m = c.mixture_sessions
        reward = difference(
            k.reward_sum,
            k.rewarded,
            s.reward_sum,
            s.rewarded,
            sigma=sigma,
            mixture=m,
            alpha=c.alpha,
        )
        guards = {
            n: rate_difference(k.failures[n], k.sessions, s.failures[n], s.sessions, g.alpha)
            for n, g in c.guards.items()
        }
        action: Action = "continue"
        reason = "min_sessions"
        if min(k.sessions, s.sessions) >= c.min_sessions:
            reason = "undecided"
            tripped = [n for n, g in guards.items() if g.lower > c.guards[n].margin]
            if tripped:
                action, reason = "rollback", tripped[0]
        if reason == "undecided" and min(k.rewarded, s.rewarded) < c.min_sessions:
            reason = "min_sessions"  # enough sessions for the guards, too few rewards yet
        elif reason == "undecided":
            if reward.upper < 0.0:
                action, reason = "rollback", "reward"
            elif reward.lower > -c.delta:
                action, reason = "promote", "reward"
        return CanaryDecision(
            action=action,
            reason=reason,
            sessions={a: self.arms[a].sessions for a in ARMS},
            rewarded={a: self.arms[a].rewarded for a in ARMS},
            means={a: self.arms[a].mean() for a in ARMS},
            reward=reward,
            promote_above=-c.delta,
            rollback_below=0.0,
            guards=guards,
        )

    def to_json(self) -> bytes:
        """Canonical JSON (sorted keys) of the config and the sums."""
        c = self.config
        state = {
            "config": {**asdict(c), "guards": {n: asdict(g) for n, g in c.guards.items()}},
            "arms": {a: asdict(self.arms[a]) for a in ARMS},
        }
        return orjson.dumps(state, option=orjson.OPT_SORT_KEYS)

    @classmethod
    def from_json(cls, data: bytes) -> Canary:
        """The Canary `to_json` wrote; raises ValueError for a bad config in it."""
        state = orjson.loads(data)
        raw = dict(state["config"])
        guards = {n: GuardRule(**g) for n, g in raw.pop("guards").items()}
        config = CanaryConfig(**raw, guards=guards)
        return cls(config, {a: ArmSums(**state["arms"][a]) for a in ARMS})


def difference(
    sum_c: float, n_c: int, sum_s: float, n_s: int, *, sigma: float, mixture: float, alpha: float
) -> Interval:
    """The interval for mean_c - mean_s from each arm's sequence at alpha / 2 (nan/inf bounds
    while an arm is empty)."""
    if not n_c or not n_s:
        return Interval(math.nan, -math.inf, math.inf)
    d = sum_c / n_c - sum_s / n_s
    n = np.array([n_c, n_s], dtype=np.float64)  # (2,)
    r = float(radius(n, sigma, mixture, alpha / 2).sum())
    return Interval(d, d - r, d + r)


def failure_bounds(
    failures: Floats, sessions: Floats, alpha: float, iterations: int = 48
) -> tuple[Floats, Floats]:
    """Elementwise [lower, upper] for a failure rate from `failures` of `sessions`, valid at
    every n at once with probability >= 1 - alpha: the p0 whose Beta(1, 1) mixture of
    likelihood ratios stays below 1/alpha (the module docstring), by bisection on each side
    of the observed rate (which is always inside), rounded outwards. The benchmark calls it
    on every session of many runs at once."""
    f, n = np.asarray(failures, np.float64), np.asarray(sessions, np.float64)
    log_b = _lgamma(f + 1.0) + _lgamma(n - f + 1.0) - _lgamma(n + 2.0)
    level = math.log(alpha) + log_b  # p0 is kept while its log-likelihood is above this
    rate = np.divide(f, n, out=np.full_like(n, 0.5), where=n > 0)

    def kept(p: Floats) -> npt.NDArray[np.bool_]:
        with np.errstate(divide="ignore", invalid="ignore"):
            hits = np.where(f > 0, f * np.log(p), 0.0)
            misses = np.where(n > f, (n - f) * np.log1p(-p), 0.0)
        out: npt.NDArray[np.bool_] = hits + misses > level
        return out

    low, high = np.zeros_like(rate), rate.copy()  # the lower end lies in [low, high]
    up_low, up_high = rate.copy(), np.ones_like(rate)  # the upper end in [up_low, up_high]
    for _ in range(iterations):
        mid = (low + high) / 2
        inside = kept(mid)
        high, low = np.where(inside, mid, high), np.where(inside, low, mid)
        mid = (up_low + up_high) / 2
        inside = kept(mid)
        up_low, up_high = np.where(inside, mid, up_low), np.where(inside, up_high, mid)
    return np.where(f > 0, low, 0.0), np.where(f < n, up_high, 1.0)


def rate_difference(failed_c: int, n_c: int, failed_s: int, n_s: int, alpha: float) -> Interval:
    """The interval for rate_c - rate_s from each arm's `failure_bounds` at alpha / 2."""
    if not n_c or not n_s:
        return Interval(math.nan, -math.inf, math.inf)
    low, high = failure_bounds(np.array([failed_c, failed_s]), np.array([n_c, n_s]), alpha / 2)
    estimate = failed_c / n_c - failed_s / n_s
    return Interval(estimate, float(low[0] - high[1]), float(high[0] - low[1]))


def _lgamma(x: Floats) -> Floats:
    import torch

    out: Floats = torch.lgamma(torch.from_numpy(np.ascontiguousarray(x))).numpy()
    return out
