"""Production feedback end to end: the real reward service on the embedded broker, session
events published on hrl.episodes as the gateway publishes them, real HTTP to its feedback
API with httpx, and the `harnessrl feedback` command. Deletions are answered by a trainer
played by the test (it publishes SessionDeletionApplied on hrl.policy, as the trainer does):
a real trainer needs a GPU and a model."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.apps.cli import main as cli_main
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.production import (
    AppSpec,
    FeedbackSection,
    ProductionSection,
    SignalRule,
    key_digest,
    session_group,
    session_traceparent,
)
from harnessrl.runtime import Runtime
from harnessrl.services.reward.config import RewardConfig, RewardSection
from harnessrl.services.reward.feedback_join import reward_of
from harnessrl.services.reward.feedback_store import FeedbackStore, SessionRecord, StoredSignal
from harnessrl.services.reward.service import RewardService
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, events_on, eventually, read_topic, topic_size

pytestmark = pytest.mark.integration

DESK_KEY, IDE_KEY = "desk-key-0123456789abcdef", "ide-key-0123456789abcdef"
SIGNALS = {
    "thumbs": SignalRule(min=-1.0, max=1.0, required=True),
    "resolved": SignalRule(min=0.0, max=1.0, weight=3.0),
}


def production(tmp_path: Path, window_s: float = 600.0) -> ProductionSection:
    return ProductionSection(
        apps=[
            AppSpec(name="desk", key_sha256=key_digest(DESK_KEY)),
            AppSpec(name="ide", key_sha256=key_digest(IDE_KEY)),
        ],
        feedback=FeedbackSection(signals=SIGNALS, window_s=window_s, max_body_bytes=1024),
        store=tmp_path / "sessions",
    )


@asynccontextmanager
async def reward_service(
    broker: EmbeddedBroker,
    tmp_path: Path,
    *,
    window_s: float = 600.0,
    delete_wait_s: float = 30.0,
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
) -> AsyncIterator[tuple[RewardService, httpx.AsyncClient]]:
    config = RewardConfig(
        instance="rw-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "rw-spill"),
        reward=RewardSection(
            port=0, feedback_port=0, feedback_sweep_s=0.2, delete_wait_s=delete_wait_s
        ),
        production=production(tmp_path, window_s),
    )
    runtime = Runtime(
        "reward", "rw-0", registry or CollectorRegistry(), tracer_provider or TracerProvider()
    )
    service = RewardService(config, runtime)
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 30)
    url = f"http://127.0.0.1:{service.feedback_port}"
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            yield service, client
    finally:
        await service.stop()
        await task


def started(app: str, session: str) -> pb.EpisodeStarted:
    group = session_group(app, session)
    event = pb.EpisodeStarted(
        episode_id=group,
        attempt=1,
        group_id=group,
        group_size=1,
        mode=pb.MODE_TRAIN,
        runner="session",
        trace_id=session_traceparent(app, session).split("-")[1],
        session=pb.SessionInfo(app=app, session_id=session, kind="chat", explored=True),
    )
    event.started_at.FromNanoseconds(time.time_ns())
    return event


def finished(app: str, session: str, ago_s: float = 0.0) -> pb.EpisodeFinished:
    group = session_group(app, session)
    event = pb.EpisodeFinished(
        episode_id=group,
        attempt=1,
        group_id=group,
        mode=pb.MODE_TRAIN,
        status=pb.EPISODE_STATUS_SUCCEEDED,
        final=True,
        session=pb.SessionInfo(
            app=app, session_id=session, kind="chat", explored=True, ended_by="end"
        ),
    )
    event.finished_at.FromNanoseconds(time.time_ns() - int(ago_s * 1e9))
    return event


def controller_episode(episode_id: str) -> pb.EpisodeFinished:
    """A controller's episode, scored by the configured reward (builtin:answer) as before."""
    return pb.EpisodeFinished(
        episode_id=episode_id,
        attempt=1,
        group_id=episode_id.rsplit("-", 1)[0],
        task_id="t",
        mode=pb.MODE_TRAIN,
        status=pb.EPISODE_STATUS_SUCCEEDED,
        result_json='{"answer": "42"}',
        final=True,
        task_metadata_json='{"answer": "42"}',
    )


