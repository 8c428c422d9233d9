"""The reward service end to end on the real broker: entry-point rewards (good and
misbehaving), the example gRPC reward service as its own process, redelivery after a
restart, and the scoring span in the episode's trace."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from examples.calculator.tasks import problems, task_line
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.runtime import Runtime
from harnessrl.services.reward.config import RewardConfig, RewardSection
from harnessrl.services.reward.service import RewardService
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, eventually, read_topic, topic_size

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORKERS = "tests.integration.workers.rewards"


def finished(
    episode_id: str,
    *,
    answer: Any = "42",
    metadata: dict[str, Any] | None = None,
    final: bool = True,
    attempt: int = 1,
    status: int = pb.EPISODE_STATUS_SUCCEEDED,
) -> pb.EpisodeFinished:
    event = pb.EpisodeFinished(
        episode_id=episode_id,
        attempt=attempt,
        group_id=episode_id.rsplit("-", 1)[0],
        task_id="t",
        mode=pb.MODE_TRAIN,
        status=status,  # type: ignore[arg-type]
        result_json=json.dumps({"answer": answer}),
        final=final,
        task_input_json=json.dumps({"question": "What is 6 * 7?"}),
        task_metadata_json=json.dumps({"answer": "42"} | (metadata or {})),
    )
    event.started_at.FromSeconds(1_700_000_000)
    event.finished_at.FromSeconds(1_700_000_009)
    return event


@asynccontextmanager
async def reward_service(
    broker: EmbeddedBroker,
    tmp_path: Path,
    name: str = "rw-0",
    registry: CollectorRegistry | None = None,
    tracer_provider: TracerProvider | None = None,
    **section: Any,
) -> AsyncIterator[RewardService]:
    config = RewardConfig(
        instance=name,
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / f"{name}-spill"),
        reward=RewardSection(port=0, **section),
    )
    service = RewardService(
        config,
        Runtime(
            "reward", name, registry or CollectorRegistry(), tracer_provider or TracerProvider()
        ),
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 30)
    try:
        yield service
    finally:
        await service.stop()
        await task


async def publish(broker: EmbeddedBroker, tmp_path: Path, *items: pb.EpisodeFinished) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "publish-spill"),
        name="controller/test",
    )
    await producer.start()
    for item in items:
        await producer.publish(item)
    await producer.stop()


async def rewards(broker: EmbeddedBroker, count: int) -> dict[str, pb.RewardAssigned]:
    """Wait for `count` RewardAssigned; by episode id (fails on a second one per attempt)."""

    async def arrived() -> bool:
        return await topic_size(broker.bootstrap, events.REWARDS) >= count

    await eventually(arrived, timeout=60, interval=0.2)
    out: dict[str, pb.RewardAssigned] = {}
    for record in await read_topic(broker.bootstrap, events.REWARDS, count):
        reward = events.decode(events.REWARDS, record.value).reward_assigned
        assert reward.episode_id not in out, f"{reward.episode_id} scored twice"
        out[reward.episode_id] = reward
    return out


async def test_entrypoint_reward_scores_and_survives_rewards_that_raise_hang_or_return_nan(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    behaviours = ["ok", "raise", "hang", "nan", "not_a_number", "mapping", "flaky", "ok"]
    items = [finished(f"g{i}-0", metadata={"behaviour": b}) for i, b in enumerate(behaviours)]
    registry = CollectorRegistry()
    async with reward_service(
        broker,
        tmp_path,
        registry=registry,
        source=f"entrypoint:{WORKERS}:by_behaviour",
        timeout_s=1.5,
        retry_backoff_s=0.05,
        concurrency=4,
    ) as service:
        await publish(broker, tmp_path, *items)
        got = await rewards(broker, len(items))
        source = service.source
    by = {b: got[f"g{i}-0"] for i, b in enumerate(behaviours)}
    assert all(r.source == source == f"entrypoint:{WORKERS}:by_behaviour" for r in got.values())
    assert (by["ok"].value, by["ok"].missing) == (1.0, False)
    assert dict(by["ok"].components) == {"succeeded": 1.0}
    assert list(by["ok"].flags) == ["checked"] and by["ok"].message == "answer=42"
    assert got["g7-0"].value == 1.0 and not got["g7-0"].missing  # scored after the others
    assert by["raise"].missing and "RuntimeError: the judge crashed" in by["raise"].message
    assert list(by["raise"].flags) == ["reward_error"]
    assert by["hang"].missing and list(by["hang"].flags) == ["reward_timeout"]
    assert "timeout" in by["hang"].message
    assert by["nan"].missing and list(by["nan"].flags) == ["non_finite"]
    assert by["not_a_number"].missing and list(by["not_a_number"].flags) == ["invalid_score"]
    assert "score.value" in by["not_a_number"].message
    assert (by["mapping"].value, list(by["mapping"].flags)) == (0.5, ["partial"])
    assert (by["flaky"].value, by["flaky"].missing) == (0.25, False)  # retried, then scored
    for flag, count in (("non_finite", 1), ("reward_timeout", 1), ("checked", 2)):
        assert registry.get_sample_value("harnessrl_reward_flags_total", {"flag": flag}) == count
    missing = registry.get_sample_value("harnessrl_reward_assigned_total", {"outcome": "missing"})
    assert missing == 4
    assert all(
        r.group_id == e.group_id and r.attempt == 1
        for r, e in zip([got[e.episode_id] for e in items], items, strict=True)
    )


async def test_only_final_attempts_are_scored_and_each_once(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    first = finished("a-0", final=False)
    retried = finished("a-0", attempt=2)
    async with reward_service(broker, tmp_path, source=f"entrypoint:{WORKERS}:answer_length"):
        await publish(broker, tmp_path, first, retried, retried, finished("b-0", answer="x"))
        got = await rewards(broker, 2)
        await asyncio.sleep(1.0)  # a duplicate would arrive by now
        assert await topic_size(broker.bootstrap, events.REWARDS) == 2
    assert (got["a-0"].attempt, got["a-0"].value) == (2, 2.0)
    assert got["b-0"].value == 1.0


async def test_a_restarted_service_does_not_score_an_episode_again(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    source = f"entrypoint:{WORKERS}:answer_length"
    async with reward_service(broker, tmp_path, "rw-a", source=source):
        await publish(broker, tmp_path, finished("c-0"))
        await rewards(broker, 1)
    # The same episode again (a controller that re-reported it), then a new one.
    async with reward_service(broker, tmp_path, "rw-b", source=source):
        await publish(broker, tmp_path, finished("c-0"), finished("d-0"))
        got = await rewards(broker, 2)
        await asyncio.sleep(1.0)
        assert await topic_size(broker.bootstrap, events.REWARDS) == 2
    assert set(got) == {"c-0", "d-0"}


async def test_builtin_answer_ignores_a_reward_the_harness_reports_itself(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    cheat = finished("e-0", answer="41")
    cheat.result_json = json.dumps({"answer": "41", "reward": 1.0, "score": 1.0})
    async with reward_service(broker, tmp_path, source="builtin:answer"):
        await publish(broker, tmp_path, cheat, finished("f-0", answer="The answer is 42."))
        got = await rewards(broker, 2)
    assert (got["e-0"].value, got["e-0"].source) == (0.0, "builtin:answer")
    assert got["f-0"].value == 1.0


async def test_scoring_span_joins_the_episode_trace(broker: EmbeddedBroker, tmp_path: Path) -> None:
    provider = TracerProvider()
    with provider.get_tracer("test").start_as_current_span("episode") as span:
        trace_id = f"{span.get_span_context().trace_id:032x}"
        await publish(broker, tmp_path, finished("h-0"))
    async with reward_service(broker, tmp_path, source="builtin:answer"):
        await rewards(broker, 1)
    (record,) = await read_topic(broker.bootstrap, events.REWARDS, 1)
    traceparent = dict(record.headers)["traceparent"].decode()
    assert traceparent.split("-")[1] == trace_id


@pytest.fixture
def example_server() -> Iterator[str]:
    """examples/reward_service/server.py as its own process; yields its address."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "reward_service" / "server.py"), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        for line in process.stderr:
            found = re.search(r"listening on (\S+:\d+)", line)
            if found:
                break
        else:
            pytest.fail("the example reward server never said it was listening")
        yield found.group(1)
    finally:
        process.terminate()
        process.wait(10)


