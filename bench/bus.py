"""`harnessrl bench bus`: the bus against raw aiokafka, same bytes, same broker, same run.

Three paths move the same ModelCall-sized events (2,000 prompt ids, 500 completion ids and
log-probs; ~9.3 kB serialised) from a producer to a consumer group that commits per batch:

- bus: the project's Producer.publish(event) (envelope, trace headers, memory buffer and
  spill, acknowledgement futures) and Consumer (decode, span, handler, commit only after the
  record's outputs are acknowledged);
- raw: hand-written aiokafka doing the same job with the same messages: it serialises each
  event's envelope (the same bytes the bus sends) and parses it on receipt;
- raw-bytes: aiokafka moving the pre-serialised bytes, with no protobuf work at either end
  (a floor for what any Python service can do on this broker).

Each round runs every path, rotating their order. Throughput: N events published as fast as
the path allows, events/s from the first publish to the last receipt. Latency: events at a
fixed rate well below saturation, per-event time from publish to the consumer's handler.
Medians over rounds. `ratio` is bus / raw; `ratio_vs_bytes` is bus / raw-bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from harnessrl import events
from harnessrl.v1 import events_pb2 as pb

LATENCY_EVENTS = 600
LATENCY_RATE = 300.0  # events/s, well below every path's capacity
GROUPS = 16  # distinct keys, spread over the topic's partitions
PATHS = ("bus", "raw", "raw-bytes")


def model_calls(n: int, seed: int = 0) -> list[pb.ModelCall]:
    """ModelCall-sized events: 2,000 prompt ids, 500 completion ids and log-probs each."""
    rng = random.Random(seed)
    prompt = [rng.randrange(151_000) for _ in range(2000)]
    completion = [rng.randrange(151_000) for _ in range(500)]
    logprobs = [-rng.random() * 3 for _ in range(500)]
    return [
        pb.ModelCall(
            episode_id=f"bench-{i % GROUPS}",
            attempt=1,
            group_id=f"bench-g{i % GROUPS}",
            seq=i,
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=logprobs,
            policy_version=3,
            finish_reason="stop",
        )
        for i in range(n)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _BusRun:
    """Send and receive times by event index, for one measurement."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sent: dict[int, float] = {}
        self.received: dict[int, float] = {}
        self.done = asyncio.Event()

    def got(self, index: int) -> None:
        if index not in self.received and index in self.sent:
            self.received[index] = time.perf_counter()
            if len(self.received) == self.n:
                self.done.set()

    def throughput(self) -> float:
        return self.n / (max(self.received.values()) - min(self.sent.values()))

    def latencies_ms(self) -> list[float]:
        return [(self.received[i] - self.sent[i]) * 1000 for i in self.received]


