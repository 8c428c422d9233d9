"""Production sessions at the gateway: a real app's SDK with one base URL and its app key,
on the real broker, engine and gateway (services/gateway/production_sessions.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from harnessrl import events
from harnessrl.broker import EmbeddedBroker, free_ports
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.production import (
    AppSpec,
    ProductionSection,
    explored,
    key_digest,
    session_traceparent,
)
from harnessrl.runtime import Runtime
from harnessrl.services.gateway.config import GatewayConfig, GatewayPeer, GatewaySection
from harnessrl.services.gateway.service import GatewayService
from harnessrl.services.gateway.session_owners import SessionOwners
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, events_on, eventually
from tests.integration.gateway_stack import ADMIN, SECRET, Stack, running_stack
from tests.model_helpers import TINY

KEY = "hrl-app-key-support-0123456789abcdef"
OTHER_KEY = "hrl-app-key-ide-0123456789abcdef0123"
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]


def _production(exploration: float = 1.0, idle_s: float = 600.0) -> ProductionSection:
    return ProductionSection(
        apps=[
            AppSpec(name="support", key_sha256=key_digest(KEY), exploration=exploration),
            AppSpec(name="ide", key_sha256=key_digest(OTHER_KEY), exploration=0.0),
        ],
        idle_s=idle_s,
    )


@pytest_asyncio.fixture
async def stack(broker: EmbeddedBroker, tmp_path: Path) -> AsyncIterator[Stack]:
    async with running_stack(broker, tmp_path, TINY, production=_production()) as running:
        yield running


async def _episodes(stack: Stack) -> list[Any]:
    return [e for _, e in await events_on(stack.broker.bootstrap, events.EPISODES)]


async def test_an_openai_app_names_its_session_in_a_header_and_every_call_is_captured(
    stack: Stack,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{stack.gateway_url}/v1",
        api_key=KEY,
        max_retries=0,
        default_headers={"x-harnessrl-session": "ticket-17", "x-harnessrl-kind": "refund"},
    )
    first = await client.chat.completions.create(
        model="support-bot", messages=QUESTION, max_tokens=8
    )
    second = await client.chat.completions.create(
        model="support-bot", messages=QUESTION, max_tokens=8, stream=True
    )
    streamed_id = ""
    async for chunk in second:
        streamed_id = streamed_id or chunk.id
    calls = await stack.calls(at_least=2)
    assert [c.seq for c in calls] == [0, 1]
    assert {c.episode_id for c in calls} == {"s.support.ticket-17"}
    assert {c.group_id for c in calls} == {"s.support.ticket-17"}
    assert [c.response_id for c in calls] == [first.id, streamed_id]
    assert all(c.mode == pb.MODE_TRAIN for c in calls)  # exploration 1: every session trains
    assert all(
        c.trace_id == session_traceparent("support", "ticket-17").split("-")[1] for c in calls
    )
    started = [e for e in await _episodes(stack) if isinstance(e, pb.EpisodeStarted)]
    assert len(started) == 1
    assert started[0].session == pb.SessionInfo(
        app="support", session_id="ticket-17", kind="refund", explored=True
    )
    assert started[0].runner == "session" and started[0].group_size == 1


async def test_the_session_and_kind_may_ride_in_the_base_url_for_the_anthropic_sdk(
    stack: Stack,
) -> None:
    client = anthropic.AsyncAnthropic(
        base_url=f"{stack.gateway_url}/k/bug-report/s/chat-9", api_key=KEY, max_retries=0
    )
    message = await client.messages.create(
        model="claude-x", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    calls = await stack.calls(at_least=1)
    assert calls[0].episode_id == "s.support.chat-9"
    assert calls[0].response_id == message.id and message.id.startswith("msg_")
    started = [e for e in await _episodes(stack) if isinstance(e, pb.EpisodeStarted)]
    assert started[0].session.kind == "bug-report"


async def test_ending_a_session_closes_it_after_its_calls_and_a_later_call_is_refused(
    stack: Stack,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{stack.gateway_url}/s/order-5/v1", api_key=KEY, max_retries=0
    )
    await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
    await client.completions.create(model="m", prompt="17 + 25 =", max_tokens=4)
    async with httpx.AsyncClient() as http:
        ended = await http.post(
            f"{stack.gateway_url}/sessions/order-5/end", headers={"authorization": f"Bearer {KEY}"}
        )
        again = await http.post(
            f"{stack.gateway_url}/sessions/order-5/end", headers={"authorization": f"Bearer {KEY}"}
        )
        # Another app's key reaches only its own sessions: app "ide" has no order-5.
        foreign = await http.post(
            f"{stack.gateway_url}/sessions/order-5/end",
            headers={"authorization": f"Bearer {OTHER_KEY}"},
        )
    assert ended.status_code == 200, ended.text
    assert ended.json() == {"session": "order-5", "ended_by": "end", "call_count": 2}
    assert again.json() == ended.json()
    assert foreign.status_code == 404
    closed = await stack.closed()
    assert [(c.episode_id, c.call_count, c.reason) for c in closed] == [
        ("s.support.order-5", 2, "session_end")
    ]
    finished = [e for e in await _episodes(stack) if isinstance(e, pb.EpisodeFinished)]
    assert len(finished) == 1 and finished[0].session.ended_by == "end"
    assert finished[0].final and finished[0].group_id == "s.support.order-5"
    patient = client.with_options(max_retries=5)  # the SDK does not retry it: told not to
    with pytest.raises(openai.ConflictError, match="has ended") as refused:
        await patient.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert len(await stack.calls()) == 2


async def test_a_call_carrying_the_end_header_ends_its_session_after_it(stack: Stack) -> None:
    async with httpx.AsyncClient() as http:
        answer = await http.post(
            f"{stack.gateway_url}/v1/chat/completions",
            headers={
                "authorization": f"Bearer {KEY}",
                "x-harnessrl-session": "one-shot",
                "x-harnessrl-session-end": "true",
            },
            json={"model": "m", "messages": QUESTION, "max_tokens": 4},
        )
    assert answer.status_code == 200

    async def ended() -> bool:
        return any(c.episode_id == "s.support.one-shot" for c in await stack.closed())

    await eventually(ended, timeout=20)
    assert [c.call_count for c in await stack.closed()] == [1]


async def test_an_idle_session_ends_on_its_own(broker: EmbeddedBroker, tmp_path: Path) -> None:
    production = _production(idle_s=0.4)
    async with running_stack(broker, tmp_path, TINY, production=production) as stack:
        client = openai.AsyncOpenAI(
            base_url=f"{stack.gateway_url}/s/quiet/v1", api_key=KEY, max_retries=0
        )
        await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)

        async def finished() -> list[pb.EpisodeFinished]:
            return [e for e in await _episodes(stack) if isinstance(e, pb.EpisodeFinished)]

        await eventually(finished, timeout=20)
        assert (await finished())[0].session.ended_by == "idle"
        assert [(c.call_count, c.reason) for c in await stack.closed()] == [(1, "session_idle")]


async def test_sessions_outside_the_exploration_share_are_served_as_asked_and_marked_val(
    stack: Stack,
) -> None:
    # App "ide" explores nothing: its sessions run with the app's own sampling, never train.
    client = openai.AsyncOpenAI(
        base_url=f"{stack.gateway_url}/s/tab-3/v1", api_key=OTHER_KEY, max_retries=0
    )
    await client.chat.completions.create(
        model="m", messages=QUESTION, max_tokens=4, temperature=0.3
    )
    calls = await stack.calls(at_least=1)
    assert calls[0].mode == pb.MODE_VAL and calls[0].episode_id == "s.ide.tab-3"
    assert calls[0].temperature == pytest.approx(0.3)


def test_the_exploration_share_is_stable_and_near_its_setting() -> None:
    chosen = [explored("support", f"session-{i}", 0.25) for i in range(4000)]
    assert chosen == [explored("support", f"session-{i}", 0.25) for i in range(4000)]
    assert 0.22 < sum(chosen) / len(chosen) < 0.28
    assert not any(explored("support", f"session-{i}", 0.0) for i in range(100))
    assert all(explored("support", f"session-{i}", 1.0) for i in range(100))


@pytest.mark.parametrize(
    ("headers", "path", "status", "field"),
    [
        ({}, "/s/fine/v1/chat/completions", 401, "api key"),
        ({"authorization": "Bearer not-an-app-key"}, "/s/fine/v1/chat/completions", 401, "api key"),
        ({"authorization": f"Bearer {KEY}"}, "/v1/chat/completions", 400, "x-harnessrl-session"),
        (
            {"authorization": f"Bearer {KEY}", "x-harnessrl-session": "x" * 129},
            "/v1/chat/completions",
            400,
            "x-harnessrl-session",
        ),
        (
            {"authorization": f"Bearer {KEY}", "x-harnessrl-session": "a/b"},
            "/v1/chat/completions",
            400,
            "x-harnessrl-session",
        ),
        ({"authorization": f"Bearer {KEY}"}, "/s/-dash-first/v1/chat/completions", 400, "path"),
        ({"authorization": f"Bearer {KEY}"}, "/k/bad kind/s/ok/v1/chat/completions", 400, "kind"),
    ],
)
async def test_bad_session_requests_are_refused_naming_the_field_and_capture_nothing(
    stack: Stack, headers: dict[str, str], path: str, status: int, field: str
) -> None:
    async with httpx.AsyncClient() as http:
        answer = await http.post(
            f"{stack.gateway_url}{path}",
            headers=headers,
            json={"model": "m", "messages": QUESTION, "max_tokens": 4},
        )
    assert answer.status_code == status, answer.text
    assert field in answer.json()["error"]["message"]
    assert await stack.calls() == []
    assert await _episodes(stack) == []


async def test_a_session_reaching_a_replica_that_does_not_own_it_is_forwarded_to_its_owner(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    port_a, port_b = free_ports(2)
    peers = [
        GatewayPeer(name="gw-a", url=f"http://127.0.0.1:{port_a}"),
        GatewayPeer(name="gw-b", url=f"http://127.0.0.1:{port_b}"),
    ]
    owners = SessionOwners(peers, "gw-a", timeout_s=5)
    theirs = next(f"s-{i}" for i in range(100) if owners.owner(f"s.support.s-{i}") == "gw-b")
    ours = next(f"s-{i}" for i in range(100) if owners.owner(f"s.support.s-{i}") == "gw-a")
    await owners.aclose()
    production = _production()
    async with running_stack(
        broker, tmp_path, TINY, production=production, replica="gw-a", port=port_a, peers=peers
    ) as a:
        config = GatewayConfig(
            instance="gw-b",
            kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
            consumer=ConsumerSettings(**FAST_GROUP),
            producer=ProducerSettings(spill_dir=tmp_path / "gw-b-spill"),
            gateway=GatewaySection(
                port=port_b,
                token_secret=SecretStr(SECRET),
                admin_token=SecretStr(ADMIN),
                engines=[a.engine_url],
                replica="gw-b",
                peers=peers,
            ),
            production=production,
        )
        b = GatewayService(
            config, Runtime("gateway", "gw-b", CollectorRegistry(), TracerProvider())
        )
        running = asyncio.create_task(b.run())
        try:
            await asyncio.wait_for(b.ready.wait(), 60)
            # The app knows one address, gw-a's; both sessions are answered through it.
            for session in (theirs, ours):
                client = openai.AsyncOpenAI(
                    base_url=f"{a.gateway_url}/s/{session}/v1", api_key=KEY, max_retries=0
                )
                await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
                stream = await client.chat.completions.create(
                    model="m", messages=QUESTION, max_tokens=4, stream=True
                )
                assert [chunk async for chunk in stream]
            async with httpx.AsyncClient() as http:
                ended = await http.post(
                    f"{a.gateway_url}/sessions/{theirs}/end",
                    headers={"authorization": f"Bearer {KEY}"},
                )
                # A request another replica forwarded is never forwarded again.
                looped = await http.post(
                    f"{a.gateway_url}/s/{theirs}/v1/chat/completions",
                    headers={"authorization": f"Bearer {KEY}", "x-harnessrl-forwarded-by": "gw-b"},
                    json={"model": "m", "messages": QUESTION, "max_tokens": 4},
                )
            assert ended.status_code == 200 and ended.json()["call_count"] == 2
            assert looped.status_code == 503 and "gateway.peers" in looped.text
            calls = await a.calls(at_least=4)
            owner_of = {c.episode_id: c.gateway for c in calls}
            assert owner_of == {f"s.support.{theirs}": "gw-b", f"s.support.{ours}": "gw-a"}
            assert sorted((c.episode_id, c.seq) for c in calls) == sorted(
                (f"s.support.{s}", q) for s in (theirs, ours) for q in (0, 1)
            )
        finally:
            await b.stop()
            await running


async def test_a_deleted_session_ends_its_stored_responses_and_spilled_records_go(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    marker = "zebra-marker-4412"
    async with running_stack(
        broker, tmp_path, TINY, production=_production(), capture_bodies=True
    ) as stack:
        client = openai.AsyncOpenAI(
            base_url=f"{stack.gateway_url}/s/forget-me/v1", api_key=KEY, max_retries=0
        )
        response = await client.responses.create(
            model="m", input=f"My name is {marker}.", max_output_tokens=4
        )
        assert (await client.responses.retrieve(response.id)).id == response.id
        calls = await stack.calls(at_least=1)
        assert marker.encode() in calls[0].request_body
        spill = tmp_path / "gw-spill"
        assert any(marker.encode() in p.read_bytes() for p in spill.rglob("*.seg"))
        producer = Producer(
            KafkaSettings(bootstrap_servers=broker.bootstrap),
            ProducerSettings(spill_dir=tmp_path / "reward-spill"),
            name="reward/test",
        )
        await producer.start()
        await producer.publish(
            pb.SessionDeleted(
                group_id="s.support.forget-me",
                session=pb.SessionInfo(app="support", session_id="forget-me"),
            )
        )
        await producer.stop()

        async def finished() -> bool:
            return any(
                isinstance(e, pb.EpisodeFinished) and e.session.ended_by == "deleted"
                for e in await _episodes(stack)
            )

        await eventually(finished, timeout=20)
        with pytest.raises(openai.ConflictError, match="deleted"):
            await client.responses.create(model="m", input="again", max_output_tokens=4)
        with pytest.raises(openai.ConflictError, match="deleted"):
            await client.responses.retrieve(response.id)
        assert len(stack.gateway.responses) == 0  # its stored responses are gone

        def spilled() -> bool:
            return not any(marker.encode() in p.read_bytes() for p in spill.rglob("*.seg"))

        await eventually(spilled, timeout=20)
