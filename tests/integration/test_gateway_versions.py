"""The policy version the gateway stamps on calls to an engine that sends no x-policy-version
header (vLLM): the engine's last PolicyLoaded(ok=true) on hrl.policy as of when the call was
sent, read back from the topic at start and followed live. The engine is the project's own,
behind a header-dropping proxy: the proxy makes it answer as vLLM does in this respect."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest
import pytest_asyncio

from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.http import HttpServer, Request, Response
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import eventually
from tests.integration.gateway_stack import ADMIN, Stack, running_stack
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration

_HOP = {"connection", "content-length", "transfer-encoding", "keep-alive"}
REQUEST = {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


class HeaderlessProxy:
    """Forwards to `upstream` (the engine), dropping x-policy-version from every answer
    unless `strip` is off; `hold` (when set) keeps each answer until it is released.
    `asked` records the model each completion request names; with `serve_as` set it is
    forwarded under that name instead (as vLLM serves an adapter on the engine's base)."""

    def __init__(self) -> None:
        self.upstream = ""
        self.strip = True
        self.hold: asyncio.Event | None = None
        self.holding = asyncio.Event()
        self.asked: list[str] = []
        self.serve_as: str | None = None
        self._server = HttpServer(self._forward, host="127.0.0.1", port=0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(grace_s=1.0)

    async def _forward(self, request: Request) -> Response:
        body = request.body
        if request.path.endswith("completions"):
            data = orjson.loads(body)
            self.asked.append(data["model"])
            if self.serve_as is not None:
                body = orjson.dumps({**data, "model": self.serve_as})
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.request(
                request.method,
                f"{self.upstream}{request.path}",
                content=body,
                headers={"content-type": request.headers.get("content-type", "")},
            )
        if self.hold is not None:
            self.holding.set()
            await self.hold.wait()
        dropped = _HOP | ({"x-policy-version"} if self.strip else set())
        headers = [(k, v) for k, v in answer.headers.items() if k.lower() not in dropped]
        return Response(answer.status_code, headers, answer.content)


@pytest_asyncio.fixture
async def proxy() -> AsyncIterator[HeaderlessProxy]:
    server = HeaderlessProxy()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _publish(broker: EmbeddedBroker, tmp_path: Path, *loaded: pb.PolicyLoaded) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "sync-spill"),
        name="vllm-sync/test",
    )
    await producer.start()
    for event in loaded:
        await producer.publish(event)
    await producer.stop()


async def _knows(stack: Stack, expected: dict[str, int]) -> bool:
    """Whether the gateway's admin status shows exactly these engine versions."""
    async with httpx.AsyncClient() as http:
        status = await http.get(
            f"{stack.gateway_url}/admin/status", headers={"authorization": f"Bearer {ADMIN}"}
        )
    return bool(status.json()["engine_versions"] == expected)


async def test_calls_to_an_engine_without_the_header_carry_its_loaded_version(
    broker: EmbeddedBroker, proxy: HeaderlessProxy, tmp_path: Path
) -> None:
    # Before the gateway starts: what it must read back from hrl.policy.
    await _publish(
        broker,
        tmp_path,
        pb.PolicyLoaded(version=3, engine=proxy.url, ok=True),
        pb.PolicyLoaded(version=5, engine=proxy.url, ok=False, error="refused"),
        pb.PolicyLoaded(version=9, engine="http://other:8100", ok=True),
    )
    async with running_stack(
        broker, tmp_path, TINY, engines=[proxy.url], engine_model="tiny-model"
    ) as stack:
        proxy.upstream = stack.engine_url
        await eventually(lambda: _knows(stack, {proxy.url: 3, "http://other:8100": 9}))
        client = openai.AsyncOpenAI(
            base_url=stack.openai_base(stack.token("ep-v")), api_key="k", max_retries=0
        )
        await client.chat.completions.create(**REQUEST)

        # Followed live; a streamed call takes the same path.
        await _publish(
            broker, tmp_path, pb.PolicyLoaded(version=4, engine=f"{proxy.url}/", ok=True)
        )
        await eventually(lambda: _knows(stack, {proxy.url: 4, "http://other:8100": 9}))
        async for _ in await client.chat.completions.create(stream=True, **REQUEST):
            pass

        # A call sent before a swap and answered after it counts as the older version.
        proxy.hold = asyncio.Event()
        straddling = asyncio.create_task(client.chat.completions.create(**REQUEST))
        await asyncio.wait_for(proxy.holding.wait(), 30)
        await _publish(broker, tmp_path, pb.PolicyLoaded(version=6, engine=proxy.url, ok=True))
        await eventually(lambda: _knows(stack, {proxy.url: 6, "http://other:8100": 9}))
        proxy.hold.set()
        await straddling
        proxy.hold = None
        await client.chat.completions.create(**REQUEST)

        # An engine that names its version is believed over hrl.policy.
        proxy.strip = False
        await client.chat.completions.create(**REQUEST)

        calls = sorted(await stack.calls(at_least=5), key=lambda c: c.seq)
        assert [c.policy_version for c in calls] == [3, 4, 4, 6, 0]
        assert [c.stream for c in calls] == [False, True, False, False, False]
        assert {c.engine for c in calls} == {proxy.url}


async def test_an_engine_serving_versions_as_adapters_is_asked_for_the_loaded_ones_name(
    broker: EmbeddedBroker, proxy: HeaderlessProxy, tmp_path: Path
) -> None:
    """vLLM with LoRA versions: vllm-sync's PolicyLoaded names the adapter it loaded, and
    each call asks for that adapter, so the version stamped on it is the one that served."""
    proxy.serve_as = "tiny-model"
    await _publish(
        broker,
        tmp_path,
        pb.PolicyLoaded(version=3, engine=proxy.url, ok=True, served_model="policy-v3"),
        pb.PolicyLoaded(version=4, engine=proxy.url, ok=False, error="refused"),
    )
    async with running_stack(
        broker, tmp_path, TINY, engines=[proxy.url], engine_model="tiny-model"
    ) as stack:
        proxy.upstream = stack.engine_url
        await eventually(lambda: _knows(stack, {proxy.url: 3}))
        client = openai.AsyncOpenAI(
            base_url=stack.openai_base(stack.token("ep-lora")), api_key="k", max_retries=0
        )
        await client.chat.completions.create(**REQUEST)
        async for _ in await client.chat.completions.create(stream=True, **REQUEST):
            pass
        await _publish(
            broker,
            tmp_path,
            pb.PolicyLoaded(version=5, engine=proxy.url, ok=True, served_model="policy-v5"),
        )
        await eventually(lambda: _knows(stack, {proxy.url: 5}))
        await client.chat.completions.create(**REQUEST)
        calls = sorted(await stack.calls(at_least=3), key=lambda c: c.seq)
        assert proxy.asked == ["policy-v3", "policy-v3", "policy-v5"]
        assert [c.policy_version for c in calls] == [3, 3, 5]
        assert {c.model for c in calls} == {"gpt-4o"}  # the harness's own name, untouched
