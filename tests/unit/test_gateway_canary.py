"""The gateway's side of a canary rollout: which versions each engine serves, a production
session's arm (sticky, in its share, only to a served candidate), where its calls go, and the
guard stats its replica counts (services/gateway/{versions,session_arms,tool_markup}.py and
production_sessions.py). The producer here only records what is published: these tests are
of the assignment logic, the broker is exercised by tests/integration/test_gateway_canary.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from harnessrl.production import AppSpec, ProductionSection, key_digest
from harnessrl.rollout import CanarySection, RolloutState
from harnessrl.services.gateway.engines import EnginePool
from harnessrl.services.gateway.errors import GatewayError
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.services.gateway.open_episodes import EpisodeBook, Restored
from harnessrl.services.gateway.production_sessions import ProductionSessions
from harnessrl.services.gateway.session_arms import SessionCalls, call_status, route
from harnessrl.services.gateway.tool_markup import Answer, ChatParts, chat_answer
from harnessrl.services.gateway.versions import EngineVersions
from harnessrl.v1 import events_pb2 as pb

APP = AppSpec(name="support", key_sha256=key_digest("k" * 32), exploration=0.0)
A, B = "http://a:8100", "http://b:8100"


def _loaded(engine: str, *served: tuple[int, str]) -> pb.PolicyLoaded:
    serving = [pb.ServedVersion(version=v, model=m) for v, m in served]
    return pb.PolicyLoaded(
        version=max(v for v, _ in served), engine=engine, ok=True, serving=serving
    )


def _rollout(share: float = 0.5, candidate: int | None = 2) -> RolloutState:
    """Stable 1, and `candidate` (2) started with `share`."""
    rollout = RolloutState()
    rollout.announced(pb.PolicyVersion(version=1))
    rollout.announced(pb.PolicyVersion(version=2, base=1))
    if candidate is not None:
        start = pb.RolloutDecision(
            decision_id="d-start",
            action=pb.ROLLOUT_ACTION_START,
            version=candidate,
            stable=1,
            share=share,
            actor="canary",
        )
        assert rollout.decided(start) is None
    return rollout


class _Recorder:
    """Records what is published, acknowledged at once."""

    def __init__(self) -> None:
        self.published: list[Any] = []

    def publish(self, event: Any) -> asyncio.Future[object]:
        self.published.append(event)
        done: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def _sessions(
    rollout: RolloutState, served: Any, *, enabled: bool = True
) -> tuple[ProductionSessions, _Recorder, GatewayMetrics]:
    producer = _Recorder()
    metrics = GatewayMetrics(CollectorRegistry())

    async def close(*_: Any) -> int:
        return 0

    production = ProductionSection(apps=[APP], canary=CanarySection(enabled=enabled))
    sessions = ProductionSessions(
        production,
        book=EpisodeBook(),
        producer=producer,  # type: ignore[arg-type]  # records, acknowledges at once
        close=close,
        metrics=metrics,
        rollout=rollout,
        served=served,
    )
    return sessions, producer, metrics


def test_an_engine_listing_versions_serves_exactly_its_latest_list() -> None:
    versions = EngineVersions()
    assert versions.loaded(_loaded(A, (1, "policy-v1"), (2, "policy-v2")))
    assert versions.serving() == {A: {1: "policy-v1", 2: "policy-v2"}}
    before = versions.serving()
    # A rolled-back version unloaded: the list shrinks, and the highest goes down with it.
    assert versions.loaded(_loaded(f"{A}/", (1, "policy-v1")))
    assert versions.serving() == {A: {1: "policy-v1"}}
    assert versions.snapshot() == {A: 1} and versions.models() == {A: "policy-v1"}
    assert before == {A: {1: "policy-v1", 2: "policy-v2"}}  # a snapshot never changes
    assert not versions.loaded(_loaded(A, (1, "policy-v1")))  # the same again
    failed = pb.PolicyLoaded(version=3, engine=A, ok=False, error="checksum")
    assert not versions.loaded(failed)
    assert versions.serves(1) and not versions.serves(2) and not versions.serves(3)


def test_an_engine_without_a_list_serves_its_highest_version_alone() -> None:
    versions = EngineVersions()
    assert versions.loaded(pb.PolicyLoaded(version=4, engine=B, ok=True, served_model="v4"))
    assert not versions.loaded(pb.PolicyLoaded(version=3, engine=B, ok=True))
    assert versions.serving() == {B: {4: "v4"}} and versions.snapshot() == {B: 4}


async def test_a_session_is_assigned_once_and_keeps_its_arm_and_version() -> None:
    rollout = _rollout()
    sessions, producer, metrics = _sessions(rollout, lambda v: True)
    groups = {}
    for n in range(40):
        claims = sessions.claims(APP, f"chat-{n}", "")
        calls = sessions.calls(claims)
        assert calls is not None and calls.version in (1, 2)
        groups[claims.group_id] = (calls.arm, calls.version)
    # The candidate is promoted: open sessions keep what they were assigned.
    promote = pb.RolloutDecision(
        decision_id="d-promote", action=pb.ROLLOUT_ACTION_PROMOTE, version=2, stable=1
    )
    assert rollout.decided(promote) is None
    for n in range(40):
        claims = sessions.claims(APP, f"chat-{n}", "")
        calls = sessions.calls(claims)
        assert calls is not None
        assert (calls.arm, calls.version) == groups[claims.group_id]
    started = [e for e in producer.published if isinstance(e, pb.EpisodeStarted)]
    assert len(started) == 40  # one EpisodeStarted per session, at its first call
    for event in started:
        info = event.session
        assert (info.arm, info.policy_version) == groups[event.group_id]
        assert info.canary == 2
        assert info.policy_version == (2 if info.arm == "candidate" else 1)
    arms = [a for a, _ in groups.values()]
    assert 0 < arms.count("candidate") < 40
    assert metrics.sessions_assigned("candidate")._value.get() == arms.count("candidate")  # type: ignore[attr-defined]
    # A new session after the promotion: version 2 is stable, no candidate pending.
    calls = sessions.calls(sessions.claims(APP, "after", ""))
    assert calls is not None and (calls.arm, calls.version) == ("stable", 2)


async def test_the_candidate_gets_its_share_of_sessions() -> None:
    sessions, _, _ = _sessions(_rollout(share=0.2), lambda v: True)
    n = 3000
    arms = []
    for i in range(n):
        calls = sessions.calls(sessions.claims(APP, f"s-{i}", ""))
        assert calls is not None
        arms.append(calls.arm)
    share = arms.count("candidate") / n
    # Binomial(3000, 0.2): sd 0.0073; five of them either side.
    assert abs(share - 0.2) < 0.037


async def test_no_session_goes_to_a_candidate_no_engine_serves() -> None:
    sessions, _, _ = _sessions(_rollout(share=0.9), lambda v: v == 1)
    for i in range(50):
        calls = sessions.calls(sessions.claims(APP, f"s-{i}", ""))
        assert calls is not None and (calls.arm, calls.version) == ("stable", 1)


async def test_without_a_rollout_sessions_have_no_arm() -> None:
    sessions, producer, _ = _sessions(_rollout(), lambda v: True, enabled=False)
    calls = sessions.calls(sessions.claims(APP, "plain", ""))
    assert calls is not None and calls.version is None and calls.arm == ""
    assert producer.published[0].session == pb.SessionInfo(app="support", session_id="plain")


async def test_a_restored_session_keeps_its_assignment_and_captured_counts() -> None:
    rollout = _rollout(share=0.5)
    sessions, _, _ = _sessions(rollout, lambda v: True)
    info = pb.SessionInfo(
        app="support", session_id="x", kind="refund", arm="candidate", policy_version=2, canary=2
    )
    state = {
        ("s.support.x", 1): Restored(2, None, version=2, latencies_ms=(10.0, 30.0), session=info),
        # No EpisodeStarted read back: the first captured call's version holds.
        ("s.support.y", 1): Restored(1, None, version=1, latencies_ms=(5.0,)),
    }
    assert sessions.restore(state) == 2
    x = sessions.calls(sessions.claims(APP, "x", ""))
    y = sessions.calls(sessions.claims(APP, "y", ""))
    assert x is not None and (x.arm, x.version) == ("candidate", 2)
    assert x.stats == pb.SessionStats(
        calls=2, answered=True, latency_ms_sum=40.0, latency_ms_max=30.0
    )
    assert y is not None and y.version == 1


async def test_a_finished_session_publishes_its_guard_stats() -> None:
    sessions, producer, _ = _sessions(_rollout(), lambda v: True)
    claims = sessions.claims(APP, "done", "")
    calls = sessions.calls(claims)
    assert calls is not None
    calls.record(200, 12.0, Answer(content=True))
    calls.record(502, 40.0, None)
    await sessions.end(APP, "done")
    finished = [e for e in producer.published if isinstance(e, pb.EpisodeFinished)]
    assert finished[0].session.stats == pb.SessionStats(
        calls=2, errors=1, answered=False, latency_ms_sum=52.0, latency_ms_max=40.0
    )
    assert finished[0].session.arm in ("stable", "candidate")


def test_a_call_goes_only_to_engines_serving_its_version_under_their_name() -> None:
    serving = {A: {1: "policy-v1", 2: "policy-v2"}, B: {1: ""}}
    state = _rollout().state
    assert route(2, serving, state, retry_after_s=1).engines == {A: "policy-v2"}
    assert route(1, serving, state, retry_after_s=1).engines == {A: "policy-v1", B: ""}
    pool = EnginePool([A, f"{B}/", "http://c:8100"], timeout_s=1, attempts=1)
    for episode in ("e1", "e2", "e3", "e4"):
        full = pool.ranking(episode)
        among = pool.ranking(episode, {A, B})
        assert among == [i for i in full if i != 2]  # the same order, others left out


def test_a_version_served_nowhere_for_now_is_a_503_to_retry() -> None:
    state = _rollout().state
    with pytest.raises(GatewayError) as refused:
        route(2, {A: {1: "policy-v1"}}, state, retry_after_s=2)
    assert refused.value.status == 503
    assert ("retry-after", "2") in (refused.value.headers or [])


def test_a_retired_version_served_nowhere_is_served_from_stable() -> None:
    rollout = _rollout()
    rollback = pb.RolloutDecision(
        decision_id="d-rb", action=pb.ROLLOUT_ACTION_ROLLBACK, version=2, stable=1
    )
    assert rollout.decided(rollback) is None
    still = route(2, {A: {1: "v1", 2: "v2"}}, rollout.state, retry_after_s=1)
    assert still.version == 2 and still.switched_from is None  # served: kept
    switched = route(2, {A: {1: "v1"}}, rollout.state, retry_after_s=1)
    assert (switched.version, switched.switched_from, switched.engines) == (1, 2, {A: "v1"})
    with pytest.raises(GatewayError):
        route(2, {A: {3: "v3"}}, rollout.state, retry_after_s=1)  # nor stable: retry
    # The session gives its version up once, and stays on stable even if 2 came back.
    calls = SessionCalls(version=2, arm="candidate")
    assert calls.route_call({A: {1: "v1"}}, rollout.state, retry_after_s=1).switched_from == 2
    again = calls.route_call({A: {1: "v1", 2: "v2"}}, rollout.state, retry_after_s=1)
    assert (calls.version, again.version, again.switched_from) == (1, 1, None)


def test_a_replaced_stable_no_engine_keeps_any_longer_moves_its_sessions_to_stable() -> None:
    rollout = _rollout()
    promote = pb.RolloutDecision(
        decision_id="d-pr", action=pb.ROLLOUT_ACTION_PROMOTE, version=2, stable=1
    )
    assert rollout.decided(promote) is None
    kept = route(1, {A: {1: "v1", 2: "v2"}}, rollout.state, retry_after_s=1)
    assert (kept.version, kept.switched_from) == (1, None)  # engines still keep it
    moved = route(1, {A: {2: "v2"}}, rollout.state, retry_after_s=1)
    assert (moved.version, moved.switched_from) == (2, 1)


def test_guard_stats_count_errors_unparsed_tool_calls_and_the_last_answer() -> None:
    calls = SessionCalls(version=1, arm="stable")
    markup = {"choices": [{"index": 0, "message": {"content": '<tool_call>{"name": "x"'}}]}
    parsed = {
        "choices": [
            {"index": 0, "message": {"content": None, "tool_calls": [{"id": "c"}]}},
        ]
    }
    assert chat_answer(markup) == Answer(content=True, unparsed=True)
    assert chat_answer(parsed) == Answer(tool_calls=True)
    assert chat_answer({"choices": [{"index": 0, "text": "<tool_call>"}]}) == Answer(content=True)
    calls.record(200, 5.0, chat_answer(markup))
    calls.record(503, 1.0, None)
    calls.record(200, 7.0, chat_answer(parsed))
    assert calls.stats == pb.SessionStats(
        calls=3,
        errors=1,
        tool_parse_failures=1,
        answered=True,
        latency_ms_sum=13.0,
        latency_ms_max=7.0,
    )
    calls.record(200, 1.0, Answer())  # 200 with neither content nor a tool call
    assert not calls.stats.answered


def test_a_streamed_answer_is_read_from_its_deltas() -> None:
    parts = ChatParts()
    for piece in ("<tool", "_call>{", '"name": "x"}'):
        parts.add_body({"choices": [{"index": 0, "delta": {"content": piece}}]})
    parts.add_body({"choices": [{"index": 1, "delta": {"tool_calls": [{"index": 0}]}}]})
    assert parts.answer() == Answer(content=True, tool_calls=True, unparsed=True)


def test_a_calls_status_for_the_guards() -> None:
    assert call_status("ok", None) == 200
    assert call_status("engine_500", None) == 500
    assert call_status("engine_error", None) == 502
    assert call_status("aborted", None) == 499
    assert call_status("error", GatewayError(503, "x")) == 503
    assert call_status("error", asyncio.CancelledError()) == 499
    assert call_status("error", RuntimeError("x")) == 500
