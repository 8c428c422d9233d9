"""`harnessrl sessions` on the real embedded broker: the events of a few production sessions
published on their topics as the gateway, the reward service, the sample builder and the
trainer publish them, then the command's table, filters and JSON."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message

from harnessrl.apps.cli import main as cli_main
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.production import session_group
from harnessrl.v1 import events_pb2 as pb

pytestmark = pytest.mark.integration

T0 = time.time() - 3600.0


def _at(stamp: Any, seconds: float) -> None:
    stamp.FromNanoseconds(round(seconds * 1e9))


def info(app: str, session: str, *, explored: bool = True, ended_by: str = "") -> pb.SessionInfo:
    return pb.SessionInfo(
        app=app, session_id=session, kind="chat", explored=explored, ended_by=ended_by
    )


def started(app: str, session: str, at: float, *, explored: bool = True) -> pb.EpisodeStarted:
    group = session_group(app, session)
    event = pb.EpisodeStarted(
        episode_id=group,
        attempt=1,
        group_id=group,
        group_size=1,
        runner="session",
        session=info(app, session, explored=explored),
    )
    _at(event.started_at, at)
    return event


def finished(app: str, session: str, at: float, *, explored: bool = True) -> pb.EpisodeFinished:
    group = session_group(app, session)
    event = pb.EpisodeFinished(
        episode_id=group,
        attempt=1,
        group_id=group,
        final=True,
        status=pb.EPISODE_STATUS_SUCCEEDED,
        session=info(app, session, explored=explored, ended_by="end"),
    )
    _at(event.finished_at, at)
    return event


def reward(
    app: str, session: str, signals_at: list[float], *, explored: bool = True
) -> pb.RewardAssigned:
    group = session_group(app, session)
    event = pb.RewardAssigned(
        episode_id=group,
        attempt=1,
        group_id=group,
        source="feedback",
        session=info(app, session, explored=explored, ended_by="end"),
    )
    if signals_at:
        event.value = 1.0
    else:
        event.missing = True
    for n, at in enumerate(signals_at):
        _at(event.signals.add(name="thumbs", value=1.0, idempotency_key=f"k{n}").received_at, at)
    _at(event.decided_at, max(signals_at, default=T0 + 1000))
    return event


def samples(app: str, session: str, captured: int, trained: int, **dropped: int) -> Message:
    group = session_group(app, session)
    event = pb.GroupSamples(group_id=group, task_id=group, estimator="session_baseline")
    event.samples.add(sample_id=f"{group}/1/0", episode_id=group, attempt=1)
    event.books.captured, event.books.trained = captured, trained
    event.books.dropped.update(dropped)
    return event


def session_events(app: str, session: str, start: float, end: float | None) -> list[Message]:
    out: list[Message] = [started(app, session, start)]
    if end is not None:
        out.append(finished(app, session, end))
    return out


def history() -> list[Message]:
    """Seven sessions, one in each state, and a controller's episode (not a session)."""
    deleted = pb.SessionDeleted(group_id="s.desk.f", session=info("desk", "f"))
    _at(deleted.requested_at, T0 + 500)
    return [
        *session_events("desk", "a", T0 + 60, None),  # open
        *session_events("desk", "b", T0 + 50, T0 + 51),  # awaiting_feedback
        *session_events("desk", "c", T0 + 40, T0 + 100),  # trained by v3 and v5
        reward("desk", "c", [T0 + 110, T0 + 170]),
        samples("desk", "c", 100, 90, retried=10),
        pb.PolicyVersion(version=3, step=3, session_groups=["s.desk.c"]),
        pb.PolicyVersion(version=5, step=5, session_groups=["s.desk.c"]),
        pb.PolicyVersion(version=5, step=5, session_groups=["s.desk.c"]),  # republished
        *session_events("ide", "d", T0 + 30, T0 + 100),  # dropped: no feedback
        reward("ide", "d", []),
        started("ide", "e", T0 + 20, explored=False),  # dropped: not explored
        finished("ide", "e", T0 + 100, explored=False),
        reward("ide", "e", [T0 + 105], explored=False),
        *session_events("desk", "f", T0 + 10, T0 + 100),  # deleted, the trainer answered
        reward("desk", "f", [T0 + 120]),
        deleted,
        pb.SessionDeletionApplied(group_id="s.desk.f", version=6),
        *session_events("desk", "g", T0, T0 + 100),  # built, not trained yet
        reward("desk", "g", [T0 + 130]),
        samples("desk", "g", 50, 20, too_long=25, retried=5),
        pb.EpisodeFinished(episode_id="g1-0", attempt=1, group_id="g1", final=True),
    ]