async def _group_at_end(kafka: Any, group: str) -> None:
    """Commit hrl.calls' end offsets for a new group, so it sees only what comes next."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from harnessrl.bus import client_kwargs

    client = AIOKafkaConsumer(
        **client_kwargs(kafka, "bench-setup"), group_id=group, enable_auto_commit=False
    )
    await client.start()
    try:
        await client.topics()  # loads metadata for every topic
        tps = [
            TopicPartition(events.CALLS, p) for p in client.partitions_for_topic(events.CALLS) or ()
        ]
        client.assign(tps)
        await client.commit(await client.end_offsets(tps))
    finally:
        await client.stop()


async def _send_all(run: _BusRun, count: int, paced: bool, send: Callable[[int], Any]) -> None:
    start = time.perf_counter()
    for i in range(count):
        if paced:
            delay = start + i / LATENCY_RATE - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        run.sent[i] = time.perf_counter()
        await send(i)
        if not paced and i % 256 == 255:
            await asyncio.sleep(0)  # let consumers and pumps run, as a service's loop would


async def _bus(
    kafka: Any, spill: Path, calls: list[pb.ModelCall], tag: str, paced: bool
) -> _BusRun:
    from harnessrl.bus import Consumer, Producer
    from harnessrl.config import ConsumerSettings, ProducerSettings

    group = f"bench-bus-{tag}"
    await _group_at_end(kafka, group)
    run = _BusRun(len(calls))
    producer = Producer(kafka, ProducerSettings(spill_dir=spill), name=f"bench/{tag}")
    await producer.start()

    async def handle(record: Any, ctx: Any) -> None:
        run.got(record.event.seq)

    consumer = Consumer(
        kafka,
        ConsumerSettings(session_timeout_ms=2000, heartbeat_interval_ms=500),
        topics=[events.CALLS],
        group_id=group,
        handler=handle,
        producer=producer,
    )
    task = asyncio.create_task(consumer.run())
    while not consumer.assigned:
        await asyncio.sleep(0.05)
    await producer.flush()  # connected and idle before the clock starts

    async def send(i: int) -> None:
        producer.publish(calls[i])

    await _send_all(run, len(calls), paced, send)
    await asyncio.wait_for(run.done.wait(), 120)
    await consumer.stop()
    await task
    await producer.stop()
    return run


async def _raw(
    kafka: Any, calls: list[pb.ModelCall], tag: str, paced: bool, protobuf: bool
) -> _BusRun:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from harnessrl.bus import client_kwargs
    from harnessrl.config import ConsumerSettings

    group = f"bench-raw-{tag}"
    await _group_at_end(kafka, group)
    run = _BusRun(len(calls))
    envelopes = [events.wrap(c, producer="bench/raw") for c in calls]
    keys = [events.event_key(c).encode() for c in calls]
    payloads = [e.SerializeToString() for e in envelopes]
    producer = AIOKafkaProducer(
        **client_kwargs(kafka, f"bench-raw-{tag}"),
        acks="all",
        linger_ms=kafka.linger_ms,
        max_batch_size=kafka.max_batch_bytes,
        max_request_size=kafka.max_request_bytes,
    )
    consumer = AIOKafkaConsumer(
        events.CALLS,
        **client_kwargs(kafka, f"bench-raw-c-{tag}"),
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        session_timeout_ms=2000,
        heartbeat_interval_ms=500,
        fetch_max_wait_ms=ConsumerSettings().fetch_max_wait_ms,
    )
    await producer.start()
    await consumer.start()

    async def consume() -> None:
        while not run.done.is_set():
            batch = await consumer.getmany(timeout_ms=200, max_records=500)
            for records in batch.values():
                for record in records:
                    if protobuf:
                        run.got(pb.CallEnvelope.FromString(record.value).model_call.seq)
                    else:
                        run.got(int(record.headers[0][1]))
            if batch:
                await consumer.commit()

    task = asyncio.create_task(consume())
    while not consumer.assignment():
        await asyncio.sleep(0.05)
    futures = []

    async def send(i: int) -> None:
        if protobuf:
            value, headers = envelopes[i].SerializeToString(), []
        else:
            value, headers = payloads[i], [("i", str(i).encode())]
        futures.append(await producer.send(events.CALLS, value, key=keys[i], headers=headers))

    await _send_all(run, len(calls), paced, send)
    await asyncio.gather(*futures)
    await asyncio.wait_for(run.done.wait(), 120)
    await task
    await consumer.stop()
    await producer.stop()
    return run


async def _round(
    kafka: Any, tmp: Path, path: str, calls: list[pb.ModelCall], paced: bool
) -> _BusRun:
    tag = f"{path}-{time.time_ns()}"
    if path == "bus":
        return await _bus(kafka, tmp / tag, calls, tag, paced)
    return await _raw(kafka, calls, tag, paced, protobuf=path == "raw")


async def _measure(
    args: argparse.Namespace, kafka: Any, log: Callable[[str], None]
) -> dict[str, Any]:
    calls = model_calls(args.events)
    paced_calls = model_calls(LATENCY_EVENTS, seed=1)
    size = statistics.mean(
        len(events.wrap(c, producer="bench").SerializeToString()) for c in calls[:GROUPS]
    )
    eps: dict[str, list[float]] = {p: [] for p in PATHS}
    latency: dict[str, list[float]] = {p: [] for p in PATHS}
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-") as tmp:
        for r in range(args.rounds):
            for path in PATHS[r % 3 :] + PATHS[: r % 3]:
                eps[path].append((await _round(kafka, Path(tmp), path, calls, False)).throughput())
                latency[path] += (
                    await _round(kafka, Path(tmp), path, paced_calls, True)
                ).latencies_ms()
            log(
                f"round {r + 1}/{args.rounds}: "
                + ", ".join(f"{p} {eps[p][-1]:,.0f} ev/s" for p in PATHS)
            )
    bus, raw, raw_bytes = (statistics.median(eps[p]) for p in PATHS)
    return {
        "event_bytes": round(size),
        "events_per_round": args.events,
        "rounds": args.rounds,
        "bus_events_per_s": round(bus, 1),
        "raw_events_per_s": round(raw, 1),
        "raw_bytes_events_per_s": round(raw_bytes, 1),
        "ratio": round(bus / raw, 3),
        "ratio_vs_bytes": round(bus / raw_bytes, 3),
        "p50_ms": round(percentile(latency["bus"], 0.50), 2),
        "p99_ms": round(percentile(latency["bus"], 0.99), 2),
        "raw_p50_ms": round(percentile(latency["raw"], 0.50), 2),
        "raw_p99_ms": round(percentile(latency["raw"], 0.99), 2),
        "latency_rate_per_s": LATENCY_RATE,
    }


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    from harnessrl.broker import EmbeddedBroker
    from harnessrl.bus import ensure_topics
    from harnessrl.command import load
    from harnessrl.config import ServiceConfig

    def log(line: str) -> None:
        print(f"bench bus: {line}", file=sys.stderr, flush=True)

    broker = None
    if not args.bootstrap:
        broker = EmbeddedBroker(port=0)
        await broker.start()
        args.bootstrap = broker.bootstrap
        log(f"embedded broker on {broker.bootstrap}")
    try:
        kafka = load(ServiceConfig, args).kafka
        await ensure_topics(kafka, [events.CALLS])
        result = await _measure(args, kafka, log)
        result["broker"] = "embedded tansu" if broker else kafka.bootstrap_servers
        return result
    finally:
        if broker is not None:
            await broker.stop()


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(_main(args))
    if not args.json:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0