async def publish(broker: EmbeddedBroker, tmp_path: Path, *items: Any) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "gateway-spill"),
        name="gateway/test",
    )
    await producer.start()
    for item in items:
        await producer.publish(item)
    await producer.stop()


async def rewards(broker: EmbeddedBroker, count: int) -> dict[str, pb.RewardAssigned]:
    """Wait for `count` RewardAssigned, then (a moment later) check there are no more."""

    async def arrived() -> bool:
        return await topic_size(broker.bootstrap, events.REWARDS) >= count

    await eventually(arrived, timeout=30, interval=0.1)
    await asyncio.sleep(1.0)
    assert await topic_size(broker.bootstrap, events.REWARDS) == count, "a reward twice"
    out = {}
    for record in await read_topic(broker.bootstrap, events.REWARDS, count):
        reward = events.decode(events.REWARDS, record.value).reward_assigned
        assert reward.episode_id not in out
        out[reward.episode_id] = reward
    return out


def signal(**changes: Any) -> bytes:
    """A feedback body for session open-1 with `changes` (None leaves a field out)."""
    body = {"session": "open-1", "name": "thumbs", "value": 1} | changes
    return orjson.dumps({k: v for k, v in body.items() if v is not None})


def desk(**headers: str) -> dict[str, str]:
    return {"authorization": f"Bearer {DESK_KEY}", **headers}


async def known(client: httpx.AsyncClient, session: str, state: str, key: str = DESK_KEY) -> None:
    """Wait until the service holds `session` in `state` (it consumes the events)."""

    async def reached() -> bool:
        answer = await client.get(f"/v1/sessions/{session}", headers={"x-api-key": key})
        return answer.status_code == 200 and answer.json()["state"] == state

    await eventually(reached, timeout=30, interval=0.1)


