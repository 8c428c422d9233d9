"""Two gateway replicas behind one controller: the controller spreads episodes over both
(rendezvous hashing of the episode id), each episode's calls are captured and closed at its
owner, one replica is SIGKILLed and restarted mid-run, and a token presented to the wrong
replica is refused with nothing captured.

Real parts: the embedded broker, two `harnessrl gateway` processes (so the kill is real), the
controller service running the real local runner on an `openai`-SDK harness, and the
calculator stand-in engine (bench/calculator_standin.py) that answers like the demo model.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from harnessrl import events
from harnessrl.bench import calculator_standin
from harnessrl.broker import EmbeddedBroker, free_ports
from harnessrl.bus import Producer
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.episode_token import EpisodeClaims, mint
from harnessrl.runtime import Runtime
from harnessrl.services.controller.config import (
    ControllerConfig,
    ControllerSection,
    GatewayReplica,
    HarnessSpec,
)
from harnessrl.services.controller.gateway_admin import owner
from harnessrl.services.controller.service import ControllerService
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, eventually
from tests.integration.test_gateway_restart import ADMIN, SECRET, Gateway

pytestmark = pytest.mark.integration

WORKERS = Path(__file__).parent / "workers"
GROUPS, SIZE = 5, 4


async def test_two_replicas_share_the_episodes_and_a_killed_one_loses_and_doubles_nothing(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    engine_port, *ports = free_ports(3)
    standin = multiprocessing.get_context("spawn").Process(
        target=calculator_standin.serve, args=(engine_port,), daemon=True
    )
    standin.start()
    gateways = {
        name: Gateway(broker.bootstrap, engine_port, port, tmp_path, instance=name, replica=name)
        for name, port in zip(("gw-0", "gw-1"), ports, strict=True)
    }
    replicas = [GatewayReplica(name=name, url=gw.url) for name, gw in gateways.items()]
    try:
        await asyncio.gather(*(gw.start() for gw in gateways.values()))
        await _refused_at_the_wrong_replica(broker, gateways)
        async with _controller(broker, tmp_path, replicas):
            await _submit(broker.bootstrap, tmp_path)
            early = {f.episode_id for f in await _finals(broker.bootstrap, GROUPS * SIZE // 2)}
            gateways["gw-0"].kill()  # mid-run: half the episodes finished, others in flight
            await gateways["gw-0"].start()
            finals = await _finals(broker.bootstrap, GROUPS * SIZE)
        calls, closes = await _calls(broker)
    finally:
        for gw in gateways.values():
            gw.stop()
        standin.terminate()
        standin.join(10)

    by_owner = Counter(owner(f.episode_id, replicas).name for f in finals)
    assert set(by_owner) == {"gw-0", "gw-1"}, by_owner  # spread over both
    later = [f for f in finals if f.episode_id not in early]
    assert any(owner(f.episode_id, replicas).name == "gw-0" for f in later)  # served again
    for final in finals:
        key = (final.episode_id, final.attempt)
        home = owner(final.episode_id, replicas).name
        assert [c.gateway for c in closes[key]] == [home], key  # closed once, at its owner
        seqs = calls.get(key, {})
        assert sorted(seqs) == list(range(len(seqs))), key  # gapless, each seq once
        assert {c.gateway for c in seqs.values()} <= {home}, key
        assert closes[key][0].call_count == len(seqs), key
        if final.status == pb.EPISODE_STATUS_SUCCEEDED:  # the harness says how many it got
            assert json.loads(final.result_json)["calls"] == len(seqs), key
    for key, seqs in calls.items():  # attempts that were retried too: nothing numbered twice
        assert sorted(seqs) == list(range(len(seqs))), key
    assert sum(f.status == pb.EPISODE_STATUS_SUCCEEDED for f in finals) >= GROUPS * SIZE // 2


async def _refused_at_the_wrong_replica(
    broker: EmbeddedBroker, gateways: dict[str, Gateway]
) -> None:
    claims = EpisodeClaims("ep-misrouted", 1, "g-misrouted", "train", time.time() + 600,
                           gateway="gw-1")  # fmt: skip
    token = mint(claims, SECRET.encode())
    client = openai.AsyncOpenAI(base_url=f"{gateways['gw-0'].url}/v1", api_key=token, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 1 plus 2?"}], max_tokens=8
        )
    assert refused.value.status_code == 421
    assert "belongs to gateway replica 'gw-1'" in refused.value.message
    async with httpx.AsyncClient(timeout=30) as http:  # nor closed there
        closed = await http.post(
            f"{gateways['gw-0'].url}/admin/episodes/ep-misrouted/close",
            headers={"authorization": f"Bearer {ADMIN}"},
            json={"attempt": 1, "group_id": "g-misrouted", "gateway": "gw-1"},
        )
        assert closed.status_code == 421, closed.text
        garbled = await http.post(
            f"{gateways['gw-0'].url}/admin/episodes/ep-misrouted/close",
            headers={"authorization": f"Bearer {ADMIN}"},
            json={"attempt": 1, "group_id": "g-misrouted", "gateway": 5},
        )
        assert garbled.status_code == 400 and "gateway:" in garbled.text, garbled.text
    calls, closes = await _calls(broker)
    assert not any(key[0] == "ep-misrouted" for key in [*calls, *closes])


Key = tuple[str, int]


async def _calls(
    broker: EmbeddedBroker,
) -> tuple[dict[Key, dict[int, pb.ModelCall]], dict[Key, list[pb.EpisodeClosed]]]:
    """Every attempt's ModelCalls by seq (a seq captured twice with other tokens fails) and
    its EpisodeCloseds (distinct, a redelivered copy once)."""
    calls: dict[Key, dict[int, pb.ModelCall]] = {}
    closes: dict[Key, list[pb.EpisodeClosed]] = {}
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    async for kind, event, _ in read_to_end(kafka, events.CALLS, client_id="replicas-test"):
        key = (event.episode_id, event.attempt)  # type: ignore[attr-defined]
        if kind == "model_call":
            held = calls.setdefault(key, {}).setdefault(event.seq, event)  # type: ignore[attr-defined]
            assert held.completion_token_ids == event.completion_token_ids, key  # type: ignore[attr-defined]
        elif kind == "episode_closed" and event not in closes.setdefault(key, []):
            closes[key].append(event)  # type: ignore[arg-type]
    return calls, closes


class _Running:
    def __init__(self, service: ControllerService, task: asyncio.Task[None]) -> None:
        self.service, self.task = service, task

    async def __aenter__(self) -> ControllerService:
        await asyncio.wait_for(self.service.ready.wait(), 60)
        return self.service

    async def __aexit__(self, *exc: object) -> None:
        await self.service.stop()
        await self.task


def _controller(broker: EmbeddedBroker, tmp_path: Path, replicas: list[GatewayReplica]) -> _Running:
    section = ControllerSection(
        harness=HarnessSpec(command=[sys.executable, str(WORKERS / "calc_harness.py")],
                            timeout_s=60),
        gateways=replicas,
        token_secret=SecretStr(SECRET),
        admin_token=SecretStr(ADMIN),
        workdir=tmp_path / "episodes",
        state_dir=tmp_path / "controller",
        max_in_flight=8,
        max_attempts=3,
        kill_grace_s=0.5,
        close_timeout_s=60,
        inherit_env=["PATH", "HOME", "PYTHONPATH", "VIRTUAL_ENV"],
        port=0,
    )  # fmt: skip
    config = ControllerConfig(
        instance="ctl-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "ctl-spill"),
        controller=section,
    )
    service = ControllerService(
        config, Runtime("controller", "ctl-0", CollectorRegistry(), TracerProvider())
    )
    return _Running(service, asyncio.create_task(service.run()))


async def _submit(bootstrap: str, tmp_path: Path) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=bootstrap),
        ProducerSettings(spill_dir=tmp_path / "submit"),
        name="submit/t",
    )
    await producer.start()
    for i in range(GROUPS):
        question = f"What is {12 + i} plus {30 + i}?"
        await producer.publish(
            pb.TaskSubmitted(
                task_id=f"t-{i}",
                group_id=f"g-{i}",
                split=pb.MODE_TRAIN,
                input_json=json.dumps({"question": question}),
                group_size=SIZE,
                metadata_json="{}",
            )
        )
    await producer.stop()


async def _finals(bootstrap: str, count: int, timeout: float = 180) -> list[pb.EpisodeFinished]:
    finals: dict[str, pb.EpisodeFinished] = {}
    kafka = KafkaSettings(bootstrap_servers=bootstrap)

    async def enough() -> bool:
        async for kind, event, _ in read_to_end(kafka, events.EPISODES, client_id="finals"):
            if kind == "episode_finished" and event.final:  # type: ignore[attr-defined]
                finals[event.episode_id] = event  # type: ignore[attr-defined,assignment]
        return len(finals) >= count

    await eventually(enough, timeout=timeout, interval=0.5)
    return list(finals.values())


async def test_a_replica_recovers_only_its_own_episodes(
    broker: EmbeddedBroker, kafka: KafkaSettings, producer_settings: ProducerSettings
) -> None:
    from harnessrl.services.gateway.open_episodes import Restored
    from harnessrl.services.gateway.recovery import recover

    producer = Producer(kafka, producer_settings, name="gateway/gw-0")
    await producer.start()
    try:
        for replica, episode, seqs in (("gw-0", "mine", 3), ("gw-1", "theirs", 2)):
            for seq in range(seqs):
                call = pb.ModelCall(episode_id=episode, attempt=1, group_id=f"g-{episode}",
                                    seq=seq, gateway=replica)  # fmt: skip
                await producer.publish(call)
            closed = pb.EpisodeClosed(episode_id=episode, attempt=1, group_id=f"g-{episode}",
                                      call_count=seqs, gateway=replica)  # fmt: skip
            await producer.publish(closed)
        state = await recover(kafka, producer, window_s=600, client_id="t", replica="gw-0")
    finally:
        await producer.stop()
    assert state == {("mine", 1): Restored(3, 3)}
