"""Held-out feedback signals (`train: false`): recorded and usable to judge a canary, never
part of the reward a policy is trained on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from harnessrl.production import FeedbackSection, SignalRule
from harnessrl.trust.feedback import Signal, session_reward

RULES = FeedbackSection(
    signals={
        "thumbs": SignalRule(min=-1, max=1),
        "resolved": SignalRule(min=0, max=1, train=False),
    }
)


def _signal(name: str, value: float, response_id: str = "", at: float = 1.0) -> Signal:
    return Signal(name, value, response_id, f"{name}/{response_id}/{at}", at)


def test_a_held_out_signal_is_recorded_but_never_in_the_trained_reward() -> None:
    worth = session_reward([_signal("thumbs", -1.0), _signal("resolved", 1.0)], RULES)
    assert worth.value == -1.0
    assert worth.components == {"resolved": 1.0, "thumbs": -1.0}


def test_a_session_with_only_held_out_signals_has_no_trained_reward() -> None:
    worth = session_reward([_signal("resolved", 1.0), _signal("resolved", 0.0, "resp_1")], RULES)
    assert worth.value is None
    assert worth.turns == {}


def test_names_choose_what_a_canary_is_judged_on() -> None:
    signals = [_signal("thumbs", -1.0), _signal("resolved", 0.0), _signal("resolved", 1.0, at=2)]
    assert session_reward(signals, RULES, names=["resolved"]).value == 1.0
    assert session_reward(signals, RULES, names=["thumbs", "resolved"]).value == 0.0
    assert session_reward([_signal("thumbs", 1.0)], RULES, names=["resolved"]).value is None


def test_a_configuration_where_nothing_trains_is_refused() -> None:
    with pytest.raises(ValidationError, match="signals: at least one signal must train"):
        FeedbackSection(signals={"resolved": SignalRule(train=False)})
