"""The fold of hrl.policy into the canary's state (harnessrl.rollout): which version is stable,
which is the candidate, which decisions apply, and which arm a new session gets."""

from __future__ import annotations

import math
import uuid

import pytest

from harnessrl.rollout import (
    AUTO_ACTOR,
    CanarySection,
    Rollout,
    RolloutState,
    describe,
    refusal,
    session_failures,
)
from harnessrl.v1 import events_pb2 as pb

START = pb.ROLLOUT_ACTION_START
PROMOTE = pb.ROLLOUT_ACTION_PROMOTE
ROLLBACK = pb.ROLLOUT_ACTION_ROLLBACK
PIN = pb.ROLLOUT_ACTION_PIN
UNPIN = pb.ROLLOUT_ACTION_UNPIN


def version(number: int, base: int | None = None) -> pb.PolicyVersion:
    event = pb.PolicyVersion(version=number, step=number)
    if base is not None:
        event.base = base
    return event


def decision(
    action: int,
    number: int,
    stable: int,
    *,
    share: float = 0.0,
    actor: str = AUTO_ACTOR,
    decision_id: str | None = None,
) -> pb.RolloutDecision:
    return pb.RolloutDecision(
        decision_id=decision_id or uuid.uuid4().hex,
        action=action,
        version=number,
        stable=stable,
        actor=actor,
        share=share,
    )


def folded(*versions: int) -> RolloutState:
    """A fold that saw PolicyVersion 0..n in order, each trained from the one before."""
    fold = RolloutState()
    for number in versions:
        fold.announced(version(number))
    return fold


def _without_id(event: pb.RolloutDecision) -> pb.RolloutDecision:
    event.decision_id = ""
    return event


def apply(fold: RolloutState, event: pb.RolloutDecision) -> None:
    reason = fold.decided(event)
    assert reason is None, reason


def test_the_first_version_announced_is_stable_and_nothing_is_pending() -> None:
    fold = RolloutState()
    assert fold.state == Rollout()
    assert fold.assign("g", lambda v: True) is None  # nothing to serve yet
    fold.announced(version(0))
    fold.announced(version(1))
    fold.announced(version(2))
    state = fold.state
    assert (state.stable, state.candidate, state.newest, state.current()) == (0, None, 2, 2)
    assert state.stables == (0,)
    assert state.serving() == {0, 2}
    fold.announced(version(1, base=0))  # a copy of an announcement changes nothing
    assert fold.state == state


def test_a_decision_before_any_version_is_refused() -> None:
    assert RolloutState().decided(decision(START, 1, 0, share=0.1)) == (
        "no policy version has been announced yet"
    )


@pytest.mark.parametrize(
    ("setup", "event", "reason"),
    [
        (
            [decision(PIN, 0, 0)],
            decision(START, 2, 0, share=0.1),
            "version: stable version 0 is pinned; unpin first",
        ),
        (
            [decision(START, 1, 0, share=0.1)],
            decision(START, 2, 0, share=0.1),
            "version: candidate 1 is still pending",
        ),
        ([], decision(START, 0, 0, share=0.1), "version: 0 is not newer than stable version 0"),
        (
            [decision(START, 1, 0, share=0.1), decision(ROLLBACK, 1, 0)],
            decision(START, 2, 0, share=0.1),  # 2 was trained from 1
            "version: 2 was rolled back or descends from a version that was",
        ),
        ([], decision(START, 2, 0, share=0.0), "share: 0.0 is not in (0, 1)"),
        ([], decision(START, 2, 0, share=1.0), "share: 1.0 is not in (0, 1)"),
        ([], decision(START, 2, 0, share=math.nan), "share: nan is not in (0, 1)"),
        ([], decision(START, 9, 0, share=0.1), "version: 9 was never announced by the trainer"),
        ([], decision(0, 2, 0), "action: 0 is not a rollout action"),
        ([], _without_id(decision(START, 2, 0, share=0.1)), "decision_id: required"),
    ],
)
def test_start_is_refused_when_it_cannot_apply(
    setup: list[pb.RolloutDecision], event: pb.RolloutDecision, reason: str
) -> None:
    fold = folded(0, 1, 2)
    for earlier in setup:
        apply(fold, earlier)
    before = fold.state
    assert refusal(before, event) == reason  # what the CLI and the judge check first
    assert fold.decided(event) == reason
    assert fold.state == before and fold.state.last is before.last  # nothing changed


