"""The trainer and production sessions: what trained a session is announced, and a deleted
session is never trained (real broker, the trainer service on the tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import eventually
from tests.integration.test_trainer import PROMPTS, policy_events, publish, trained_ids, trainer


def _session(group_id: str, advantage: float = 1.0) -> pb.GroupSamples:
    sample = pb.Sample(
        sample_id=f"{group_id}/1/0",
        episode_id=group_id,
        attempt=1,
        token_ids=[*PROMPTS[0], 101, 102, 103],
        loss_mask=[False] * len(PROMPTS[0]) + [True] * 3,
        behavior_logprobs=[0.0] * len(PROMPTS[0]) + [-7.0] * 3,
        advantage=advantage,
        temperature=1.0,
    )
    return pb.GroupSamples(
        group_id=group_id, task_id=group_id, estimator="session_baseline", samples=[sample]
    )


async def _delete(broker: EmbeddedBroker, tmp_path: Path, group_id: str) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "delete-spill"),
        name="reward/test",
    )
    await producer.start()
    app, _, session = group_id.removeprefix("s.").partition(".")
    await producer.publish(
        pb.SessionDeleted(group_id=group_id, session=pb.SessionInfo(app=app, session_id=session))
    )
    await producer.stop()


async def _of(broker: EmbeddedBroker, kind: type[Any]) -> list[Any]:
    return [e for _, e in await policy_events(broker) if isinstance(e, kind)]


async def test_a_deleted_session_is_never_trained_and_the_answer_names_what_trained_one(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with trainer(broker, tmp_path, batch_groups=1, checkpoint_every=1) as service:
        await publish(broker, tmp_path, _session("s.support.early"))

        async def announced() -> list[pb.PolicyVersion]:
            return [v for v in await _of(broker, pb.PolicyVersion) if v.version >= 1]

        await eventually(announced, timeout=60)
        versions = await announced()
        assert list(versions[0].session_groups) == ["s.support.early"]
        # Deleted after it trained: the answer names the version.
        await _delete(broker, tmp_path, "s.support.early")
        # Deleted before its samples arrive: they are never trained.
        await _delete(broker, tmp_path, "s.support.late")

        async def applied() -> list[pb.SessionDeletionApplied]:
            found = await _of(broker, pb.SessionDeletionApplied)
            return found if len(found) == 2 else []

        await eventually(applied)
        answers = {a.group_id: list(a.trained_versions) for a in await applied()}
        assert answers == {"s.support.early": [versions[0].version], "s.support.late": []}
        await publish(broker, tmp_path, _session("s.support.late"), _session("s.support.next"))

        async def next_trained() -> bool:
            return "s.support.next/1/0" in trained_ids(tmp_path)

        await eventually(next_trained, timeout=60)
        assert "s.support.late/1/0" not in trained_ids(tmp_path)
        assert service.version == 2

        # The trainer's part of the token books: the late session's tokens, dropped.
        async def second() -> list[pb.PolicyVersion]:
            return [v for v in await _of(broker, pb.PolicyVersion) if v.version == 2]

        await eventually(second)
        assert dict((await second())[0].tokens_dropped) == {"deleted": 3}