async def test_the_example_grpc_reward_service_scores_episodes(
    broker: EmbeddedBroker, tmp_path: Path, example_server: str
) -> None:
    items = [
        finished("i-0", answer="42"),
        finished("j-0", answer="forty"),
        finished("k-0", status=pb.EPISODE_STATUS_TIMEOUT),
    ]
    async with reward_service(broker, tmp_path, source=f"grpc:{example_server}"):
        await publish(broker, tmp_path, *items)
        got = await rewards(broker, 3)
    assert all(r.source == f"grpc:{example_server}" for r in got.values())
    assert (got["i-0"].value, got["i-0"].missing) == (1.0, False)
    assert got["i-0"].components["exact"] == 1.0
    assert got["j-0"].value == 0.0 and not got["j-0"].missing
    assert got["k-0"].value == 0.0


async def test_the_example_grpc_reward_service_scores_calculator_episodes(
    broker: EmbeddedBroker, tmp_path: Path, example_server: str
) -> None:
    """The custom-reward profile of docker-compose.yml runs the calculator's tasks through
    this server: a right answer, in the calculator harness's own result shape, must score
    1 and a wrong one 0, or every group has zero variance and nothing trains."""
    problem = problems("train", 1, seed=1)[0]
    metadata = task_line(problem)["metadata"]
    right = f"{problem.expression} is {problem.answer:,}."
    items = [
        finished("c-0", answer=right, metadata=metadata),
        finished("d-0", answer=f"It is {problem.answer + 1}.", metadata=metadata),
        finished("e-0", answer="I cannot say.", metadata=metadata),
    ]
    for item in items:  # the result the calculator harness writes: answer, calls, tools
        result = json.loads(item.result_json) | {"calls": 2, "tools": 1}
        item.result_json = json.dumps(result)
    async with reward_service(broker, tmp_path, source=f"grpc:{example_server}"):
        await publish(broker, tmp_path, *items)
        got = await rewards(broker, 3)
    assert (got["c-0"].value, got["c-0"].missing) == (1.0, False), got["c-0"].message
    assert (got["d-0"].value, got["d-0"].missing) == (0.0, False)
    assert (got["e-0"].value, list(got["e-0"].flags)) == (0.0, ["no_number"])


async def test_an_unreachable_grpc_reward_is_retried_then_missing(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with reward_service(
        broker, tmp_path, source="grpc:127.0.0.1:9", max_retries=2, retry_backoff_s=0.05
    ):
        await publish(broker, tmp_path, finished("l-0"))
        got = await rewards(broker, 1)
    assert got["l-0"].missing and list(got["l-0"].flags) == ["reward_error"]
    assert "UNAVAILABLE" in got["l-0"].message


async def test_builtin_tests_refuses_to_start_where_it_cannot_jail_a_test_run(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """builtin:tests never scores outside its jail: a service that cannot make one stops at
    start, naming the setting, instead of leaving every coding episode unscored."""
    from harnessrl.services.reward.config import TestsSettings
    from harnessrl.services.reward.jail import JailError

    config = RewardConfig(
        instance="rw-nojail",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "spill"),
        reward=RewardSection(
            port=0, source="builtin:tests", tests=TestsSettings(bwrap="no-such-bwrap")
        ),
    )
    service = RewardService(config, Runtime("reward", "rw", CollectorRegistry(), TracerProvider()))
    with pytest.raises(JailError, match=r"reward\.tests\.bwrap: 'no-such-bwrap' not found"):
        await service.run()
    assert not service.ready.is_set()
