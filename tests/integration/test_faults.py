"""Faults on the real broker: a consumer killed mid-batch, a frozen broker, a killed producer."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harnessrl import events
from harnessrl.broker import EmbeddedBroker, free_port
from harnessrl.bus import BusMetrics, Consumer, Context, Producer, Record, ensure_topics
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import committed_offsets, eventually, read_topic, topic_size

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _worker(broker: EmbeddedBroker, tmp_path: Path, run: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.workers.consumer_worker",
            "--bootstrap",
            broker.bootstrap,
            "--group",
            "crash",
            "--log",
            str(tmp_path / "handled"),
            "--spill",
            str(tmp_path / f"spill-{run}"),
            "--run",
            run,
        ],
        cwd=ROOT,
    )


def _handled(tmp_path: Path) -> list[tuple[str, int, int]]:
    path = tmp_path / "handled"
    if not path.exists():
        return []
    rows = [line.split() for line in path.read_text().splitlines()]
    return [(run, int(p), int(o)) for run, p, o in rows]


async def test_consumer_killed_mid_batch_reprocesses_only_uncommitted_records(
    broker: EmbeddedBroker,
    kafka: KafkaSettings,
    producer_settings: ProducerSettings,
    tmp_path: Path,
) -> None:
    total = 300
    producer = Producer(kafka, producer_settings, name="feeder/0")
    await producer.start()
    acks = await asyncio.gather(
        *(
            producer.publish(pb.TaskSubmitted(task_id=f"t{i}", group_id=f"g{i % 9}"))
            for i in range(total)
        )
    )
    await producer.stop()
    ends: dict[int, int] = {}
    for ack in acks:
        ends[ack.partition] = max(ends.get(ack.partition, 0), ack.offset + 1)

    first = _worker(broker, tmp_path, "1")
    try:
        await eventually(lambda: len(_handled(tmp_path)) >= 100, timeout=60)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    await asyncio.sleep(0.5)  # let a commit that was on the wire land
    committed = await committed_offsets(broker.bootstrap, "crash", events.TASKS)
    run1 = {(p, o) for run, p, o in _handled(tmp_path) if run == "1"}
    assert 0 < sum(committed.values()) < total, "kill should land mid-run"

    second = _worker(broker, tmp_path, "2")
    try:
        await eventually(
            lambda: (
                len({(p, o) for r, p, o in _handled(tmp_path) if r == "2"})
                == total - sum(committed.values())
            ),
            timeout=60,
        )
    finally:
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    run2_rows = [(p, o) for run, p, o in _handled(tmp_path) if run == "2"]
    run2 = set(run2_rows)
    everything = {(p, o) for p, end in ends.items() for o in range(end)}
    uncommitted = {(p, o) for p, o in everything if o >= committed.get(p, 0)}

    assert run1 | run2 == everything  # nothing lost
    assert run2 == uncommitted  # exactly the uncommitted records were reprocessed
    assert len(run2_rows) == len(run2)  # ... each once
    assert {(p, o) for p, o in everything if o < committed.get(p, 0)} <= run1
    # Every task's output exists: commits waited for the outputs' acknowledgements.
    size = await topic_size(broker.bootstrap, events.EPISODES)
    outputs = await read_topic(broker.bootstrap, events.EPISODES, size)
    tasks = {events.decode(events.EPISODES, r.value).episode_started.task_id for r in outputs}
    assert tasks == {f"t{i}" for i in range(total)}


async def test_frozen_broker_loses_nothing_and_keeps_per_key_order(
    broker: EmbeddedBroker,
    kafka: KafkaSettings,
    consumer_settings: ConsumerSettings,
    tmp_path: Path,
) -> None:
    metrics = BusMetrics()
    settings = ProducerSettings(
        spill_dir=tmp_path / "spill", buffer_max_bytes=256 * 1024, in_flight_max_bytes=64 * 1024
    )
    producer = Producer(kafka, settings, name="gateway/0", metrics=metrics)
    await producer.start()
    seen: list[tuple[str, int]] = []

    async def handle(record: Record, ctx: Context) -> None:
        seen.append((record.event.episode_id, record.event.seq))

    consumer = Consumer(
        kafka,
        consumer_settings,
        topics=[events.CALLS],
        group_id="freeze",
        handler=handle,
        producer=producer,
    )
    task = asyncio.create_task(consumer.run())
    await eventually(lambda: bool(consumer.assigned))

    deliveries = []
    broker.freeze()
    try:
        for i in range(1000):  # 10 s of traffic, all while the broker is frozen
            call = pb.ModelCall(
                episode_id=f"e{i % 10}",
                attempt=1,
                group_id=f"g{i % 10}",
                seq=i // 10,
                prompt_token_ids=range(500),
                completion_token_ids=range(100),
                completion_logprobs=[-1.0] * 100,
            )
            deliveries.append(producer.publish(call))  # must never raise
            await asyncio.sleep(0.01)
        assert not any(d.done() for d in deliveries)
    finally:
        broker.thaw()
    acks = await asyncio.wait_for(asyncio.gather(*deliveries), 60)
    assert len(acks) == 1000
    await eventually(lambda: len(set(seen)) == 1000, timeout=60)
    await consumer.stop()
    await task
    await producer.stop()

    assert metrics.spilled._value.get() > 0  # the disk spill path was exercised
    for episode in {e for e, _ in seen}:
        first_seen: list[int] = []
        for e, seq in seen:
            if e == episode and seq not in first_seen:
                first_seen.append(seq)
        assert first_seen == list(range(100)), f"{episode} out of order"


async def test_wal_producer_killed_before_the_broker_came_up_loses_nothing(
    tmp_path: Path,
) -> None:
    port = free_port()
    bootstrap = f"127.0.0.1:{port}"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.workers.wal_producer",
            "--bootstrap",
            bootstrap,
            "--spill",
            str(tmp_path / "spill"),
            "--count",
            "200",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 30)
        assert line.strip() == b"accepted"
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()

    broker = EmbeddedBroker(port=port)
    await broker.start()
    try:
        kafka = KafkaSettings(bootstrap_servers=bootstrap, partitions=3)
        await ensure_topics(kafka)
        again = Producer(
            kafka, ProducerSettings(spill_dir=tmp_path / "spill", wal=True), name="wal/0"
        )
        await again.start()
        assert await again.flush(30)
        await again.stop()
        records = await read_topic(bootstrap, events.CALLS, 200)
        seqs = [events.decode(events.CALLS, r.value).model_call.seq for r in records]
        assert seqs == list(range(200))  # one key, one partition: in order
    finally:
        await broker.stop()


async def test_expired_sends_are_retried_until_the_broker_answers(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    # A request timeout shorter than the freeze: aiokafka gives up on its batches, and the
    # producer's own retry path has to send them again.
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap, request_timeout_ms=1000)
    metrics = BusMetrics()
    producer = Producer(
        kafka,
        ProducerSettings(
            spill_dir=tmp_path / "spill", retry_backoff_ms=50, retry_backoff_max_ms=400
        ),
        name="svc/0",
        metrics=metrics,
    )
    await producer.start()
    await producer.publish(pb.ModelCall(episode_id="e", attempt=1, group_id="g", seq=100))
    broker.freeze()
    try:
        deliveries = [
            producer.publish(pb.ModelCall(episode_id="e", attempt=1, group_id="g", seq=i))
            for i in range(100)
        ]
        await asyncio.sleep(3.0)
    finally:
        broker.thaw()
    acks = await asyncio.wait_for(asyncio.gather(*deliveries), 60)
    await producer.stop()
    assert len(acks) == 100
    assert metrics.publish_retries(events.CALLS)._value.get() >= 100
    records = await read_topic(
        broker.bootstrap, events.CALLS, await topic_size(broker.bootstrap, events.CALLS)
    )
    seqs = [events.decode(events.CALLS, r.value).model_call.seq for r in records]
    first_seen = list(dict.fromkeys(seqs))  # duplicates allowed (at least once), loss not
    assert first_seen == [100, *range(100)]  # one key: re-sent in publish order