def test_start_makes_the_candidate_and_promote_makes_it_stable() -> None:
    fold = folded(0, 1, 2)
    apply(fold, decision(START, 2, 0, share=0.25))
    state = fold.state
    assert (state.stable, state.candidate, state.share) == (0, 2, 0.25)
    assert state.serving() == {0, 2}
    assert fold.decided(decision(PROMOTE, 1, 0)) == "version: candidate 2 is pending, not 1"
    apply(fold, decision(PROMOTE, 2, 0))
    state = fold.state
    assert (state.stable, state.candidate, state.share, state.pinned) == (2, None, 0.0, False)
    assert state.stables == (0, 2)
    assert state.last is not None and state.last.action == PROMOTE


def test_an_operator_promotes_any_announced_version_when_none_is_pending() -> None:
    fold = folded(0, 1, 2, 3)
    operator = "operator:alice"
    assert fold.decided(decision(PROMOTE, 0, 0, actor=operator)) == "version: 0 is already stable"
    apply(fold, decision(PROMOTE, 2, 0, actor=operator))
    assert (fold.state.stable, fold.state.stables) == (2, (0, 2))
    apply(fold, decision(PROMOTE, 1, 2, actor=operator))  # back to an older one: allowed
    assert (fold.state.stable, fold.state.stables) == (1, (0, 2, 1))


def test_rolling_back_the_candidate_retires_it_and_every_version_trained_from_it() -> None:
    fold = folded(0, 1, 2, 3)  # 3 was trained from 2, 2 from 1
    apply(fold, decision(START, 2, 0, share=0.1))
    assert fold.decided(decision(ROLLBACK, 3, 0)) == "version: candidate 2 is pending, not 3"
    apply(fold, decision(ROLLBACK, 2, 0))
    state = fold.state
    assert (state.stable, state.candidate, state.share) == (0, None, 0.0)
    assert state.rolled_back == {2}
    assert [state.retired(v) for v in range(4)] == [False, False, True, True]
    # The trainer rewinds to stable 0 and goes on from there; a version still trained from
    # 3 (published before the trainer saw the rollback) is retired by its lineage.
    fold.announced(version(4, base=0))
    fold.announced(version(5, base=3))
    state = fold.state
    assert (state.retired(4), state.retired(5)) == (False, True)
    assert state.current() == 4  # the newest version not retired, though 5 is newer
    assert state.newest == 5
    assert state.serving() == {0, 4}
    assert fold.decided(decision(START, 5, 0, share=0.1)) == (
        "version: 5 was rolled back or descends from a version that was"
    )
    apply(fold, decision(START, 4, 0, share=0.1))
    assert fold.state.candidate == 4


def test_current_is_the_ancestor_line_until_the_trainer_announces_past_a_rollback() -> None:
    fold = folded(0, 1, 2)
    apply(fold, decision(START, 2, 0, share=0.1))
    apply(fold, decision(ROLLBACK, 2, 0))
    assert fold.state.current() == 1  # 1 was not rolled back: 2 descends from it, not it from 2
    fold.announced(version(3, base=0))
    assert fold.state.current() == 3
    assert fold.state.serving() == {0, 3}


def test_an_operator_rollback_of_stable_returns_to_the_stable_before() -> None:
    fold = folded(0, 1, 2, 3)
    assert fold.decided(decision(ROLLBACK, 0, 0)) == (
        "version: 0 is the first stable version; nothing to roll back to"
    )
    assert fold.decided(decision(ROLLBACK, 1, 0)) == (
        "version: no candidate is pending and 1 is not stable"
    )
    apply(fold, decision(START, 1, 0, share=0.1))
    apply(fold, decision(PROMOTE, 1, 0))
    apply(fold, decision(START, 2, 1, share=0.1))
    apply(fold, decision(PROMOTE, 2, 1))
    apply(fold, decision(ROLLBACK, 2, 2, actor="operator:bob"))
    state = fold.state
    assert (state.stable, state.stables, state.rolled_back) == (1, (0, 1), {2})
    assert state.retired(3) and state.current() == 1


