"""The running per-(app, kind) baseline of production sessions (trust/session_baseline.py),
and `harnessrl bench baseline`'s simulation of it at a toy size."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from harnessrl.apps.cli import main
from harnessrl.trust.session_baseline import Baselines, session_keys

APP_A = session_keys("app", "a")
APP_B = session_keys("app", "b")


def _rewards(seed: int, n: int) -> list[tuple[list[tuple[str, ...]], float]]:
    rng = np.random.default_rng(seed)
    kinds = [APP_A, APP_B, session_keys("app", ""), session_keys("other", "a")]
    return [
        (kinds[int(k)], float(r))
        for k, r in zip(rng.integers(0, 4, n), rng.normal(0.5, 0.3, n), strict=True)
    ]


def _bits(values: list[float]) -> bytes:
    return b"".join(struct.pack("<d", v) for v in values)


def test_same_rewards_in_the_same_order_give_bit_identical_advantages_and_state() -> None:
    rewards = _rewards(1, 500)
    runs = []
    for _ in range(2):
        baselines = Baselines(halflife=20.0, min_count=5, scale=True)
        runs.append(([baselines.advantage(k, r) for k, r in rewards], baselines.to_bytes()))
    assert _bits(runs[0][0]) == _bits(runs[1][0])
    assert runs[0][1] == runs[1][1]


def test_load_of_to_bytes_restores_the_table_and_what_follows_is_identical() -> None:
    rewards = _rewards(2, 400)
    kept = Baselines(halflife=20.0, min_count=5)
    for keys, reward in rewards[:200]:
        kept.advantage(keys, reward)
    restored = Baselines(halflife=20.0, min_count=5)
    restored.load(kept.to_bytes())
    assert restored.to_bytes() == kept.to_bytes()
    assert len(restored) == len(kept) == 5
    after_kept = [kept.advantage(k, r) for k, r in rewards[200:]]
    after_restored = [restored.advantage(k, r) for k, r in rewards[200:]]
    assert _bits(after_kept) == _bits(after_restored)
    assert restored.to_bytes() == kept.to_bytes()
    empty = Baselines()
    empty.load(b"")
    assert len(empty) == 0


def test_without_history_the_baseline_is_zero() -> None:
    assert Baselines().advantage(APP_A, 0.75) == 0.75


def test_a_kind_with_few_rewards_is_compared_with_its_apps_estimate() -> None:
    baselines = Baselines(halflife=1e9, min_count=10)
    for _ in range(20):
        baselines.advantage(APP_A, 1.0)
    # b has no reward yet, then fewer than min_count: the app's mean (twenty 1.0s, then b's 0s)
    assert baselines.advantage(APP_B, 0.0) == -1.0
    for seen in range(1, 10):
        app_mean = 20 / (20 + seen)
        assert baselines.advantage(APP_B, 0.0) == pytest.approx(-app_mean, abs=1e-12)
    # b has min_count rewards (all 0.0): its own mean from now on
    assert baselines.advantage(APP_B, 0.5) == 0.5


def test_with_too_few_rewards_anywhere_the_broadest_key_is_used() -> None:
    baselines = Baselines(halflife=1e9, min_count=10)
    baselines.advantage(APP_A, 1.0)
    baselines.advantage(APP_B, 0.0)
    # a has 1 reward (1.0), the app 2 (mean 0.5): the app's
    assert baselines.advantage(APP_A, 1.0) == 0.5


def test_after_a_shift_the_estimate_moves_halfway_within_halflife_rewards() -> None:
    halflife = 20
    baselines = Baselines(halflife=halflife, min_count=1)
    for _ in range(10 * halflife):
        baselines.advantage(APP_A, 0.0)
    means = []
    for _ in range(2 * halflife):
        estimate = baselines.estimate(APP_A)
        assert estimate is not None
        means.append(estimate.mean)
        baselines.advantage(APP_A, 1.0)
    # means[i]: the estimate after i rewards at the new level
    assert means[halflife] == pytest.approx(0.5, abs=1e-9)
    assert means[halflife - 1] < 0.5 < means[halflife + 1]
    assert means[2 * halflife - 1] == pytest.approx(1 - 0.5 ** ((2 * halflife - 1) / halflife))


def test_scale_divides_by_the_running_std_once_min_count_is_reached() -> None:
    rewards = [0.0, 1.0, 1.0, 0.0, 1.0, 0.3, 0.9, 0.2]
    min_count = 4
    baselines = Baselines(halflife=1e9, min_count=min_count, scale=True)
    for i, reward in enumerate(rewards):
        earlier = np.array(rewards[:i])
        mean = float(earlier.mean()) if i else 0.0
        expected = reward - mean
        if i >= min_count:
            expected /= float(earlier.std())
        assert baselines.advantage(APP_A, reward) == pytest.approx(expected, rel=1e-12), i


def test_unscaled_advantages_are_never_divided() -> None:
    baselines = Baselines(halflife=1e9, min_count=2)
    for reward in (0.0, 10.0, 0.0, 10.0):
        baselines.advantage(APP_A, reward)
    assert baselines.advantage(APP_A, 10.0) == 5.0


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_refused_and_nothing_is_learned(reward: float) -> None:
    baselines = Baselines()
    baselines.advantage(APP_A, 1.0)
    before = baselines.to_bytes()
    with pytest.raises(ValueError, match=r"reward: .* is not finite"):
        baselines.advantage(APP_A, reward)
    assert baselines.to_bytes() == before


def test_empty_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="keys: at least one"):
        Baselines().advantage([], 1.0)


@pytest.mark.parametrize(("halflife", "min_count"), [(0.0, 10), (-1.0, 10), (200.0, 0)])
def test_bad_settings_are_refused(halflife: float, min_count: int) -> None:
    with pytest.raises(ValueError, match="halflife must be > 0 and min_count >= 1"):
        Baselines(halflife=halflife, min_count=min_count)


def test_session_keys_go_from_the_kind_to_the_app() -> None:
    assert session_keys("app", "kind") == [("app", "kind", ""), ("app", "", "")]
    assert session_keys("app", "", "thumbs") == [("app", "", "thumbs")]


def test_bench_baseline_per_kind_lowers_the_gradient_variance_without_bias(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The simulation at a toy size: a check of the estimators, not a timing."""
    small = ["--sessions", "6000", "--train-sessions", "1000", "--runs", "2", "--seed", "3"]
    assert main(["bench", "baseline", "--json", *small]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert (result["seed"], result["sessions"]) == (3, 6000)
    variance = result["variance"]
    assert variance["none"]["ratio_to_none"] == 1.0
    assert variance["per_kind"]["grad_variance"] < 0.8 * variance["none"]["grad_variance"]
    assert variance["per_kind"]["grad_variance"] < variance["global_mean"]["grad_variance"]
    for name in ("none", "global_mean", "per_kind", "cohort_loo", "oracle"):
        figures = variance[name]
        assert figures["bias_rel"] < 4 * figures["noise_rel"], name
    convergence = result["convergence"]
    assert convergence["seeds"] == [3, 4]
    for name in ("none", "per_kind", "per_kind_scaled", "cohort_loo"):
        rate = convergence[name]["success_rate"]
        assert convergence["uniform_success_rate"] < rate < convergence["best_success_rate"]
    assert "variance per_kind" in out.err


def test_a_key_whose_rewards_were_all_equal_is_not_divided() -> None:
    """A 0/1 kind that always succeeded so far has no scale yet: its first failure counts
    -1, not -1 / 1e-3 (one session weighing a thousand)."""
    baselines = Baselines(halflife=200.0, min_count=10, scale=True)
    for _ in range(10):
        baselines.advantage(APP_A, 1.0)
    assert baselines.advantage(APP_A, 0.0) == -1.0
    estimate = baselines.estimate(APP_A)
    assert estimate is not None
    mean, std = estimate.mean, math.sqrt(estimate.var)
    assert baselines.advantage(APP_A, 1.0) == pytest.approx((1.0 - mean) / std, rel=1e-12)


def test_scaled_advantages_stay_bounded_when_rewards_are_exactly_0_1_or_thumbs() -> None:
    """Rewards exactly 0/1 and ±1: kinds start with runs of equal rewards."""
    from harnessrl.bench.session_baseline import SimulationSettings, simulate

    for seed in (1, 2):
        run = simulate(
            "per_kind_scaled", 20_000, seed, lr=0.0, settings=SimulationSettings(noise=0.0)
        )
        assert np.nanmax(np.abs(run.advantage)) < 20, seed