async def test_every_refused_request_says_why_and_stores_nothing(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    async with reward_service(broker, tmp_path, registry=registry) as (_, client):
        await publish(broker, tmp_path, started("desk", "open-1"), started("desk", "done-1"))
        await publish(broker, tmp_path, finished("desk", "done-1"))
        await known(client, "open-1", "open")
        await known(client, "done-1", "awaiting_feedback")
        ok = {"session": "open-1", "name": "resolved", "value": 1}
        assert (await client.post("/v1/feedback", json=ok, headers=desk())).status_code == 202
        done = {"session": "done-1", "name": "thumbs", "value": 1}
        assert (await client.post("/v1/feedback", json=done, headers=desk())).status_code == 202

        ide = {"x-api-key": IDE_KEY}
        cases: list[tuple[int, str, dict[str, str], bytes]] = [
            (401, "", {}, signal()),
            (401, "authorization", {"x-api-key": "nope"}, signal()),
            (400, "body", desk(), b'{"session": '),
            (400, "body", desk(), b"[1, 2]"),
            (400, "body", desk(), signal().replace(b'"value":1', b'"value":1e999')),
            (400, "extra", desk(), signal(extra=1)),
            (400, "session", desk(), signal(session="a/b")),
            (400, "session", desk(), signal(session=7)),
            (400, "name", desk(), signal(name="stars")),
            (400, "value", desk(), signal(value="1")),
            (400, "value", desk(), signal(value=True)),
            (400, "value", desk(), signal(value=2)),
            (400, "value", desk(), signal(value=None)),
            (400, "response_id", desk(), signal(response_id="id-1")),
            (400, "response_id", desk(), signal(response_id=5)),
            (400, "response_id", desk(), signal(response_id="resp_" + "x" * 200)),
            (400, "idempotency_key", desk(), signal(idempotency_key="")),
            (400, "idempotency_key", desk(), signal(idempotency_key="a\nb")),
            (404, "session", desk(), signal(session="never")),
            (404, "session", ide, signal()),
            (409, "session", desk(), signal(session="done-1", value=-1)),
            (413, "body", desk(), signal(pad="x" * 2000)),
        ]
        for status, field, headers, body in cases:
            answer = await client.post("/v1/feedback", content=body, headers=headers)
            assert answer.status_code == status, (body[:80], answer.text)
            error = answer.json()["error"]
            assert error["field"] == field and error["message"], (body[:80], error)
        assert (await client.get("/v1/feedback", headers=desk())).status_code == 405
        assert (await client.post("/v1/sessions/open-1", headers=desk())).status_code == 405
        assert (await client.get("/v1/sessions/open-1")).status_code == 401
        assert (await client.get("/v1/sessions/open-1", headers=desk())).status_code == 200
        assert (await client.get("/v1/sessions/bad%2Fid", headers=desk())).status_code == 400
        other = await client.get("/v1/sessions/open-1", headers={"x-api-key": IDE_KEY})
        assert other.status_code == 404
        assert (await client.get("/healthz")).json()["status"] == "ok"

        shown = (await client.get("/v1/sessions/open-1", headers=desk())).json()
        assert [(s["name"], s["value"]) for s in shown["signals"]] == [("resolved", 1.0)]
        assert shown["state"] == "open" and shown["value"] is None
        decided = (await client.get("/v1/sessions/done-1", headers=desk())).json()
        assert [(s["name"], s["value"]) for s in decided["signals"]] == [("thumbs", 1.0)]
        assert decided["value"] == 1.0
    got = await rewards(broker, 1)
    assert list(got) == ["s.desk.done-1"]

    def count(outcome: str) -> float | None:
        return registry.get_sample_value("harnessrl_feedback_signals_total", {"outcome": outcome})

    assert count("accepted") == 2
    assert count("refused_unauthorized") == 2 and count("refused_too_large") == 1
    assert count("refused_unknown_session") == 2 and count("refused_decided") == 1
    assert count("refused_malformed") == 3 and count("refused_invalid") == 13


async def test_a_signal_after_the_end_decides_the_session_and_publishes_one_reward(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    registry = CollectorRegistry()
    async with reward_service(broker, tmp_path, registry=registry, tracer_provider=provider) as (
        _,
        client,
    ):
        await publish(broker, tmp_path, started("desk", "chat-7"))
        await known(client, "chat-7", "open")
        early = {"session": "chat-7", "name": "resolved", "value": 0, "idempotency_key": "r-1"}
        assert (await client.post("/v1/feedback", json=early, headers=desk())).json() == {
            "session": "chat-7",
            "accepted": True,
            "duplicate": False,
        }
        await publish(broker, tmp_path, finished("desk", "chat-7"))
        await known(client, "chat-7", "awaiting_feedback")
        thumbs = {"session": "chat-7", "name": "thumbs", "value": 1, "response_id": "resp_a1"}
        first = await client.post("/v1/feedback", json=thumbs, headers=desk())
        assert first.status_code == 202 and first.json()["duplicate"] is False
        retry = await client.post("/v1/feedback", json=thumbs, headers=desk())
        assert retry.status_code == 202 and retry.json()["duplicate"] is True
        changed = {**early, "value": 1}
        reused = (await client.post("/v1/feedback", json=changed, headers=desk())).json()
        assert reused["duplicate"] is True and "other content" in reused["message"]
        await known(client, "chat-7", "published")
        shown = (await client.get("/v1/sessions/chat-7", headers=desk())).json()
        await publish(broker, tmp_path, controller_episode("g1-0"))
        sessions = registry.get_sample_value("harnessrl_feedback_sessions", {"state": "published"})
        # Read while the service still runs: leaving the block stops it, and on a busy
        # machine it could stop before it had scored the controller's episode.
        got = await rewards(broker, 2)
    assert (got["g1-0"].source, got["g1-0"].value) == ("builtin:answer", 1.0)  # as ever
    reward = got["s.desk.chat-7"]
    trace_id = session_traceparent("desk", "chat-7").split("-")[1]
    # resolved 0 (weight 3) is session-wide; thumbs names a response: R is resolved's value.
    assert (reward.value, reward.missing, reward.source) == (0.0, False, "feedback")
    assert (reward.attempt, reward.group_id) == (1, "s.desk.chat-7")
    assert dict(reward.components) == {"resolved": 0.0}
    assert [(s.name, s.value, s.response_id) for s in reward.signals] == [
        ("resolved", 0.0, ""),
        ("thumbs", 1.0, "resp_a1"),
    ]
    assert reward.signals[1].idempotency_key.startswith("digest:")
    assert all(s.trace_id == trace_id and len(s.span_id) == 16 for s in reward.signals)
    assert reward.signals[0].received_at.ToNanoseconds() < reward.decided_at.ToNanoseconds()
    assert (reward.session.app, reward.session.session_id, reward.session.ended_by) == (
        "desk",
        "chat-7",
        "end",
    )
    assert shown["state"] == "published" and shown["value"] == 0.0
    spans = [s for s in exporter.get_finished_spans() if s.name == "feedback.signal"]
    assert len(spans) == 4 and {format(s.context.trace_id, "032x") for s in spans} == {trace_id}
    assert {format(s.context.span_id, "016x") for s in spans} >= {s.span_id for s in reward.signals}
    assert registry.get_sample_value("harnessrl_feedback_decided_total", {"outcome": "decided"})
    assert registry.get_sample_value("harnessrl_feedback_delay_seconds_count") == 1
    assert sessions == 1


async def test_a_window_that_ends_without_feedback_gives_a_missing_reward(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with reward_service(broker, tmp_path, window_s=1.0) as (_, client):
        await publish(broker, tmp_path, started("ide", "s1"), finished("ide", "s1"))
        await known(client, "s1", "published", key=IDE_KEY)
        late = {"session": "s1", "name": "thumbs", "value": 1}
        refused = await client.post("/v1/feedback", json=late, headers={"x-api-key": IDE_KEY})
        assert refused.status_code == 409 and "not counted" in refused.json()["error"]["message"]
    reward = (await rewards(broker, 1))["s.ide.s1"]
    assert reward.missing and "no feedback within the window" in reward.message
    assert list(reward.signals) == []


async def test_a_restart_while_sessions_wait_loses_and_doubles_nothing(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with reward_service(broker, tmp_path) as (_, client):
        await publish(broker, tmp_path, started("desk", "a"), started("desk", "b"))
        await publish(broker, tmp_path, started("desk", "c"), finished("desk", "a"))
        await known(client, "a", "awaiting_feedback")
        await known(client, "c", "open")
        signal = {"session": "b", "name": "thumbs", "value": -1}
        assert (await client.post("/v1/feedback", json=signal, headers=desk())).status_code == 202
    # A reward decided but not acknowledged before a crash, as the store holds it then.
    store = FeedbackStore.open(tmp_path / "sessions", window_s=600.0)
    now = time.time()
    record = SessionRecord("s.desk.d", "desk", "d", "chat", True, "ab" * 16, now, now, "end")
    store.register([record])
    store.add_signal("s.desk.d", StoredSignal("thumbs", 0.5, "", "k", now, "cd" * 8, "ab" * 16))
    rules = production(tmp_path).feedback

    def judge(session: SessionRecord, signals: list[StoredSignal], at: float) -> bytes | None:
        reward = reward_of(session, signals, rules, at)
        return None if reward is None else reward.SerializeToString(deterministic=True)

    [(_, stored)] = store.decide(["s.desk.d"], now, judge)
    store.close()

    async with reward_service(broker, tmp_path) as (_, client):
        await known(client, "d", "published")
        await publish(broker, tmp_path, finished("desk", "b"), finished("desk", "a"))
        await known(client, "b", "published")
        thumbs = {"session": "a", "name": "thumbs", "value": 1}
        assert (await client.post("/v1/feedback", json=thumbs, headers=desk())).status_code == 202
        await known(client, "a", "published")
        await known(client, "c", "open")
    got = await rewards(broker, 3)
    assert {g: r.value for g, r in got.items()} == {
        "s.desk.a": 1.0,
        "s.desk.b": -1.0,
        "s.desk.d": 0.5,
    }
    assert got["s.desk.d"].SerializeToString(deterministic=True) == stored


async def test_the_feedback_command_sends_and_shows(
    broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    async with reward_service(broker, tmp_path, delete_wait_s=0.2) as (service, client):
        await publish(broker, tmp_path, started("desk", "cli-1"))
        await known(client, "cli-1", "open")
        url = f"http://127.0.0.1:{service.feedback_port}"
        monkeypatch.delenv("HARNESSRL_APP_KEY", raising=False)

        def run(*argv: str) -> int:
            return cli_main(["feedback", *argv, "--url", url])

        assert await asyncio.to_thread(run, "send", "cli-1", "thumbs", "1") == 2
        assert "HARNESSRL_APP_KEY: not set" in capsys.readouterr().err
        monkeypatch.setenv("DESK_KEY", DESK_KEY)
        keyed = ("--app-key-env", "DESK_KEY")
        assert await asyncio.to_thread(run, "send", "cli-1", "thumbs", "1", *keyed) == 0
        assert '"duplicate": false' in capsys.readouterr().out
        assert await asyncio.to_thread(run, "send", "cli-1", "thumbs", "1", *keyed) == 0
        assert '"duplicate": true' in capsys.readouterr().out
        assert await asyncio.to_thread(run, "send", "cli-1", "thumbs", "5", *keyed) == 2
        assert "HTTP 400: value: 5 is outside [-1, 1]" in capsys.readouterr().err
        assert await asyncio.to_thread(run, "send", "cli-1", "thumbs", "nan", *keyed) == 2
        assert "not a finite number" in capsys.readouterr().err
        assert await asyncio.to_thread(run, "show", "nobody", *keyed) == 2
        assert "HTTP 404" in capsys.readouterr().err
        assert await asyncio.to_thread(run, "show", "cli-1", *keyed) == 0
        shown = capsys.readouterr().out
        assert '"state": "open"' in shown and '"thumbs"' in shown
        assert await asyncio.to_thread(run, "delete", "cli-1", *keyed) == 0
        assert '"applied": false' in capsys.readouterr().out  # nobody plays the trainer
        assert await asyncio.to_thread(run, "show", "cli-1", *keyed) == 0
        assert '"state": "deleted"' in capsys.readouterr().out
        assert await asyncio.to_thread(run, "delete", "nobody", *keyed) == 2
        assert "HTTP 404" in capsys.readouterr().err


async def session_deleted(broker: EmbeddedBroker, count: int = 1) -> list[pb.SessionDeleted]:
    """Wait for `count` SessionDeleted on hrl.policy, and return them all."""

    async def found() -> list[pb.SessionDeleted]:
        on = await events_on(broker.bootstrap, events.POLICY)
        return [event for kind, event in on if kind == "session_deleted"]

    async def arrived() -> bool:
        return len(await found()) >= count

    await eventually(arrived, timeout=30, interval=0.1)
    return await found()


def applied(group_id: str, *versions: int, dropped: int = 0) -> pb.SessionDeletionApplied:
    return pb.SessionDeletionApplied(
        group_id=group_id,
        trained_versions=versions,
        dropped_tokens=dropped,
        version=max(versions, default=0) + 1,
    )


async def test_a_session_deleted_before_its_reward_never_gets_one(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    async with reward_service(
        broker, tmp_path, window_s=1.0, delete_wait_s=0.2, registry=registry
    ) as (_, client):
        await publish(broker, tmp_path, started("desk", "gone"), started("desk", "kept"))
        await known(client, "gone", "open")
        marker = {"session": "gone", "name": "thumbs", "value": 1, "idempotency_key": "secret-1"}
        assert (await client.post("/v1/feedback", json=marker, headers=desk())).status_code == 202
        deleted = await client.delete("/v1/sessions/gone", headers=desk())
        assert deleted.status_code == 202, deleted.text
        assert deleted.json() == {
            "session": "gone",
            "deleted": True,
            "applied": False,
            "trained": None,
            "trained_versions": None,
        }
        # Its end redelivered or late, a signal after the deletion: it stays deleted.
        await publish(broker, tmp_path, finished("desk", "gone"), started("desk", "gone"))
        await publish(broker, tmp_path, finished("desk", "kept"))
        await known(client, "kept", "published")
        late = {"session": "gone", "name": "thumbs", "value": -1}
        refused = await client.post("/v1/feedback", json=late, headers=desk())
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "deleted"
        shown = (await client.get("/v1/sessions/gone", headers=desk())).json()
        assert (shown["state"], shown["deleted"], shown["applied"]) == ("deleted", True, False)
        assert "signals" not in shown
        await asyncio.sleep(1.5)  # sweeps past the window
    for path in (tmp_path / "sessions").iterdir():  # the store's file and its WAL
        assert b"secret-1" not in path.read_bytes(), path
    got = await rewards(broker, 1)
    assert list(got) == ["s.desk.kept"]  # never one for the deleted session
    [event] = await session_deleted(broker)
    assert (event.group_id, event.session.app, event.session.session_id) == (
        "s.desk.gone",
        "desk",
        "gone",
    )
    assert event.requested_at.ToNanoseconds() > 0
    pending = registry.get_sample_value(
        "harnessrl_feedback_deletions_total", {"outcome": "pending"}
    )
    assert pending == 1


async def test_a_deletion_the_trainer_applies_names_the_versions_that_trained_it(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    async with reward_service(broker, tmp_path, registry=registry) as (_, client):
        await publish(broker, tmp_path, started("desk", "trained"), finished("desk", "trained"))
        await known(client, "trained", "awaiting_feedback")
        thumbs = {"session": "trained", "name": "thumbs", "value": 1}
        assert (await client.post("/v1/feedback", json=thumbs, headers=desk())).status_code == 202
        await known(client, "trained", "published")

        deleting = asyncio.create_task(client.delete("/v1/sessions/trained", headers=desk()))
        [event] = await session_deleted(broker)
        assert not deleting.done()  # it waits for the trainer's answer
        await publish(broker, tmp_path, applied(event.group_id, 4, 7, dropped=12))
        answer = await deleting
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "session": "trained",
            "deleted": True,
            "applied": True,
            "trained": True,
            "trained_versions": [4, 7],
        }
        again = await client.delete("/v1/sessions/trained", headers=desk())
        assert (again.status_code, again.json()) == (200, answer.json())
        shown = (await client.get("/v1/sessions/trained", headers=desk())).json()
        assert (shown["state"], shown["dropped_tokens"], shown["version"]) == ("deleted", 12, 8)
    await session_deleted(broker, 2)  # published again by the repeat: harmless
    count = registry.get_sample_value("harnessrl_feedback_deletions_total", {"outcome": "applied"})
    assert count == 2


async def test_an_answer_after_the_wait_is_shown_once_it_arrives(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with reward_service(broker, tmp_path, delete_wait_s=0.5) as (_, client):
        await publish(broker, tmp_path, started("ide", "slow"))
        await known(client, "slow", "open", key=IDE_KEY)
        ide = {"x-api-key": IDE_KEY}
        first = await client.delete("/v1/sessions/slow", headers=ide)
        assert first.status_code == 202 and first.json()["applied"] is False
        again = await client.delete("/v1/sessions/slow", headers=ide)
        assert (again.status_code, again.json()) == (202, first.json())
        await publish(broker, tmp_path, applied("s.ide.slow"))

        async def answered() -> bool:
            shown = (await client.get("/v1/sessions/slow", headers=ide)).json()
            return bool(shown["applied"])

        await eventually(answered, timeout=30, interval=0.1)
        shown = (await client.get("/v1/sessions/slow", headers=ide)).json()
        assert (shown["trained"], shown["trained_versions"]) == (False, [])
        last = await client.delete("/v1/sessions/slow", headers=ide)
        assert last.status_code == 200 and last.json()["trained"] is False


async def test_another_apps_key_cannot_delete_a_session(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with reward_service(broker, tmp_path, delete_wait_s=0.2) as (_, client):
        await publish(broker, tmp_path, started("desk", "mine"))
        await known(client, "mine", "open")
        thumbs = {"session": "mine", "name": "thumbs", "value": 1}
        assert (await client.post("/v1/feedback", json=thumbs, headers=desk())).status_code == 202
        ide = {"x-api-key": IDE_KEY}
        refused = await client.delete("/v1/sessions/mine", headers=ide)
        assert refused.status_code == 404 and refused.json()["error"]["field"] == "session"
        assert (await client.delete("/v1/sessions/never", headers=desk())).status_code == 404
        assert (await client.delete("/v1/sessions/mine")).status_code == 401
        assert (await client.delete("/v1/sessions/a%2Fb", headers=desk())).status_code == 400
        shown = (await client.get("/v1/sessions/mine", headers=desk())).json()
        assert shown["state"] == "open" and len(shown["signals"]) == 1
    assert await session_deleted_count(broker) == 0


async def session_deleted_count(broker: EmbeddedBroker) -> int:
    on = await events_on(broker.bootstrap, events.POLICY)
    return sum(1 for kind, _ in on if kind == "session_deleted")
