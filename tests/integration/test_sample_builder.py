"""The sample builder on the real broker: groups from a real harness run (controller,
gateway, engine, reward service), restarts, late and duplicated events, timeouts."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import Message
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.runtime import Runtime
from harnessrl.services.sample_builder.config import SampleBuilderConfig, SampleBuilderSection
from harnessrl.services.sample_builder.service import SampleBuilderService
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, eventually, read_topic, topic_size
from tests.integration.gateway_stack import Stack
from tests.integration.test_controller import _submit, _task, calc_model, controller, stack
from tests.integration.test_reward import reward_service

pytestmark = pytest.mark.integration
__all__ = ["calc_model", "stack"]  # fixtures used here

ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def sample_builder(
    broker: EmbeddedBroker,
    tmp_path: Path,
    name: str = "sb-0",
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
    **section: Any,
) -> AsyncIterator[SampleBuilderService]:
    config = SampleBuilderConfig(
        instance=name,
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / f"{name}-spill"),
        sample_builder=SampleBuilderSection(port=0, **section),
    )
    service = SampleBuilderService(
        config,
        Runtime(
            "sample-builder",
            name,
            registry or CollectorRegistry(),
            tracer_provider or TracerProvider(),
        ),
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield service
    finally:
        await service.stop()
        await task


async def samples_on_topic(broker: EmbeddedBroker, count: int) -> list[pb.GroupSamples]:
    async def arrived() -> bool:
        return await topic_size(broker.bootstrap, events.SAMPLES) >= count

    await eventually(arrived, timeout=90, interval=0.3)
    records = await read_topic(broker.bootstrap, events.SAMPLES, count)
    return [events.decode(events.SAMPLES, r.value).group_samples for r in records]


async def test_groups_from_a_real_harness_run_hold_exactly_the_recorded_tokens(
    stack: Stack, tmp_path: Path
) -> None:
    broker = stack.broker
    async with (
        controller(stack, tmp_path),
        reward_service(
            broker, tmp_path, source="entrypoint:tests.integration.workers.rewards:by_index"
        ),
        sample_builder(broker, tmp_path, tokenizer=ROOT / "examples" / "tiny-model"),
    ):
        await _submit(
            broker.bootstrap,
            tmp_path,
            _task("g-train", {"question": "What is 17 + 25?"}, size=3, split=pb.MODE_TRAIN),
        )
        (group,) = await samples_on_topic(broker, 1)
    # The group is built only once every call arrived: these are all of them. (Train mode
    # samples at temperature 1, so an episode makes one call or several.)
    calls = {(c.episode_id, c.seq): c for c in await stack.calls()}
    assert group.group_id == "g-train" and group.estimator == "grpo"
    assert len(group.dropped) == 0 and group.span_id and group.trace_id
    assert group.merge.calls == len(calls) >= 3
    rewards = np.array([0.0, 1.0, 2.0])
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    by_episode: dict[str, list[pb.Sample]] = {}
    for sample in group.samples:
        by_episode.setdefault(sample.episode_id, []).append(sample)
    assert sorted(by_episode) == ["g-train-0", "g-train-1", "g-train-2"]
    for index, (episode, samples) in enumerate(sorted(by_episode.items())):
        trained: list[int] = []
        for sample in samples:
            assert sample.advantage == pytest.approx(expected[index], abs=1e-6)
            assert sample.reward == rewards[index]
            last = calls[(episode, sample.call_seqs[-1])]
            # The sequence is exactly what the engine saw and produced: nothing re-encoded.
            assert list(sample.token_ids) == [
                *last.prompt_token_ids,
                *last.completion_token_ids,
            ]
            mask = np.array(sample.loss_mask)
            ids = np.array(sample.token_ids)
            trained.extend(ids[mask].tolist())
            assert np.all(np.array(sample.behavior_logprobs)[~mask] == 0)
            assert set(sample.call_span_ids) == {
                calls[(episode, s)].span_id for s in sample.call_seqs
            }
        seqs = sorted(s for e, s in calls if e == episode)
        recorded = [t for s in seqs for t in calls[(episode, s)].completion_token_ids]
        assert trained == recorded  # every completion token once, in order, trained on
    # The group's token books: everything captured was trained, as `events tail` shows it.
    captured = sum(len(c.completion_token_ids) for c in calls.values())
    assert (group.books.captured, group.books.trained, dict(group.books.dropped)) == (
        captured,
        captured,
        {},
    )
    shown = events.to_dict(group)
    assert shown["books"]["captured"] == str(captured)  # 64-bit counts are strings in JSON


def episode_events(group: str, index: int, calls: int, reward: float) -> list[Message]:
    """A plausible episode: calls extending one context, closed, finished, rewarded."""
    rng = random.Random(index)  # the same tokens in every group
    episode = f"{group}-{index}"
    out: list[Message] = [
        pb.EpisodeStarted(
            episode_id=episode, attempt=1, group_id=group, task_id=group, index=index,
            group_size=3, mode=pb.MODE_TRAIN,
        )
    ]  # fmt: skip
    prompt = [rng.randrange(2000) for _ in range(20)]
    for seq in range(calls):
        completion = [rng.randrange(2000) for _ in range(rng.randint(3, 9))]
        out.append(
            pb.ModelCall(
                episode_id=episode, attempt=1, group_id=group, seq=seq, mode=pb.MODE_TRAIN,
                prompt_token_ids=prompt, completion_token_ids=completion,
                completion_logprobs=[-0.5] * len(completion), temperature=1.0,
                policy_version=3, trace_id=f"{index + 1:032x}", span_id=f"{seq + 1:016x}",
            )
        )  # fmt: skip
        prompt = prompt + completion + [rng.randrange(2000) for _ in range(4)]
    out.append(pb.EpisodeClosed(episode_id=episode, attempt=1, group_id=group, call_count=calls))
    out.append(
        pb.EpisodeFinished(
            episode_id=episode, attempt=1, group_id=group, task_id=group, final=True,
            status=pb.EPISODE_STATUS_SUCCEEDED, mode=pb.MODE_TRAIN,
        )
    )  # fmt: skip
    out.append(
        pb.RewardAssigned(episode_id=episode, attempt=1, group_id=group, value=reward, source="t")
    )
    return out


def group_events(group: str, rewards: tuple[float, ...] = (0.0, 1.0, 0.5)) -> list[Message]:
    return [e for i, r in enumerate(rewards) for e in episode_events(group, i, 2 + i, r)]


def outcome_events(group: str, index: int, reward: float, size: int = 2) -> list[Message]:
    """What the controller and the reward service publish for episode `index` of a train
    group whose calls went through a real gateway (which publishes its close)."""
    episode = f"{group}-{index}"
    return [
        pb.EpisodeStarted(
            episode_id=episode, attempt=1, group_id=group, task_id=group, index=index,
            group_size=size, mode=pb.MODE_TRAIN,
        ),
        pb.EpisodeFinished(
            episode_id=episode, attempt=1, group_id=group, task_id=group, final=True,
            status=pb.EPISODE_STATUS_SUCCEEDED, mode=pb.MODE_TRAIN,
        ),
        pb.RewardAssigned(episode_id=episode, attempt=1, group_id=group, value=reward, source="t"),
    ]  # fmt: skip


async def publish(broker: EmbeddedBroker, tmp_path: Path, items: list[Message]) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "publish-spill"),
        name="test/publisher",
    )
    await producer.start()
    for item in items:
        await producer.publish(item)
    await producer.stop()


async def test_a_restart_mid_group_builds_each_group_once_with_identical_bytes(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    first, second = group_events("ga"), group_events("gb")
    random.Random(1).shuffle(second)
    async with sample_builder(broker, tmp_path, "sb-a"):
        await publish(broker, tmp_path, first + second[: len(second) // 2])
        (built,) = await samples_on_topic(broker, 1)
    assert built.group_id == "ga"
    async with sample_builder(broker, tmp_path, "sb-b"):
        # The rest of gb, and ga again (a re-delivery after the emission).
        await publish(broker, tmp_path, second[len(second) // 2 :] + first[:3])
        got = await samples_on_topic(broker, 2)
        await asyncio.sleep(1.5)
        assert await topic_size(broker.bootstrap, events.SAMPLES) == 2
    assert sorted(g.group_id for g in got) == ["ga", "gb"]
    # The same events in another order, built fresh, give the same samples.
    async with sample_builder(broker, tmp_path, "sb-c"):
        shuffled = group_events("gc")
        random.Random(2).shuffle(shuffled)
        await publish(broker, tmp_path, shuffled + shuffled[:4])
        fresh = {g.group_id: g for g in await samples_on_topic(broker, 3)}
    gb, gc = fresh["gb"], fresh["gc"]
    for left, right in zip(gb.samples, gc.samples, strict=True):
        right.sample_id, right.episode_id = left.sample_id, left.episode_id
        assert left.SerializeToString(deterministic=True) == right.SerializeToString(
            deterministic=True
        )


async def test_zero_variance_and_val_groups_train_nothing_and_their_books_are_published(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    flat = group_events("flat", (1.0, 1.0, 1.0))
    val = group_events("val")
    for event in val:
        if hasattr(event, "mode"):
            event.mode = pb.MODE_VAL  # type: ignore[attr-defined]
    registry = CollectorRegistry()
    async with sample_builder(broker, tmp_path, registry=registry):
        await publish(broker, tmp_path, flat + val + group_events("ok"))
        records = {g.group_id: g for g in await samples_on_topic(broker, 3)}
        group = records["ok"]
        for name, reason in (("flat", "zero_variance"), ("val", "val")):
            dropped = records[name]
            assert not dropped.samples and dropped.dropped_reason == reason
            assert dropped.books.captured == dropped.books.dropped[reason] > 0

        async def counted() -> bool:
            value = registry.get_sample_value
            return (
                value("harnessrl_samples_groups_total", {"outcome": "zero_variance"}) == 1
                and value("harnessrl_samples_groups_total", {"outcome": "val"}) == 1
            )

        await eventually(counted, timeout=10)
    assert group.group_id == "ok"


async def test_a_group_that_never_completes_is_built_from_what_arrived_at_its_timeout(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    items = group_events("late", (0.0, 1.0, 0.5))
    unrewarded = [
        e for e in items if not (isinstance(e, pb.RewardAssigned) and e.episode_id == "late-2")
    ]
    async with sample_builder(broker, tmp_path, group_timeout_s=2.0, sweep_interval_s=0.2):
        await publish(broker, tmp_path, unrewarded)
        (group,) = await samples_on_topic(broker, 1)
    assert {s.episode_id for s in group.samples} == {"late-0", "late-1"}
    assert [(d.episode_id, d.reason) for d in group.dropped] == [("late-2", "incomplete:reward")]
