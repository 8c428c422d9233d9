"""The controller's pure decisions: transitions, verdicts, the ledger, admission, status."""

from __future__ import annotations

import asyncio

import pytest

from harnessrl.services.controller.admission import EpisodeAdmission
from harnessrl.services.controller.phases import (
    AttemptState,
    EpisodeLedger,
    IllegalTransition,
    Phase,
    judge,
)
from harnessrl.services.controller.runner import RunResult, parse_result
from harnessrl.services.controller.status import summarise
from harnessrl.v1 import events_pb2 as pb


def _result(outcome: str = "exited", code: int | None = 0, error: str | None = None) -> RunResult:
    return RunResult(outcome, code, None, error, "msg", "", 0.0, 1.0)  # type: ignore[arg-type]


def test_an_attempt_moves_only_along_the_lifecycle() -> None:
    attempt = AttemptState("ep", 1)
    for phase in (Phase.RUNNING, Phase.CLOSING, Phase.FINISHED):
        attempt.advance(phase)
    with pytest.raises(IllegalTransition, match="finished -> running is not allowed"):
        attempt.advance(Phase.RUNNING)
    with pytest.raises(IllegalTransition):
        AttemptState("ep", 1).advance(Phase.CLOSING)


@pytest.mark.parametrize(
    ("result", "attempt", "status", "retry"),
    [
        (_result(), 1, pb.EPISODE_STATUS_SUCCEEDED, False),
        (_result("timeout", None), 1, pb.EPISODE_STATUS_TIMEOUT, False),
        (_result("infra_error", None), 1, pb.EPISODE_STATUS_FAILED, True),
        (_result("infra_error", None), 3, pb.EPISODE_STATUS_FAILED, False),
        (_result("abandoned", None), 2, pb.EPISODE_STATUS_FAILED, True),
        (_result(code=-11), 1, pb.EPISODE_STATUS_FAILED, True),
        (_result(code=75), 1, pb.EPISODE_STATUS_FAILED, True),
        (_result(code=1), 1, pb.EPISODE_STATUS_FAILED, False),
        (
            _result(error="malformed result in HARNESSRL_OUTPUT: x"),
            1,
            pb.EPISODE_STATUS_FAILED,
            False,
        ),
    ],
)
def test_verdicts(result: RunResult, attempt: int, status: int, retry: bool) -> None:
    verdict = judge(result, attempt=attempt, max_attempts=3, retryable_exit_codes=frozenset({75}))
    assert (verdict.status, verdict.retry) == (status, retry)


def test_the_ledger_knows_what_was_started_and_finished() -> None:
    ledger = EpisodeLedger()
    ledger.add("episode_started", pb.EpisodeStarted(episode_id="g-0", attempt=1, group_id="g"))
    ledger.add(
        "episode_finished",
        pb.EpisodeFinished(episode_id="g-0", attempt=1, group_id="g", final=False),
    )
    ledger.add("episode_started", pb.EpisodeStarted(episode_id="g-0", attempt=2, group_id="g"))
    ledger.add("episode_started", pb.EpisodeStarted(episode_id="g-1", attempt=1, group_id="g"))
    ledger.add(
        "episode_finished",
        pb.EpisodeFinished(episode_id="g-1", attempt=1, group_id="g", final=True),
    )
    assert ledger.episode("g", "g-0").open_attempt == 2 and not ledger.episode("g", "g-0").done
    assert ledger.episode("g", "g-1").done
    assert ledger.episode("g", "g-9").started == 0


def test_results_come_from_the_file_or_the_last_line() -> None:
    assert parse_result(b'{"a": 1}', 'HARNESSRL_RESULT {"b": 2}', 100) == ('{"a": 1}', None, False)
    assert parse_result(None, 'x\nHARNESSRL_RESULT {"b": 2}\n', 100)[0] == '{"b": 2}'
    assert parse_result(None, 'HARNESSRL_RESULT {"b": 2}\nlater output', 100) == (None, None, False)
    text, error, truncated = parse_result(b'{"long": "' + b"x" * 100 + b'"}', "", 20)
    assert truncated and error is None and len(text or "") == 20


async def test_admission_caps_episodes_in_flight() -> None:
    admission = EpisodeAdmission(max_in_flight=2, sync=False, max_staleness=1, engines=1)
    await admission.acquire("a")
    await admission.acquire("b")
    third = asyncio.create_task(admission.acquire("c"))
    await asyncio.sleep(0.01)
    assert not third.done()
    await admission.release("a")
    assert await third == 0


async def test_sync_admission_waits_for_every_engine_to_load_the_announced_version() -> None:
    admission = EpisodeAdmission(max_in_flight=8, sync=True, max_staleness=0, engines=2)
    await admission.announced_version(1)
    waiting = asyncio.create_task(admission.acquire("a"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert not await admission.loaded(1, "engine-a")
    await asyncio.sleep(0.01)
    assert not waiting.done()  # one of two engines
    assert await admission.loaded(1, "engine-b")
    assert await waiting == 1


async def test_async_admission_reports_episodes_that_fell_too_far_behind() -> None:
    admission = EpisodeAdmission(max_in_flight=8, sync=False, max_staleness=1, engines=1)
    await admission.acquire("old")
    await admission.loaded(1, "e")
    await admission.acquire("new")
    assert admission.stale() == []
    await admission.loaded(2, "e")
    assert admission.stale() == ["old"]


def test_status_summarises_groups_episodes_and_versions() -> None:
    tasks = [
        pb.TaskSubmitted(group_id="g1", group_size=2),
        pb.TaskSubmitted(group_id="g2", group_size=1),
    ]
    episodes = [
        ("episode_started", pb.EpisodeStarted(episode_id="g1-0", attempt=1, group_id="g1")),
        (
            "episode_finished",
            pb.EpisodeFinished(
                episode_id="g1-0",
                attempt=1,
                group_id="g1",
                final=True,
                status=pb.EPISODE_STATUS_SUCCEEDED,
                policy_version=3,
            ),
        ),
        ("episode_started", pb.EpisodeStarted(episode_id="g1-1", attempt=1, group_id="g1")),
        (
            "episode_finished",
            pb.EpisodeFinished(
                episode_id="g1-1",
                attempt=1,
                group_id="g1",
                final=False,
                status=pb.EPISODE_STATUS_FAILED,
            ),
        ),
        ("episode_started", pb.EpisodeStarted(episode_id="g1-1", attempt=2, group_id="g1")),
        (
            "episode_finished",
            pb.EpisodeFinished(
                episode_id="g1-1",
                attempt=2,
                group_id="g1",
                final=True,
                status=pb.EPISODE_STATUS_TIMEOUT,
                policy_version=3,
            ),
        ),
        ("episode_started", pb.EpisodeStarted(episode_id="g2-0", attempt=1, group_id="g2")),
    ]
    policy = [
        ("policy_version", pb.PolicyVersion(version=3)),
        ("policy_loaded", pb.PolicyLoaded(version=3, engine="e", ok=True)),
    ]
    data = summarise(tasks, episodes, policy).as_dict()
    assert data["groups"] == {"submitted": 2, "complete": 1, "in_progress": 1}
    assert data["episodes"] == {
        "running": 1,
        "final": {"succeeded": 1, "timeout": 1},
        "retried_attempts": 1,
    }
    assert data["by_policy_version"] == {"3": {"succeeded": 1, "timeout": 1}}
    assert data["policy"] == {"latest_announced": 3, "engines_loaded": {"3": 1}}
