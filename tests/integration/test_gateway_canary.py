"""A canary rollout at the gateway: production sessions on the real broker and gateway, the
real openai SDK as the app, two engines serving versions 1 and 2. Each session is assigned
an arm at its first call and every call of it is served by its version, under the model
name its engine gave that version, also across a gateway restart after which a fresh
assignment would differ (the candidate was promoted meanwhile).

The engines are the repo's calculator stand-in (bench/calculator_standin.py) behind a small
server that serves versions by model name as vLLM serves LoRA adapters, and answers the
version it served in x-policy-version, as the project's engine does: a call asked under the
wrong name would be stamped with the wrong version, or refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from harnessrl import events
from harnessrl.bench import calculator_standin
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.episode_token import EpisodeClaims, mint
from harnessrl.http import HttpServer, Request, Response
from harnessrl.production import AppSpec, ProductionSection, key_digest
from harnessrl.rollout import CanarySection, RolloutState
from harnessrl.runtime import Runtime
from harnessrl.services.gateway.config import GatewayConfig, GatewaySection
from harnessrl.services.gateway.service import GatewayService
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, events_on, eventually

pytestmark = pytest.mark.integration

KEY = "hrl-app-key-canary-0123456789abcdef"
SECRET = "canary-test-secret-0123456789abcdef"
ADMIN = "canary-test-admin-0123456789abcdef"
QUESTION = [{"role": "user", "content": "What is 12 plus 30?"}]
SHARE = 0.5
JSON = [("content-type", "application/json")]


class VersionedEngine:
    """Serves the versions in `models` (model name -> version), answering which one served
    in x-policy-version; `asked` records (model, version) of each completion."""

    def __init__(self, models: Mapping[str, int]) -> None:
        self.models = dict(models)
        self.asked: list[tuple[str, int]] = []
        self._server = HttpServer(self._handle, host="127.0.0.1", port=0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(grace_s=1.0)

    async def _handle(self, request: Request) -> Response:
        if request.path == "/v1/models":
            data = [{"id": name, "object": "model"} for name in self.models]
            return Response(200, JSON, orjson.dumps({"object": "list", "data": data}))
        body = orjson.loads(request.body)
        version = self.models.get(body.get("model"))
        if version is None:
            error = {"error": {"message": f"model {body.get('model')!r} is not served"}}
            return Response(404, JSON, orjson.dumps(error))
        self.asked.append((body["model"], version))
        answer = calculator_standin.answer(body)
        served = ("x-policy-version", str(version))
        if not body.get("stream"):
            return Response(200, [*JSON, served], orjson.dumps(answer))
        # The whole answer as one chunk, then [DONE].
        answer["object"] = "chat.completion.chunk"
        for choice in answer["choices"]:
            choice["delta"] = choice.pop("message")
        events = b"data: " + orjson.dumps(answer) + b"\n\ndata: [DONE]\n\n"
        return Response(200, [("content-type", "text/event-stream"), served], events)


async def _publish(broker: EmbeddedBroker, tmp_path: Path, *published: object) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "test-spill"),
        name="canary-test",
    )
    await producer.start()
    for event in published:
        await producer.publish(event)  # type: ignore[arg-type]  # protobuf events
    await producer.stop()


def _served(engine: str, *versions: tuple[int, str]) -> pb.PolicyLoaded:
    serving = [pb.ServedVersion(version=v, model=m) for v, m in versions]
    return pb.PolicyLoaded(
        version=max(v for v, _ in versions), engine=engine, ok=True, serving=serving
    )


def _decision(decision_id: str, action: int, version: int, stable: int) -> pb.RolloutDecision:
    return pb.RolloutDecision(
        decision_id=decision_id,
        action=action,  # type: ignore[arg-type]  # a RolloutAction
        version=version,
        stable=stable,
        share=SHARE if action == pb.ROLLOUT_ACTION_START else 0.0,
        actor="canary",
    )


class Gateway:
    """The gateway service in this process, started again on demand with the same config."""

    def __init__(self, broker: EmbeddedBroker, tmp_path: Path, engines: list[str]) -> None:
        production = ProductionSection(
            apps=[AppSpec(name="support", key_sha256=key_digest(KEY), exploration=1.0)],
            canary=CanarySection(enabled=True, share=SHARE),
        )
        self.config = GatewayConfig(
            instance="gw-canary",
            kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
            consumer=ConsumerSettings(**FAST_GROUP),
            producer=ProducerSettings(spill_dir=tmp_path / "gw-spill"),
            gateway=GatewaySection(
                port=0,
                token_secret=SecretStr(SECRET),
                admin_token=SecretStr(ADMIN),
                engines=engines,
                engine_model=calculator_standin.MODEL,
                pause_retry_after_s=1,
            ),
            production=production,
        )
        self.registry = CollectorRegistry()
        self.service: GatewayService | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> GatewayService:
        self.registry = CollectorRegistry()
        service = GatewayService(
            self.config, Runtime("gateway", "gw-canary", self.registry, TracerProvider())
        )
        self._task = asyncio.create_task(service.run())
        await asyncio.wait_for(service.ready.wait(), 60)
        self.service = service
        return service

    async def stop(self) -> None:
        if self.service is not None and self._task is not None:
            await self.service.stop()
            await self._task
            self.service = self._task = None

    def client(self, session: str) -> openai.AsyncOpenAI:
        assert self.service is not None
        return openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{self.service.port}/s/{session}/v1",
            api_key=KEY,
            max_retries=0,
        )


@pytest_asyncio.fixture
async def engines() -> AsyncIterator[tuple[VersionedEngine, VersionedEngine]]:
    """An engine serving versions 1 and 2 as adapters, and one serving 1 (full weights)."""
    lora = VersionedEngine({"policy-v1": 1, "policy-v2": 2})
    full = VersionedEngine({calculator_standin.MODEL: 1})
    for engine in (lora, full):
        await engine.start()
    try:
        yield lora, full
    finally:
        for engine in (lora, full):
            await engine.stop()


def _sessions_by_arm() -> dict[str, list[str]]:
    """Two session ids of each arm, as any gateway assigns them (the candidate served)."""
    rollout = RolloutState()
    rollout.announced(pb.PolicyVersion(version=1))
    rollout.announced(pb.PolicyVersion(version=2, base=1))
    assert rollout.decided(_decision("start-2", pb.ROLLOUT_ACTION_START, 2, 1)) is None
    arms: dict[str, list[str]] = {"stable": [], "candidate": []}
    for n in range(100):
        chosen = rollout.assign(f"s.support.chat-{n}", lambda v: True)
        assert chosen is not None
        if len(arms[chosen[0]]) < 2:
            arms[chosen[0]].append(f"chat-{n}")
    return arms


async def _served_versions(broker: EmbeddedBroker, at_least: int) -> dict[str, set[int]]:
    """Group id -> the versions its captured calls were served by (`at_least` calls)."""
    versions: dict[str, set[int]] = {}

    async def captured() -> bool:
        versions.clear()
        count = 0
        for _, call in await events_on(broker.bootstrap, events.CALLS):
            if isinstance(call, pb.ModelCall):
                versions.setdefault(call.group_id, set()).add(call.policy_version)
                count += 1
        return count >= at_least

    await eventually(captured)
    return versions


async def _ask(gateway: Gateway, session: str, *, stream: bool = False) -> None:
    client = gateway.client(session)
    if not stream:
        await client.chat.completions.create(model="support-bot", messages=QUESTION, max_tokens=16)
        return
    chunks = await client.chat.completions.create(
        model="support-bot", messages=QUESTION, max_tokens=16, stream=True
    )
    assert any([c.choices[0].delta.tool_calls async for c in chunks])


async def test_sessions_keep_their_arm_and_version_across_a_gateway_restart(
    broker: EmbeddedBroker, engines: tuple[VersionedEngine, VersionedEngine], tmp_path: Path
) -> None:
    lora, full = engines
    await _publish(
        broker,
        tmp_path,
        pb.PolicyVersion(version=1),
        pb.PolicyVersion(version=2, base=1),
        _decision("start-2", pb.ROLLOUT_ACTION_START, 2, 1),
        _served(lora.url, (1, "policy-v1"), (2, "policy-v2")),
        _served(full.url, (1, "")),
    )
    arms = _sessions_by_arm()
    gateway = Gateway(broker, tmp_path, [lora.url, full.url])
    service = await gateway.start()
    await eventually(lambda: len(service.versions.serving()) == 2)
    for session in arms["stable"] + arms["candidate"]:
        await _ask(gateway, session)
    candidate = gateway.registry.get_sample_value(
        "harnessrl_gateway_sessions_assigned_total", {"arm": "candidate"}
    )
    assert candidate == 2
    # Every candidate call went to the engine serving version 2, under its name there.
    assert lora.asked.count(("policy-v2", 2)) == 2
    assert len(full.asked) + lora.asked.count(("policy-v1", 1)) == 2
    served = await _served_versions(broker, 4)
    for arm, version in (("stable", 1), ("candidate", 2)):
        assert all(served[f"s.support.{s}"] == {version} for s in arms[arm])

    # The candidate is promoted while the gateway is down: a new assignment would now
    # give version 2 to every session, but an open session keeps its own.
    await gateway.stop()
    await _publish(broker, tmp_path, _decision("promote-2", pb.ROLLOUT_ACTION_PROMOTE, 2, 1))
    service = await gateway.start()
    await eventually(lambda: service.rollout.state.stable == 2)
    for session in arms["stable"] + arms["candidate"]:
        await _ask(gateway, session, stream=True)
    await _ask(gateway, "after-promotion")

    # Version 2 served nowhere for a moment (its engine reloading): a 503 to retry,
    # never another version.
    await _publish(broker, tmp_path, _served(lora.url, (1, "policy-v1")))
    await eventually(lambda: service.versions.serving()[lora.url] == {1: "policy-v1"})
    with pytest.raises(openai.APIStatusError) as refused:
        await _ask(gateway, arms["candidate"][0])
    assert refused.value.status_code == 503
    assert refused.value.response.headers["retry-after"] == "1"
    await _publish(broker, tmp_path, _served(lora.url, (1, "policy-v1"), (2, "policy-v2")))
    await eventually(lambda: 2 in service.versions.serving()[lora.url])
    await _ask(gateway, arms["candidate"][0])

    async with httpx.AsyncClient() as http:
        status = (
            await http.get(
                f"http://127.0.0.1:{service.port}/admin/status",
                headers={"authorization": f"Bearer {ADMIN}"},
            )
        ).json()
        assert status["rollout"]["stable"] == 2 and status["rollout"]["candidate"] is None
        assert status["engine_serving"][lora.url] == {"1": "policy-v1", "2": "policy-v2"}
        for session in [*arms["stable"], *arms["candidate"], "after-promotion"]:
            ended = await http.post(
                f"http://127.0.0.1:{service.port}/sessions/{session}/end",
                headers={"authorization": f"Bearer {KEY}"},
            )
            assert ended.status_code == 200, ended.text
    await gateway.stop()

    await _assert_sticky(broker, arms)


async def _assert_sticky(broker: EmbeddedBroker, arms: dict[str, list[str]]) -> None:
    """Each session's EpisodeStarted and EpisodeFinished name its arm and version, every
    captured call of it was served by that version, and its guard stats add up."""
    episodes = [e for _, e in await events_on(broker.bootstrap, events.EPISODES)]
    started = {e.group_id: e.session for e in episodes if isinstance(e, pb.EpisodeStarted)}
    finished = {e.group_id: e.session for e in episodes if isinstance(e, pb.EpisodeFinished)}
    versions = await _served_versions(broker, 10)
    for arm, version in (("stable", 1), ("candidate", 2)):
        for session in arms[arm]:
            group = f"s.support.{session}"
            info = started[group]
            assert (info.arm, info.policy_version, info.canary) == (arm, version, 2)
            assert versions[group] == {version}, session  # never switched
            assert finished[group].arm == arm
    after = started["s.support.after-promotion"]
    assert (after.arm, after.policy_version, after.canary) == ("stable", 2, 0)
    assert versions["s.support.after-promotion"] == {2}
    # Guard stats: the calls captured before the restart are counted again from
    # hrl.calls; the refused call is one error; the session ended answered.
    stats = finished[f"s.support.{arms['candidate'][0]}"].stats
    assert (stats.calls, stats.errors, stats.answered) == (4, 1, True)
    assert stats.latency_ms_max > 0 and stats.latency_ms_sum >= stats.latency_ms_max
    other = finished[f"s.support.{arms['stable'][0]}"].stats
    assert (other.calls, other.errors, other.answered) == (2, 0, True)


async def test_a_controller_episode_is_not_served_a_rolled_back_version_an_engine_keeps(
    broker: EmbeddedBroker, engines: tuple[VersionedEngine, VersionedEngine], tmp_path: Path
) -> None:
    """An engine keeps rolled-back version 2 for the sessions it serves; a controller's
    episode is asked for the newest version not rolled back (1) under that engine's name."""
    lora, _ = engines
    await _publish(
        broker,
        tmp_path,
        pb.PolicyVersion(version=1),
        pb.PolicyVersion(version=2, base=1),
        _decision("start-2", pb.ROLLOUT_ACTION_START, 2, 1),
        _decision("rollback-2", pb.ROLLOUT_ACTION_ROLLBACK, 2, 1),
        _served(lora.url, (1, "policy-v1"), (2, "policy-v2")),
    )
    gateway = Gateway(broker, tmp_path, [lora.url])
    service = await gateway.start()
    try:
        await eventually(lambda: service.rollout.state.rolled_back == {2})
        await eventually(lambda: lora.url in service.versions.serving())
        claims = EpisodeClaims("ep-1", 1, "g-1", "train", time.time() + 300)
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{service.port}/e/{mint(claims, SECRET.encode())}/v1",
            api_key="k",
            max_retries=0,
        )
        await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=16)
    finally:
        await gateway.stop()
    assert lora.asked == [("policy-v1", 1)]
    assert (await _served_versions(broker, 1)) == {"g-1": {1}}