def test_rolling_back_stable_skips_earlier_stables_that_descend_from_it() -> None:
    """An operator promoted an older version over a newer one trained from it: rolling that
    older version back retires the newer one too, so stable goes back past both."""
    fold = folded(0, 1, 2)
    apply(fold, decision(PROMOTE, 2, 0, actor="operator:a"))
    apply(fold, decision(PROMOTE, 1, 2, actor="operator:a"))
    assert fold.state.stables == (0, 2, 1)
    apply(fold, decision(ROLLBACK, 1, 1, actor="operator:a"))
    state = fold.state
    assert (state.stable, state.stables) == (0, (0,))
    assert not state.retired(state.stable)


def test_a_rollback_of_stable_is_refused_when_every_earlier_stable_would_be_retired() -> None:
    fold = folded(0, 1)
    fold.announced(version(5, base=1))
    apply(fold, decision(PROMOTE, 1, 0, actor="operator:a"))
    apply(fold, decision(ROLLBACK, 1, 1, actor="operator:a"))  # back to 0
    assert fold.state.stable == 0
    fold2 = RolloutState()
    fold2.announced(version(3))
    fold2.announced(version(4, base=3))
    apply(fold2, decision(PROMOTE, 4, 3, actor="operator:a"))
    apply(fold2, decision(ROLLBACK, 4, 4, actor="operator:a"))
    assert fold2.state.stable == 3
    assert fold2.decided(decision(ROLLBACK, 3, 3)) == (
        "version: 3 is the first stable version; nothing to roll back to"
    )


def test_pin_is_refused_while_a_candidate_is_pending_and_holds_candidates_off() -> None:
    fold = folded(0, 1, 2)
    apply(fold, decision(START, 2, 0, share=0.1))
    assert fold.decided(decision(PIN, 1, 0)) == (
        "version: candidate 2 is pending; promote or roll it back first"
    )
    apply(fold, decision(ROLLBACK, 2, 0))
    assert fold.decided(decision(PIN, 2, 0)) == (
        "version: 2 was rolled back or descends from a version that was"
    )
    apply(fold, decision(PIN, 1, 0, actor="operator:carol"))
    state = fold.state
    assert (state.stable, state.pinned, state.stables) == (1, True, (0, 1))
    assert fold.decided(decision(START, 1, 1, share=0.1)) == (
        "version: stable version 1 is pinned; unpin first"
    )
    assert fold.decided(decision(PROMOTE, 0, 1)) == (
        "version: stable version 1 is pinned; unpin first"
    )
    assert fold.decided(decision(ROLLBACK, 1, 1)) == (
        "version: stable version 1 is pinned; unpin first"
    )
    apply(fold, decision(PIN, 1, 1))  # pinning the stable version again: allowed
    assert fold.state.stables == (0, 1)


def test_unpin_lets_candidates_start_again() -> None:
    fold = folded(0, 1, 2)
    assert fold.decided(decision(UNPIN, 0, 0)) == "unpin: no version is pinned"
    apply(fold, decision(PIN, 0, 0))
    apply(fold, decision(UNPIN, 0, 0))
    assert fold.state.pinned is False and fold.state.stable == 0
    apply(fold, decision(START, 2, 0, share=0.1))
    assert fold.state.candidate == 2


def test_a_decision_made_against_another_stable_is_refused() -> None:
    fold = folded(0, 1, 2)
    apply(fold, decision(START, 1, 0, share=0.1))
    apply(fold, decision(PROMOTE, 1, 0))
    stale = decision(START, 2, 0, share=0.1)  # the judge still saw 0 as stable
    assert fold.decided(stale) == "stable: the decision was made against version 0, but 1 is stable"
    assert "made against version 0" in str(fold.decided(decision(UNPIN, 0, 0)))
    assert fold.state.candidate is None


def test_a_decision_applies_once_and_a_refused_one_is_judged_again_only_when_republished() -> None:
    fold = folded(0, 1, 2)
    start = decision(START, 2, 0, share=0.1, decision_id="canary/2/start")
    apply(fold, start)
    assert fold.outcome("canary/2/start") == (True, None)
    assert fold.decided(start) is None  # a copy (at-least-once delivery) changes nothing
    apply(fold, decision(PROMOTE, 2, 0))
    assert fold.decided(start) is None and fold.state.candidate is None
    # The judge's START lands just after an operator's pin and is refused; after the unpin
    # it publishes the same id again, which then applies.
    fold2 = folded(0, 1, 2)
    apply(fold2, decision(PIN, 0, 0, actor="operator:a"))
    first = decision(START, 2, 0, share=0.1, decision_id="canary/2/start")
    first.decided_at.FromSeconds(100)
    pinned = "version: stable version 0 is pinned; unpin first"
    assert fold2.decided(first) == pinned
    assert fold2.outcome("canary/2/start") == (True, pinned)
    apply(fold2, decision(UNPIN, 0, 0, actor="operator:a"))
    # That record delivered again (a consumer replaying what the history folded, a
    # producer's duplicate) keeps its outcome: every service folds it the same way.
    assert fold2.decided(first) == pinned
    assert fold2.state.candidate is None
    retry = pb.RolloutDecision()
    retry.CopyFrom(first)
    retry.decided_at.FromSeconds(200)  # published again
    apply(fold2, retry)
    assert fold2.state.candidate == 2
    assert fold2.outcome("canary/2/start") == (True, None)
    assert fold2.outcome("never-seen") == (False, None)


