"""The canary rule (trust/canary.py): no decision before the minimum, clear cases decided the
right way, a false rollback as rare as alpha says, its state resumable from JSON."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from harnessrl.trust.canary import ARMS, Canary, CanaryConfig, GuardRule, evidence

BINARY = CanaryConfig(low=0.0, high=1.0, min_sessions=50)
NO_FAILURES = {"error": False, "no_answer": False}


def run(config: CanaryConfig, means: dict[str, float], seed: int, sessions: int = 20_000) -> Canary:
    """Sessions alternate between the arms with 0/1 rewards until a decision (or `sessions`)."""
    rng = np.random.default_rng(seed)
    canary = Canary(config)
    for i in range(sessions):
        arm = ARMS[i % 2]
        canary.observe(arm, float(rng.random() < means[arm]), NO_FAILURES)
        if canary.decide().action != "continue":
            break
    return canary


def test_state_round_trips_through_canonical_json() -> None:
    canary = run(BINARY, {"stable": 0.6, "candidate": 0.6}, seed=3, sessions=301)
    canary.observe("candidate", None, {"error": True, "no_answer": False})
    data = canary.to_json()
    resumed = Canary.from_json(data)
    assert resumed.to_json() == data
    assert resumed.decide() == canary.decide()
    assert resumed.arms["candidate"].failures == {"error": 1, "no_answer": 0}
    assert resumed.arms["candidate"].sessions == resumed.arms["candidate"].rewarded + 1


def test_no_decision_before_each_arm_has_the_minimum() -> None:
    canary = Canary(BINARY)
    for _ in range(500):
        canary.observe("stable", 1.0, NO_FAILURES)
    for _ in range(49):
        canary.observe("candidate", 0.0, {"error": True, "no_answer": True})
    decision = canary.decide()
    assert (decision.action, decision.reason) == ("continue", "min_sessions")
    canary.observe("candidate", 0.0, {"error": True, "no_answer": True})
    assert canary.decide().action == "rollback"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_clearly_worse_candidate_is_rolled_back(seed: int) -> None:
    decision = run(BINARY, {"stable": 0.6, "candidate": 0.3}, seed).decide()
    assert (decision.action, decision.reason) == ("rollback", "reward")
    assert decision.reward.upper < decision.rollback_below


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_clearly_better_candidate_is_promoted(seed: int) -> None:
    decision = run(BINARY, {"stable": 0.5, "candidate": 0.8}, seed).decide()
    assert (decision.action, decision.reason) == ("promote", "reward")
    assert decision.reward.lower > decision.promote_above


def test_a_guard_rolls_back_a_candidate_whose_rewards_are_equal() -> None:
    config = CanaryConfig(low=0.0, high=1.0, min_sessions=50, guards={"error": GuardRule(0.02)})
    rng = np.random.default_rng(0)
    canary = Canary(config)
    for i in range(20_000):
        arm = ARMS[i % 2]
        failed = rng.random() < (0.4 if arm == "candidate" else 0.01)
        canary.observe(arm, float(rng.random() < 0.6), {"error": bool(failed)})
        if canary.decide().action != "continue":
            break
    decision = canary.decide()
    assert (decision.action, decision.reason) == ("rollback", "error")
    assert decision.guards["error"].lower > 0.02


def test_equal_arms_are_rarely_rolled_back() -> None:
    """200 runs checked after every session: false rollbacks stay under alpha plus slack
    (the bound is conservative, so in practice far under)."""
    config = CanaryConfig(low=0.0, high=1.0, alpha=0.1, min_sessions=20, guards={})
    rng = np.random.default_rng(7)
    rolled_back = 0
    for _ in range(200):
        canary = Canary(config)
        for i in range(4_000):
            canary.observe(ARMS[i % 2], float(rng.random() < 0.5), {})
            if (action := canary.decide().action) != "continue":
                rolled_back += action == "rollback"
                break
    assert rolled_back / 200 <= config.alpha + 0.05


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (CanaryConfig(alpha=0.0), "alpha"),
        (CanaryConfig(alpha=1.5), "alpha"),
        (CanaryConfig(delta=-0.1), "delta"),
        (CanaryConfig(low=1.0, high=0.0), "low, high"),
        (CanaryConfig(min_sessions=0), "min_sessions"),
        (CanaryConfig(guards={"error": GuardRule(margin=-0.1)}), "guards.error.margin"),
        (CanaryConfig(guards={"error": GuardRule(alpha=1.0)}), "guards.error.alpha"),
    ],
)
def test_bad_configuration_names_its_field(config: CanaryConfig, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        Canary(config)


def test_bad_observations_name_their_field_and_change_nothing() -> None:
    canary = Canary(BINARY)
    before = canary.to_json()
    with pytest.raises(ValueError, match=r"^arm:"):
        canary.observe("canary", 1.0, NO_FAILURES)
    with pytest.raises(ValueError, match=r"^reward:"):
        canary.observe("candidate", 1.5, NO_FAILURES)
    with pytest.raises(ValueError, match=r"^guard_failures:"):
        canary.observe("candidate", 1.0, {"error": False, "latency": True})
    assert canary.to_json() == before


def test_sessions_without_rewards_count_for_the_guards_only() -> None:
    canary = Canary(BINARY)
    for arm in ARMS:
        for _ in range(200):
            canary.observe(arm, None, NO_FAILURES)
        for _ in range(10):
            canary.observe(arm, 1.0, NO_FAILURES)
    decision = canary.decide()
    assert (decision.action, decision.reason) == ("continue", "min_sessions")
    assert decision.sessions == {"stable": 210, "candidate": 210}
    assert decision.rewarded == {"stable": 10, "candidate": 10}


def test_a_session_counted_at_its_end_and_rewarded_later_equals_one_observed_at_once() -> None:
    rng = np.random.default_rng(7)
    at_once, late = Canary(BINARY), Canary(BINARY)
    pending: list[tuple[str, float]] = []
    for i in range(400):
        arm = ARMS[i % 2]
        reward = float(rng.random() < 0.6)
        failures = {"error": bool(rng.random() < 0.05), "no_answer": False}
        at_once.observe(arm, reward, failures)
        late.observe_session(arm, failures)
        pending.append((arm, reward))
        if i % 3 == 0:  # rewards arrive in batches, after the sessions ended
            for waiting in pending:
                late.observe_reward(*waiting)
            pending.clear()
    for waiting in pending:
        late.observe_reward(*waiting)
    assert late.decide() == at_once.decide()
    assert late.to_json() == at_once.to_json()


def test_a_session_without_a_reward_counts_for_the_guards_only() -> None:
    canary = Canary(BINARY)
    canary.observe_session("candidate", {"error": True, "no_answer": False})
    sums = canary.arms["candidate"]
    assert (sums.sessions, sums.rewarded, sums.failures["error"]) == (1, 0, 1)
    assert canary.decide().rewarded == {"stable": 0, "candidate": 0}


def test_a_reward_without_its_session_or_out_of_range_is_refused_unchanged() -> None:
    canary = Canary(BINARY)
    with pytest.raises(ValueError, match="all rewarded already"):
        canary.observe_reward("stable", 1.0)
    canary.observe_session("stable", NO_FAILURES)
    with pytest.raises(ValueError, match=r"reward: 2\.0 is not in"):
        canary.observe_reward("stable", 2.0)
    with pytest.raises(ValueError, match="arm: 'canary'"):
        canary.observe_reward("canary", 1.0)
    with pytest.raises(ValueError, match="guard_failures"):
        canary.observe_session("stable", {"error": False})
    assert canary.arms["stable"].sessions == 1
    assert canary.arms["stable"].rewarded == 0
    canary.observe_reward("stable", 1.0)
    assert canary.arms["stable"].reward_sum == 1.0


def test_evidence_is_canonical_json_of_the_decision() -> None:
    canary = run(BINARY, {"stable": 0.6, "candidate": 0.3}, seed=0)
    decision = canary.decide()
    data = evidence(decision)
    assert data == evidence(Canary.from_json(canary.to_json()).decide())
    parsed = orjson.loads(data)
    assert parsed["action"] == "rollback"
    assert parsed["sessions"] == decision.sessions
    assert list(parsed) == sorted(parsed)
    assert orjson.loads(evidence(Canary(BINARY).decide()))["reward"]["lower"] is None


def test_failure_bounds_hold_at_every_session_with_the_stated_probability() -> None:
    """Rare failures (5%), 300 sequences of 2,000 sessions, alpha 0.1: the share of
    sequences whose interval ever leaves out the true rate stays under alpha."""
    from harnessrl.trust.canary import failure_bounds

    rng = np.random.default_rng(7)
    failed = np.cumsum(rng.random((300, 2000)) < 0.05, axis=1).astype(np.float64)
    sessions = np.broadcast_to(np.arange(1, 2001, dtype=np.float64), failed.shape)
    low, high = failure_bounds(failed, sessions, 0.1)
    missed = ((low > 0.05) | (high < 0.05)).any(axis=1).mean()
    assert missed <= 0.1
    assert np.all(low <= failed / sessions) and np.all(failed / sessions <= high)


def test_failure_bounds_narrow_with_a_rare_rate_and_are_whole_when_empty() -> None:
    from harnessrl.trust.canary import failure_bounds, radius

    low, high = failure_bounds(np.array([10.0, 0.0, 5.0]), np.array([1000.0, 0.0, 5.0]), 0.01)
    assert 0.0 < low[0] < 0.01 < high[0] < 0.035  # 1% of 1,000
    range_bound = float(radius(np.array([1000.0]), 0.5, 300.0, 0.01)[0])
    assert high[0] - low[0] < range_bound  # narrower than the range-based sequence's radius
    assert (low[1], high[1]) == (0.0, 1.0)  # nothing seen yet
    assert high[2] == 1.0 and low[2] > 0.25  # every session failed


def test_a_guard_rolls_back_a_candidate_failing_ten_times_as_often_in_a_few_hundred() -> None:
    config = CanaryConfig(min_sessions=50, guards={"error": GuardRule(margin=0.02, alpha=0.01)})
    canary = Canary(config)
    rng = np.random.default_rng(3)
    for i in range(4000):
        arm = ARMS[i % 2]
        failed = rng.random() < (0.10 if arm == "candidate" else 0.01)
        canary.observe_session(arm, {"error": failed})
        if canary.decide().action != "continue":
            break
    decision = canary.decide()
    assert (decision.action, decision.reason) == ("rollback", "error")
    assert sum(decision.sessions.values()) < 2500
