"""The baseline of a session that has no group: a running estimate per (app, kind).

A controller's task runs n attempts, and each is compared with its siblings (advantages.py).
A production session is one attempt of a task nobody repeats, so its reward is compared with
what sessions like it earned before: the sessions of the same app and kind whose rewards were
decided earlier. For a key k (the most specific of (app, kind, signal) and its parents with
at least `min_count` rewards behind it):

    A = (R - m_k) / (s_k if scale else 1)

where m_k and s_k are the exponentially weighted mean and standard deviation of the rewards
decided for k before this one, with a half-life of `halflife` sessions (the weight of a
reward halves every `halflife` later rewards, so the estimate follows a policy that
improves), averaging plainly while fewer than `halflife` have arrived; while s_k is 0 (every
reward so far was equal) nothing is divided. With no key that has `min_count` rewards, the
broadest one with any is used, else m = 0 (the first session of an app is trained without a
baseline, never dropped).

Why it is unbiased: m_k depends only on rewards decided before R, not on the actions of this
session, so E[(R - m_k) grad log pi] = E[R grad log pi]; it lowers the variance as far as m_k
tracks E[R | kind] (docs/benchmarks.md has `harnessrl bench baseline`'s simulation).

Deterministic: the state is a plain table, serialised as canonical JSON; the same rewards in
the same order give bit-identical advantages and state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

Key = tuple[str, ...]


@dataclass(slots=True)
class Estimate:
    """Running mean and variance of the rewards decided for one key."""

    count: int = 0
    mean: float = 0.0
    var: float = 0.0

    def update(self, reward: float, halflife: float) -> None:
        self.count += 1
        rate = max(1.0 - 0.5 ** (1.0 / halflife), 1.0 / self.count)
        delta = reward - self.mean
        self.mean += rate * delta
        self.var = (1.0 - rate) * (self.var + rate * delta * delta)


class Baselines:
    """Running per-key baselines; `advantage` reads the estimate, then adds the reward."""

    def __init__(
        self, *, halflife: float = 200.0, min_count: int = 10, scale: bool = False
    ) -> None:
        if not halflife > 0 or min_count < 1:
            raise ValueError("halflife must be > 0 and min_count >= 1")
        self.halflife = float(halflife)
        self.min_count = min_count
        self.scale = scale
        self._table: dict[Key, Estimate] = {}

    def estimate(self, keys: Sequence[Key]) -> Estimate | None:
        """The estimate a reward under `keys` (most specific first) is compared with."""
        held = [e for k in keys if (e := self._table.get(k)) is not None and e.count]
        for e in held:
            if e.count >= self.min_count:
                return e
        return held[-1] if held else None

    def advantage(self, keys: Sequence[Key], reward: float) -> float:
        """The advantage of `reward` against what `keys` held before it; then every key
        in `keys` learns it. Raises ValueError for a non-finite reward or no key."""
        if not keys:
            raise ValueError("keys: at least one")
        if not math.isfinite(reward):
            raise ValueError(f"reward: {reward} is not finite")
        e = self.estimate(keys)
        advantage = reward - (e.mean if e is not None else 0.0)
        # All rewards equal so far (a 0/1 kind that always succeeded): its scale is
        # unknown, not zero; dividing by the floor made the next failure weigh 1000x.
        if self.scale and e is not None and e.count >= self.min_count and e.var > 0.0:
            advantage /= max(math.sqrt(e.var), 1e-3)
        for key in keys:
            self._table.setdefault(tuple(key), Estimate()).update(reward, self.halflife)
        return advantage

    def to_bytes(self) -> bytes:
        rows = sorted(([*k], e.count, e.mean, e.var) for k, e in self._table.items())
        return orjson.dumps(rows)

    def load(self, data: bytes) -> None:
        """Replace the table with a serialised one (`to_bytes`)."""
        table: dict[Key, Estimate] = {}
        for key, count, mean, var in orjson.loads(data) if data else ():
            table[tuple(key)] = Estimate(int(count), float(mean), float(var))
        self._table = table

    def __len__(self) -> int:
        return len(self._table)


def session_keys(app: str, kind: str, signal: str = "") -> list[Key]:
    """The keys of a session's reward (`signal` "": the session reward; else a per-response
    signal name's own baseline), most specific first."""
    if kind:
        return [(app, kind, signal), (app, "", signal)]
    return [(app, "", signal)]