def test_every_fold_of_the_same_events_agrees() -> None:
    """Two services fold the same topic, duplicates and refusals included, to one state."""
    events: list[pb.PolicyVersion | pb.RolloutDecision] = [
        version(0),
        version(1),
        decision(START, 1, 0, share=0.2),
        version(2),
        decision(PIN, 2, 0),  # refused: 1 is pending
        decision(ROLLBACK, 1, 0, decision_id="rb"),
        version(3, base=0),
        decision(ROLLBACK, 1, 0, decision_id="rb"),  # a copy
        decision(START, 3, 0, share=0.5),
    ]
    folds = [RolloutState(), RolloutState()]
    for fold in folds:
        for event in events:
            if isinstance(event, pb.PolicyVersion):
                fold.announced(event)
            else:
                fold.decided(event)
    assert folds[0].state == folds[1].state
    assert (folds[0].state.candidate, folds[0].state.rolled_back) == (3, {1})
    assert describe(folds[0].state) == {
        "stable": 0,
        "candidate": 3,
        "share": 0.5,
        "pinned": False,
        "newest": 3,
        "current": 3,
        "serving": [0, 3],
        "rolled_back": [1],
        "stables": [0],
    }


def test_assign_is_sticky_per_session_while_the_candidate_is_unchanged() -> None:
    fold = folded(0, 1, 2)
    apply(fold, decision(START, 1, 0, share=0.5))
    groups = [f"s.app.{n}" for n in range(200)]
    first = [fold.assign(g, lambda v: True) for g in groups]
    again = [fold.assign(g, lambda v: True) for g in groups]
    assert first == again
    assert {arm for arm, _ in filter(None, first)} == {"stable", "candidate"}
    assert set(first) == {("candidate", 1), ("stable", 0)}
    other = folded(0, 1, 2)  # another gateway replica, or this one after a restart
    apply(other, decision(START, 1, 0, share=0.5))
    assert [other.assign(g, lambda v: True) for g in groups] == first


@pytest.mark.parametrize("share", [0.05, 0.1, 0.5])
def test_assign_gives_the_candidate_its_share_of_sessions(share: float) -> None:
    fold = folded(0, 1)
    apply(fold, decision(START, 1, 0, share=share))
    n = 10_000
    hits = sum(
        1
        for k in range(n)
        if fold.assign(f"s.app.{uuid.UUID(int=k)}", lambda v: True) == ("candidate", 1)
    )
    sd = math.sqrt(n * share * (1 - share))
    assert abs(hits - n * share) < 5 * sd  # a 5-sigma binomial bound: fails by chance ~1e-6


def test_a_new_candidate_reshuffles_which_sessions_it_gets() -> None:
    """The hash includes the candidate, so the same users are not the canary every time."""
    fold = folded(0, 1, 2)
    apply(fold, decision(START, 1, 0, share=0.5))
    groups = [f"s.app.{n}" for n in range(400)]
    with_1 = {g for g in groups if fold.assign(g, lambda v: True) == ("candidate", 1)}
    apply(fold, decision(ROLLBACK, 1, 0))
    fold.announced(version(3, base=0))
    apply(fold, decision(START, 3, 0, share=0.5))
    with_3 = {g for g in groups if fold.assign(g, lambda v: True) == ("candidate", 3)}
    assert 60 < len(with_1 & with_3) < 140  # independent: about a quarter of 400


