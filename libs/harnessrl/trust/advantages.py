"""Advantages: one number per episode, from its reward against its group's rewards.

The estimators (ARCHITECTURE.md, "Training math"), for rewards r_1..r_n of one group:

- grpo: (r_i - mean(r)) / (std(r) + eps), std over the group (population, ddof=0);
- rloo: r_i - mean of the other n-1 rewards  ==  n / (n-1) * (r_i - mean(r));
- mean: r_i - mean(r).

A group whose rewards are all equal carries no signal under any of them (every advantage is
0), so it yields None and the caller drops it. Computed in float64, in input order, so the
same rewards always give bit-identical advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

Estimator = Literal["grpo", "rloo", "mean"]


def advantages(
    rewards: Sequence[float], estimator: Estimator, *, eps: float = 1e-6
) -> list[float] | None:
    """Per-episode advantages in the order of `rewards`; None when the group has zero reward
    variance (or fewer than two episodes). Raises ValueError for an unknown estimator or a
    non-finite reward."""
    if estimator not in ("grpo", "rloo", "mean"):
        raise ValueError(f"estimator: {estimator!r} is not grpo, rloo or mean")
    r = np.asarray(rewards, dtype=np.float64)  # [n]
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards: must be finite")
    if r.size < 2 or np.ptp(r) == 0.0:
        return None
    centred = r - r.mean()
    if estimator == "grpo":
        out = centred / (r.std() + eps)
    elif estimator == "rloo":
        out = centred * (r.size / (r.size - 1))
    else:
        out = centred
    return [float(a) for a in out]