async def publish_all(broker: EmbeddedBroker, tmp_path: Path, items: list[Message]) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "spill"),
        name="test/sessions",
    )
    await producer.start()
    await asyncio.gather(*(producer.publish(item) for item in items))
    await producer.stop()


async def sessions(broker: EmbeddedBroker, capsys: Any, *argv: str) -> tuple[str, str]:
    code = await asyncio.to_thread(cli_main, ["sessions", "--bootstrap", broker.bootstrap, *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


async def test_the_sessions_command_joins_every_topic_per_session(
    broker: EmbeddedBroker, tmp_path: Path, capsys: Any
) -> None:
    await publish_all(broker, tmp_path, history())

    out, err = await sessions(broker, capsys, "--json")
    assert "read hrl.episodes" in err and "read hrl.policy" in err  # progress, not output
    shown = json.loads(out)
    states = {(s["app"], s["session"]): (s["state"], s["reason"]) for s in shown["sessions"]}
    assert states == {
        ("desk", "a"): ("open", ""),
        ("desk", "b"): ("awaiting_feedback", ""),
        ("desk", "c"): ("trained", "v3,v5"),
        ("ide", "d"): ("dropped", "reward_missing"),
        ("ide", "e"): ("dropped", "not_explored"),
        ("desk", "f"): ("deleted", "applied"),
        ("desk", "g"): ("built", ""),
    }
    assert [s["session"] for s in shown["sessions"]] == ["a", "b", "c", "d", "e", "f", "g"]
    c = next(s for s in shown["sessions"] if s["session"] == "c")
    assert (c["signals"], c["delay_s"], c["trained_versions"]) == (2, pytest.approx(10), [3, 5])
    assert c["tokens"] == {"captured": 100, "trained": 90, "dropped": {"retried": 10}}
    summary = shown["summary"]
    assert summary["sessions"] == 7 and summary["decided"] == 5
    assert summary["by_state"] == {
        "open": 1,
        "awaiting_feedback": 1,
        "built": 1,
        "trained": 1,
        "dropped": 2,
        "deleted": 1,
    }
    assert summary["feedback_coverage"] == pytest.approx(0.8)  # d got no signal
    # Delays after the end: e 5, c 10 and 70, f 20, g 30.
    assert summary["delay_p50_s"] == pytest.approx(20)
    assert summary["delay_p90_s"] == pytest.approx(54)
    assert summary["tokens"] == {
        "captured": 150,
        "trained": 110,
        "dropped": {"retried": 15, "too_long": 25},
    }

    table, _ = await sessions(broker, capsys)
    header, *rest = table.splitlines()
    assert header.split() == ["APP", "SESSION", "KIND", "EXPLORED", "STATE", "SIGNALS", "DELAY"]
    assert rest[2].split() == ["desk", "c", "chat", "yes", "trained", "(v3,v5)", "2", "10.0s"]
    assert rest[4].split() == ["ide", "e", "chat", "no", "dropped", "(not_explored)", "1", "5.0s"]
    assert "feedback coverage: 80% of 5 decided sessions got a signal" in table
    assert "feedback delay: p50 20.0s, p90 54.0s" in table
    assert "tokens: captured 150 = trained 110 + dropped 40 (retried 15, too_long 25)" in table
    assert "g1" not in table  # a controller's group is no session

    ide, _ = await sessions(broker, capsys, "--app", "ide", "--json")
    assert [s["session"] for s in json.loads(ide)["sessions"]] == ["d", "e"]
    assert json.loads(ide)["summary"]["tokens"]["captured"] == 0
    trained, _ = await sessions(broker, capsys, "--state", "trained", "--json")
    assert [s["session"] for s in json.loads(trained)["sessions"]] == ["c"]
    limited, _ = await sessions(broker, capsys, "--limit", "2", "--json")
    assert [s["session"] for s in json.loads(limited)["sessions"]] == ["a", "b"]
    assert json.loads(limited)["summary"]["sessions"] == 7  # the summary counts them all


def test_the_sessions_command_refuses_a_bad_limit(capsys: Any) -> None:
    assert cli_main(["sessions", "--limit", "0", "--bootstrap", "127.0.0.1:1"]) == 2
    assert "--limit: must be at least 1" in capsys.readouterr().err