def test_the_candidate_is_not_assigned_while_no_engine_serves_it() -> None:
    fold = folded(0, 1)
    apply(fold, decision(START, 1, 0, share=0.9))
    groups = [f"s.app.{n}" for n in range(100)]
    assert {fold.assign(g, lambda v: v == 0) for g in groups} == {("stable", 0)}
    assert ("candidate", 1) in {fold.assign(g, lambda v: True) for g in groups}
    apply(fold, decision(ROLLBACK, 1, 0))
    assert {fold.assign(g, lambda v: True) for g in groups} == {("stable", 0)}


def test_session_failures_name_each_guard() -> None:
    ok = pb.SessionStats(calls=3, answered=True, latency_ms_max=100.0)
    assert session_failures(ok, slow_ms=1000.0) == {
        "error": False,
        "no_answer": False,
        "tool_parse": False,
        "slow": False,
    }
    bad = pb.SessionStats(calls=3, errors=1, tool_parse_failures=2, latency_ms_max=2000.0)
    assert session_failures(bad, slow_ms=1000.0) == {
        "error": True,
        "no_answer": True,
        "tool_parse": True,
        "slow": True,
    }


def test_the_canary_section_refuses_an_unknown_guard_by_name() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=r"guards\.latency: unknown guard"):
        CanarySection.model_validate({"guards": {"latency": {}}})
    rule = CanarySection(delta=0.1).rule(0.0, 1.0)
    assert (rule.delta, rule.low, rule.high) == (0.1, 0.0, 1.0)
    assert set(rule.guards) == {"error", "no_answer", "tool_parse", "slow"}


def test_a_snapshot_never_changes_as_the_fold_goes_on() -> None:
    fold = folded(0, 1, 2)
    apply(fold, decision(START, 2, 0, share=0.1))
    before = fold.state
    fold.announced(version(3))
    apply(fold, decision(ROLLBACK, 2, 0))
    fold.announced(version(4, base=0))
    assert (sorted(before.announced), dict(before.bases)) == ([0, 1, 2], {1: 0, 2: 1})
    assert 3 not in before.announced and before.bases.get(3) is None
    assert (before.candidate, before.current(), before.retired(2)) == (2, 2, False)
    after = fold.state
    assert (after.current(), after.retired(2), after.retired(3), after.retired(4)) == (
        4,
        True,
        True,
        False,
    )
    assert after.announced | {9} == {0, 1, 2, 3, 4, 9}  # a set like any other


def test_what_the_fold_keeps_matches_walking_the_lineage() -> None:
    """The fold keeps which versions are retired and the current one as it goes; a Rollout
    built by hand from the same fields computes them by walking `bases`: they agree."""
    import random

    rng = random.Random(7)
    with_rollbacks = 0
    for _ in range(50):
        fold = RolloutState()
        head = 0
        for number in range(40):
            if number and rng.random() < 0.3:
                fold.announced(version(number, base=rng.randrange(number)))
            else:
                fold.announced(version(number))
            state = fold.state
            if state.stable is None:
                continue
            if state.candidate is None and rng.random() < 0.4:
                target = state.current()
                if target is not None and target > state.stable:
                    fold.decided(decision(START, target, state.stable, share=0.5))
            elif state.candidate is not None and rng.random() < 0.5:
                action = ROLLBACK if rng.random() < 0.5 else PROMOTE
                fold.decided(decision(action, state.candidate, state.stable))
            elif rng.random() < 0.05:
                fold.decided(decision(ROLLBACK, state.stable, state.stable, actor="operator:a"))
            head = number
        state = fold.state
        by_hand = Rollout(
            stable=state.stable,
            announced=frozenset(state.announced),
            bases=dict(state.bases),
            rolled_back=state.rolled_back,
        )
        assert [state.retired(v) for v in range(head + 2)] == [
            by_hand.retired(v) for v in range(head + 2)
        ]
        assert state.current() == by_hand.current()
        with_rollbacks += len(state.rolled_back) > 1
    assert with_rollbacks > 10  # the histories do retire lines of versions


def test_the_canary_section_names_a_bad_signal_list_or_lag() -> None:
    from pydantic import ValidationError

    assert CanarySection().signals is None  # the session's reward
    assert CanarySection.model_validate({"signals": ["resolved"]}).signals == ["resolved"]
    with pytest.raises(ValidationError, match="signals"):
        CanarySection.model_validate({"signals": []})
    with pytest.raises(ValidationError, match="candidate_after_versions"):
        CanarySection.model_validate({"candidate_after_versions": 0})
