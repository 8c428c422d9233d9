"""Advantages: each estimator follows its formula, in input order, and a group without
reward variance (or of one episode) carries no signal.

The expected values are computed here from the definitions (ARCHITECTURE.md, "Training
math") with exact sums, RLOO by its leave-one-out definition, not by the code's shortcut.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.trust.advantages import Estimator, advantages

PROPERTY = settings(max_examples=150, deadline=None)
ESTIMATORS: tuple[Estimator, ...] = ("grpo", "rloo", "mean")
EPS = st.sampled_from([1e-6, 1e-3, 0.5])

rewards_lists = st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=12)
"""Rewards of a group, not necessarily with variance."""


@st.composite
def varied_rewards(draw: st.DrawFn) -> list[float]:
    """A group's rewards with at least two distinct values."""
    rewards = draw(rewards_lists)
    if len(set(rewards)) == 1:
        rewards[draw(st.integers(0, len(rewards) - 1))] += draw(st.sampled_from([-1.0, 1.0]))
    return rewards


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def grpo(rewards: Sequence[float], eps: float) -> list[float]:
    mean = _mean(rewards)
    std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def rloo(rewards: Sequence[float], eps: float) -> list[float]:
    return [r - _mean([*rewards[:i], *rewards[i + 1 :]]) for i, r in enumerate(rewards)]


def mean_baseline(rewards: Sequence[float], eps: float) -> list[float]:
    mean = _mean(rewards)
    return [r - mean for r in rewards]


FORMULAS: dict[str, Callable[[Sequence[float], float], list[float]]] = {
    "grpo": grpo,
    "rloo": rloo,
    "mean": mean_baseline,
}


def tolerance(rewards: Sequence[float], estimator: str, eps: float) -> float:
    """Absolute error float64 arithmetic may make: a few ulps of the rewards' magnitude per
    term, magnified by grpo's division by (std + eps)."""
    error = 64 * len(rewards) * math.ulp(max(abs(r) for r in rewards) or 1.0)
    if estimator == "grpo":
        mean = _mean(rewards)
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
        error /= std + eps
    return error + 1e-12


def assert_follows_formula(
    got: Sequence[float], rewards: Sequence[float], estimator: str, eps: float
) -> None:
    want = FORMULAS[estimator](rewards, eps)
    assert len(got) == len(want)
    tol = tolerance(rewards, estimator, eps)
    for g, w in zip(got, want, strict=True):
        assert math.isclose(g, w, rel_tol=1e-9, abs_tol=tol), (got, want)


@given(varied_rewards(), st.sampled_from(ESTIMATORS), EPS)
@PROPERTY
def test_each_estimator_follows_its_formula(
    rewards: list[float], estimator: Estimator, eps: float
) -> None:
    got = advantages(rewards, estimator, eps=eps)
    assert got is not None
    assert all(isinstance(a, float) and math.isfinite(a) for a in got)
    assert_follows_formula(got, rewards, estimator, eps)


@given(varied_rewards(), st.sampled_from(ESTIMATORS), st.randoms(use_true_random=False))
@PROPERTY
def test_advantages_follow_the_order_of_the_rewards(
    rewards: list[float], estimator: Estimator, rng: random.Random
) -> None:
    order = list(range(len(rewards)))
    rng.shuffle(order)
    straight = advantages(rewards, estimator)
    shuffled = advantages([rewards[i] for i in order], estimator)
    assert straight is not None and shuffled is not None
    tol = tolerance(rewards, estimator, 1e-6)
    for position, i in enumerate(order):
        assert math.isclose(shuffled[position], straight[i], rel_tol=1e-9, abs_tol=tol)
    # Same input, same bits: rebuilt samples must be byte-identical.
    assert advantages(rewards, estimator) == straight


@given(st.floats(-1e6, 1e6), st.integers(1, 12), st.sampled_from(ESTIMATORS), EPS)
@PROPERTY
def test_groups_without_reward_variance_carry_no_signal(
    reward: float, n: int, estimator: Estimator, eps: float
) -> None:
    assert advantages([reward] * n, estimator, eps=eps) is None


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_group_of_one_or_none_carries_no_signal(estimator: Estimator) -> None:
    assert advantages([1.0], estimator) is None
    assert advantages([], estimator) is None


@given(
    st.lists(st.floats(-1e150, 1e150), min_size=2, max_size=12),
    st.sampled_from(ESTIMATORS),
    EPS,
)
@PROPERTY
def test_advantages_of_finite_rewards_are_finite(
    rewards: list[float], estimator: Estimator, eps: float
) -> None:
    got = advantages(rewards, estimator, eps=eps)
    assert got is None or all(math.isfinite(a) for a in got)


@pytest.mark.parametrize(
    ("estimator", "rewards", "expected"),
    [
        ("grpo", [0.0, 1.0], [-0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)]),
        ("rloo", [0.0, 1.0], [-1.0, 1.0]),
        ("mean", [0.0, 1.0], [-0.5, 0.5]),
        # mean 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5
        ("grpo", [1.0, 2.0, 3.0, 6.0], [x / (math.sqrt(3.5) + 1e-6) for x in (-2, -1, 0, 3)]),
        # 1 - (2+3+6)/3, 2 - (1+3+6)/3, 3 - (1+2+6)/3, 6 - (1+2+3)/3
        ("rloo", [1.0, 2.0, 3.0, 6.0], [-8 / 3, -4 / 3, 0.0, 4.0]),
        ("mean", [1.0, 2.0, 3.0, 6.0], [-2.0, -1.0, 0.0, 3.0]),
        ("rloo", [1.0, 0.0, 0.0], [1.0, -0.5, -0.5]),
    ],
)
def test_hand_checked_advantages(
    estimator: Estimator, rewards: list[float], expected: list[float]
) -> None:
    got = advantages(rewards, estimator, eps=1e-6)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_grpo_uses_the_given_eps() -> None:
    assert advantages([0.0, 1.0], "grpo", eps=0.5) == pytest.approx([-0.5, 0.5])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_non_finite_rewards_are_refused(bad: float, estimator: Estimator) -> None:
    with pytest.raises(ValueError, match="rewards"):
        advantages([0.0, bad, 1.0], estimator)
    with pytest.raises(ValueError, match="rewards"):
        advantages([bad, bad], estimator)  # not mistaken for a zero-variance group


def test_an_unknown_estimator_is_refused() -> None:
    with pytest.raises(ValueError, match="estimator"):
        advantages([0.0, 1.0], "ppo")  # type: ignore[arg-type]


def test_an_unknown_estimator_is_refused_whatever_the_rewards() -> None:
    with pytest.raises(ValueError, match="estimator"):
        advantages([1.0, 1.0], "ppo")  # type: ignore[arg-type]
