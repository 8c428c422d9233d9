"""The gateway with real harness clients: the `openai` and `anthropic` SDKs, through the
gateway to the project's engine, captured on the real broker."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import pytest_asyncio

from harnessrl.broker import EmbeddedBroker
from harnessrl.episode_token import EpisodeClaims, mint
from harnessrl.http import HttpServer, Request, StreamingResponse
from harnessrl.services.gateway.dialects.anthropic_request import messages_to_chat
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import eventually
from tests.integration.gateway_stack import ADMIN, SECRET, Stack, running_stack
from tests.model_helpers import TINY, overfit

pytestmark = pytest.mark.integration

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
]
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]
CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>'
)
AFTER_TOOL = [
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "17 + 25"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, trained to call the calculator and then to answer with its result."""
    return overfit(
        tmp_path_factory.mktemp("gateway-model"),
        [
            (QUESTION, TOOLS, CALL_TEXT),
            (AFTER_TOOL, TOOLS, "The answer is 42."),
        ],
        steps=200,
    )


@pytest_asyncio.fixture
async def stack(broker: EmbeddedBroker, tmp_path: Path, tool_model: Path) -> AsyncIterator[Stack]:
    async with running_stack(broker, tmp_path, tool_model) as running:
        yield running


async def _engine(stack: Stack, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the engine itself answers to a request (as the gateway would ask it)."""
    async with httpx.AsyncClient() as http:
        model = (await http.get(f"{stack.engine_url}/v1/models")).json()["data"][0]["id"]
        response = await http.post(
            f"{stack.engine_url}/v1/{route}",
            json={
                **body,
                "model": model,
                "return_token_ids": True,
                "logprobs": True if route == "chat/completions" else 0,
            },
        )
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def _logprobs(choice: dict[str, Any]) -> list[float]:
    if "content" in (choice.get("logprobs") or {}):
        return [entry["logprob"] for entry in choice["logprobs"]["content"]]
    return list(choice["logprobs"]["token_logprobs"])


async def test_an_openai_tool_loop_is_captured_call_by_call_with_the_engines_tokens(
    stack: Stack,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=stack.openai_base(stack.token()), api_key="sk-x", max_retries=0
    )
    first = await client.chat.completions.create(
        model="gpt-4o", messages=QUESTION, tools=TOOLS, max_tokens=48, seed=5
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.model == "gpt-4o"
    assert json.loads(call.function.arguments) == {"expression": "17 + 25"}
    assert "token_ids" not in first.model_dump()["choices"][0]  # nothing the API would not say
    second = await client.chat.completions.create(
        model="gpt-4o", messages=AFTER_TOOL, tools=TOOLS, max_tokens=48, seed=6
    )
    assert second.choices[0].message.content == "The answer is 42."
    captured = await stack.calls(at_least=2)
    assert [(c.episode_id, c.seq, c.api, c.model) for c in captured] == [
        ("ep-1", 0, pb.API_OPENAI_CHAT, "gpt-4o"),
        ("ep-1", 1, pb.API_OPENAI_CHAT, "gpt-4o"),
    ]
    for captured_call, (messages, seed) in zip(
        captured, [(QUESTION, 5), (AFTER_TOOL, 6)], strict=True
    ):
        direct = await _engine(
            stack,
            "chat/completions",
            {
                "messages": messages,
                "tools": TOOLS,
                "max_tokens": 48,
                "seed": seed,
                "temperature": 1.0,
                "top_p": 1.0,
            },
        )  # the gateway's train-mode sampling
        assert list(captured_call.prompt_token_ids) == direct["prompt_token_ids"]
        assert list(captured_call.completion_token_ids) == direct["choices"][0]["token_ids"]
        assert list(captured_call.completion_logprobs) == pytest.approx(
            _logprobs(direct["choices"][0]), abs=1e-5
        )
        assert captured_call.mode == pb.MODE_TRAIN and captured_call.temperature == 1.0
        assert captured_call.trace_id and captured_call.span_id and captured_call.latency_ms > 0
    # The second prompt extends the first prompt + completion: the ids a sample can merge.
    first_context = [*captured[0].prompt_token_ids, *captured[0].completion_token_ids]
    assert list(captured[1].prompt_token_ids[: len(first_context)]) == first_context


async def test_a_train_call_that_forces_a_tool_is_captured_marked_constrained(
    stack: Stack,
) -> None:
    """vLLM decodes a forced tool choice as structured output: the log-probs recorded are
    of a constrained distribution, so the call is marked (and the builder never trains its
    completion). A val call, never trained, is not marked; nor is a free train call."""
    for episode, mode, choice in (
        ("forced", "train", "required"),
        ("free", "train", "auto"),
        ("val", "val", "required"),
    ):
        token = stack.token(episode=episode, mode=mode)
        client = openai.AsyncOpenAI(base_url=stack.openai_base(token), api_key="k", max_retries=0)
        await client.chat.completions.create(
            model="m", messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=8
        )
    captured = {c.episode_id: c.constrained for c in await stack.calls(at_least=3)}
    assert captured == {"forced": "tool_choice", "free": "", "val": ""}


async def test_streamed_and_non_streamed_calls_capture_the_same_ids(stack: Stack) -> None:
    request = {"model": "gpt-4o", "messages": QUESTION, "tools": TOOLS, "max_tokens": 24, "seed": 9}
    plain = openai.AsyncOpenAI(
        base_url=stack.openai_base(stack.token("ep-a")), api_key="k", max_retries=0
    )
    streamed = openai.AsyncOpenAI(
        base_url=stack.openai_base(stack.token("ep-b")), api_key="k", max_retries=0
    )
    whole = await plain.chat.completions.create(**request)
    chunks = [c async for c in await streamed.chat.completions.create(stream=True, **request)]
    assert all("token_ids" not in c.model_dump()["choices"][0] for c in chunks if c.choices)
    tool_chunk = next(c for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert tool_chunk.choices[0].delta.tool_calls[0].function.name == "calculator"
    assert whole.choices[0].message.tool_calls[0].function.name == "calculator"
    completion = {"model": "anything", "prompt": [5, 6, 7, 8], "max_tokens": 8, "seed": 3}
    await plain.completions.create(**completion)
    async for _ in await streamed.completions.create(stream=True, **completion):
        pass
    captured = {(c.episode_id, c.seq): c for c in await stack.calls(at_least=4)}
    for seq in (0, 1):
        a, b = captured[("ep-a", seq)], captured[("ep-b", seq)]
        assert not a.stream and b.stream
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.completion_token_ids == b.completion_token_ids
        assert list(a.completion_logprobs) == pytest.approx(list(b.completion_logprobs), abs=1e-5)
    assert captured[("ep-a", 1)].api == pb.API_OPENAI_COMPLETIONS
    assert list(captured[("ep-a", 1)].prompt_token_ids) == [5, 6, 7, 8]


async def test_anthropic_messages_and_tool_use_are_captured(stack: Stack) -> None:
    token = stack.token("ep-claude", mode="val")  # val: the harness's own temperature 0
    client = anthropic.AsyncAnthropic(
        base_url=stack.anthropic_base(token), api_key="sk-ant", max_retries=0
    )
    request: dict[str, Any] = {
        "model": "claude-test",
        "max_tokens": 48,
        "messages": [{"role": "user", "content": "What is 17 + 25?"}],
        "tools": ANTHROPIC_TOOLS,
        "extra_body": {"temperature": 0},
    }
    message = await client.messages.create(**request)
    assert message.stop_reason == "tool_use"
    tool_use = message.content[-1]
    assert tool_use.type == "tool_use" and tool_use.name == "calculator"
    assert tool_use.input == {"expression": "17 + 25"}
    async with client.messages.stream(**request) as stream:
        streamed = await stream.get_final_message()
    assert [b.type for b in streamed.content] == [b.type for b in message.content]
    assert streamed.content[-1].input == {"expression": "17 + 25"}
    captured = await stack.calls(at_least=2)
    assert [(c.api, c.stream, c.mode) for c in captured] == [
        (pb.API_ANTHROPIC_MESSAGES, False, pb.MODE_VAL),
        (pb.API_ANTHROPIC_MESSAGES, True, pb.MODE_VAL),
    ]
    assert captured[0].completion_token_ids == captured[1].completion_token_ids
    chat = messages_to_chat(
        {k: v for k, v in request.items() if k != "extra_body"} | {"temperature": 0}
    )
    direct = await _engine(stack, "chat/completions", {**chat.body, "stream": False})
    assert list(captured[0].prompt_token_ids) == direct["prompt_token_ids"]
    assert list(captured[0].completion_token_ids) == direct["choices"][0]["token_ids"]


async def test_an_engine_failure_reaches_the_harness_as_the_apis_error_and_trains_nothing(
    stack: Stack,
) -> None:
    openai_client = openai.AsyncOpenAI(
        base_url=stack.openai_base(stack.token()), api_key="k", max_retries=0
    )
    anthropic_client = anthropic.AsyncAnthropic(
        base_url=stack.anthropic_base(stack.token()), api_key="k", max_retries=0
    )
    request: dict[str, Any] = {"model": "m", "messages": QUESTION, "max_tokens": 8}
    stack.fail_next_engine_step()
    with pytest.raises(openai.InternalServerError) as whole:
        await openai_client.chat.completions.create(**request)
    assert whole.value.status_code == 500 and whole.value.code == "engine_error"
    stack.fail_next_engine_step()
    with pytest.raises(openai.APIError, match="the engine failed while generating"):
        async for _ in await openai_client.chat.completions.create(stream=True, **request):
            pass
    stack.fail_next_engine_step()
    with pytest.raises(anthropic.APIStatusError, match="the engine failed") as streamed:
        async with anthropic_client.messages.stream(**request) as events:
            await events.get_final_message()
    assert streamed.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    # The engine serves on; only the call that was answered is captured, as seq 0.
    answer = await openai_client.chat.completions.create(**request)
    assert answer.choices[0].finish_reason in ("stop", "length")
    captured = await stack.calls(at_least=1)
    assert [(c.seq, c.stream, c.finish_reason) for c in captured] == [
        (0, False, answer.choices[0].finish_reason)
    ]


async def test_an_engine_stream_ending_before_its_done_is_cut_for_the_harness_too(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """An engine stream that ends cleanly but without `[DONE]` (a proxy cut it, say): the
    harness's stream is cut as well, never finished for it, and nothing is captured."""
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "delta": {"content": "4"}, "token_ids": [5]}],
    }

    async def cut(_: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"

        return StreamingResponse(200, [("content-type", "text/event-stream")], body())

    engine = HttpServer(cut, host="127.0.0.1", port=0)
    await engine.start()
    try:
        async with running_stack(
            broker, tmp_path, TINY, engines=[f"http://127.0.0.1:{engine.port}"], engine_model="m"
        ) as stack:
            client = openai.AsyncOpenAI(
                base_url=stack.openai_base(stack.token()), api_key="k", max_retries=0
            )
            stream = await client.chat.completions.create(
                model="m", messages=QUESTION, max_tokens=4, stream=True
            )
            received = []
            with pytest.raises((httpx.HTTPError, openai.APIConnectionError)):
                async for part in stream:
                    received.append(part.choices[0].delta.content)
            assert received == ["4"]
            assert await stack.calls(timeout=1.0) == []
    finally:
        await engine.stop(grace_s=1.0)


async def test_refused_tokens_are_answered_and_capture_nothing(stack: Stack) -> None:
    def client(token: str, key: str = "sk-x") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=stack.openai_base(token), api_key=key, max_retries=0)

    async def ask(c: openai.AsyncOpenAI) -> Any:
        return await c.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)

    forged = mint(EpisodeClaims("ep-f", 1, "g", "train", 1e12), b"not-the-secret-0123")
    with pytest.raises(openai.AuthenticationError, match="signature does not match"):
        await ask(client(forged))
    with pytest.raises(openai.AuthenticationError, match="expired"):
        await ask(client(stack.token("ep-e", ttl=-1)))
    with pytest.raises(openai.PermissionDeniedError, match="another episode"):
        await ask(client(stack.token("ep-1"), key=stack.token("ep-2")))
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic.AsyncAnthropic(
            base_url=stack.anthropic_base(forged), api_key="k", max_retries=0
        ).messages.create(model="c", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    async with httpx.AsyncClient() as http:
        closed = await http.post(
            f"{stack.gateway_url}/admin/episodes/ep-c/close",
            headers={"authorization": f"Bearer {ADMIN}"},
            json={"attempt": 1, "group_id": "g-1"},
        )
        assert closed.json() == {"episode_id": "ep-c", "attempt": 1, "call_count": 0}
        no_key = await http.post(
            f"{stack.gateway_url}/v1/chat/completions", json={"model": "m", "messages": QUESTION}
        )
        assert no_key.status_code == 401
    with pytest.raises(openai.ConflictError, match="is closed"):
        await ask(client(stack.token("ep-c")))
    assert await stack.calls() == []  # nothing refused was captured


async def test_closing_an_episode_publishes_its_count_after_its_calls(stack: Stack) -> None:
    token = stack.token("ep-close", group="g-close")
    client = openai.AsyncOpenAI(
        base_url=f"{stack.gateway_url}/v1", api_key=token, max_retries=0
    )  # the token as API key, on the plain /v1 route
    for _ in range(3):
        await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
    async with httpx.AsyncClient() as http:
        url = f"{stack.gateway_url}/admin/episodes/ep-close/close"
        auth = {"authorization": f"Bearer {ADMIN}"}
        unauthorised = await http.post(url, json={"attempt": 1, "group_id": "g-close"})
        assert unauthorised.status_code == 401
        first = await http.post(url, headers=auth, json={"attempt": 1, "group_id": "g-close"})
        again = await http.post(url, headers=auth, json={"attempt": 1, "group_id": "g-close"})
    assert first.json()["call_count"] == again.json()["call_count"] == 3
    calls = await stack.calls(at_least=3)
    closed = await stack.closed()
    assert [c.seq for c in calls] == [0, 1, 2]
    assert [(c.episode_id, c.call_count) for c in closed] == [("ep-close", 3)]
    with pytest.raises(openai.ConflictError):
        await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)


async def test_malformed_bodies_get_the_apis_own_error_shapes(stack: Stack) -> None:
    token = stack.token("ep-bad")
    base = stack.openai_base(token)
    async with httpx.AsyncClient() as http:
        cases = [
            await http.post(f"{base}/chat/completions", content=b"{not json"),
            await http.post(f"{base}/chat/completions", json=[1, 2]),
            await http.post(f"{base}/chat/completions", json={"model": "m"}),
            await http.post(f"{base}/chat/completions", json={"model": "m", "messages": "hi"}),
            await http.post(f"{base}/completions", json={"model": "m", "prompt": [10**9]}),
            await http.get(f"{base}/chat/completions"),
            await http.post(f"{base}/embeddings", json={}),
            await http.post(f"{base}/chat/completions", content=b"x" * (9 * 1024 * 1024)),
        ]
        anthropic_cases = [
            await http.post(f"{stack.anthropic_base(token)}/v1/messages", content=b"[]"),
            await http.post(
                f"{stack.anthropic_base(token)}/v1/messages", json={"model": "c", "messages": []}
            ),
        ]
    assert [r.status_code for r in cases] == [400, 400, 400, 400, 400, 405, 404, 413]
    for response in cases:
        assert set(response.json()["error"]) >= {"message", "type"}
    for response in anthropic_cases:
        body = response.json()
        assert response.status_code == 400
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in anthropic_cases[1].json()["error"]["message"]
    assert await stack.calls() == []


async def test_a_paused_gateway_holds_calls_and_the_sdk_retries_until_resume(
    broker: EmbeddedBroker,
    tmp_path: Path,
    tool_model: Path,
) -> None:
    async with running_stack(
        broker, tmp_path, tool_model, pause_hold_s=0.3, pause_retry_after_s=1
    ) as stack:
        client = openai.AsyncOpenAI(base_url=stack.openai_base(stack.token()), api_key="k")
        auth = {"authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient() as http:
            await http.post(f"{stack.gateway_url}/admin/pause", headers=auth, json={})
            call = asyncio.create_task(
                client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
            )
            await asyncio.sleep(1.5)  # past the hold: the SDK got 429 and is retrying
            assert not call.done()
            await http.post(f"{stack.gateway_url}/admin/resume", headers=auth, json={})
            response = await asyncio.wait_for(call, 30)
        assert response.choices[0].finish_reason in ("length", "stop", "tool_calls")
        refused = stack.registry.get_sample_value(
            "harnessrl_gateway_refused_total", {"reason": "paused"}
        )
        assert refused is not None and refused >= 1
        assert len(await stack.calls(at_least=1)) == 1


async def test_with_the_broker_frozen_every_call_is_answered_and_captured_after(
    stack: Stack,
) -> None:
    client = openai.AsyncOpenAI(
        base_url=stack.openai_base(stack.token("ep-frozen")), api_key="k", max_retries=0
    )
    limit = asyncio.Semaphore(16)

    async def one(i: int) -> str:
        async with limit:
            r = await client.completions.create(model="m", prompt=[5, i % 50 + 1], max_tokens=2)
            return r.choices[0].finish_reason

    stack.broker.freeze()
    try:
        answers = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), 120)
    finally:
        stack.broker.thaw()
    assert len(answers) == 200
    captured = await stack.calls(at_least=200, timeout=60)
    assert sorted(c.seq for c in captured) == list(range(200))


async def test_the_token_may_be_the_anthropic_api_key_on_the_plain_route(stack: Stack) -> None:
    client = anthropic.AsyncAnthropic(
        base_url=stack.gateway_url, api_key=stack.token("ep-key", mode="val"), max_retries=0
    )
    message = await client.messages.create(
        model="claude-test",
        max_tokens=8,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "hello"}],
    )
    assert message.type == "message" and message.model == "claude-test"
    assert [c.episode_id for c in await stack.calls(at_least=1)] == ["ep-key"]


async def test_call_spans_continue_the_harness_trace_or_else_the_episodes(
    stack: Stack,
) -> None:
    episode_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    claims = EpisodeClaims(
        "ep-trace", 1, "g", "train", time.time() + 300, f"00-{episode_trace}-00f067aa0ba902b7-01"
    )
    token = mint(claims, SECRET.encode())
    harness_trace = "0af7651916cd43dd8448eb211c80319c"
    plain = openai.AsyncOpenAI(base_url=stack.openai_base(token), api_key="k", max_retries=0)
    await plain.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
    await plain.chat.completions.create(
        model="m",
        messages=QUESTION,
        max_tokens=2,
        extra_headers={"traceparent": f"00-{harness_trace}-b7ad6b7169203331-01"},
    )
    first, second = await stack.calls(at_least=2)
    assert first.trace_id == episode_trace  # no traceparent from the harness
    assert second.trace_id == harness_trace  # the harness's own trace wins
    assert first.span_id != second.span_id


async def test_control_commands_on_the_policy_topic_pause_and_resume(
    stack: Stack,
    tmp_path: Path,
) -> None:
    from harnessrl.bus import Producer
    from harnessrl.config import KafkaSettings, ProducerSettings

    producer = Producer(
        KafkaSettings(bootstrap_servers=stack.broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "trainer"),
        name="trainer/t",
    )
    await producer.start()
    auth = {"authorization": f"Bearer {ADMIN}"}

    async def paused() -> bool:
        async with httpx.AsyncClient() as http:
            status = await http.get(f"{stack.gateway_url}/admin/status", headers=auth)
        return bool(status.json()["paused"])

    await producer.publish(
        pb.ControlCommand(
            command_id="c1",
            action=pb.CONTROL_ACTION_PAUSE,
            reason="sync swap to 2",
            policy_version=2,
        )
    )
    await eventually(paused, timeout=30)
    await producer.publish(pb.ControlCommand(command_id="c2", action=pb.CONTROL_ACTION_RESUME))
    await eventually(lambda: _not(paused), timeout=30)
    await producer.stop()


async def _not(check: Any) -> bool:
    return not await check()


async def test_an_unreachable_engine_is_a_502_in_the_apis_shape(
    broker: EmbeddedBroker,
    tmp_path: Path,
    tool_model: Path,
) -> None:
    from harnessrl.broker import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    async with running_stack(
        broker, tmp_path, tool_model, upstream_attempts=2, engine_model="m", engines=[dead]
    ) as stack:
        client = openai.AsyncOpenAI(
            base_url=stack.openai_base(stack.token()), api_key="k", max_retries=0
        )
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=2)
        assert info.value.status_code == 502
        assert "engine unavailable" in str(info.value)
        assert await stack.calls() == []


async def test_bodies_are_captured_when_configured(
    broker: EmbeddedBroker,
    tmp_path: Path,
    tool_model: Path,
) -> None:
    async with running_stack(
        broker, tmp_path, tool_model, capture_bodies=True, body_capture_bytes=4096
    ) as stack:
        async with httpx.AsyncClient() as http:
            body = {"model": "m", "messages": QUESTION, "max_tokens": 3}
            response = await http.post(
                f"{stack.openai_base(stack.token())}/chat/completions", json=body
            )
        (call,) = await stack.calls(at_least=1)
        assert json.loads(call.request_body) == body
        assert json.loads(call.response_body)["choices"][0]["token_ids"] == list(
            call.completion_token_ids
        )
        assert response.status_code == 200 and not call.bodies_truncated


async def test_a_harness_gone_before_its_stream_began_leaves_no_call_in_flight(
    stack: Stack,
) -> None:
    """Regression: when the harness leaves while the handler opens the engine's stream, the
    server closes the streamed answer without ever starting it; the call's end sat in the
    relay generator's `finally`, which an unstarted generator skips, so the episode kept a
    call in flight for good and its close never answered."""
    from harnessrl.http.streaming import aclose

    token = stack.token("ep-gone")
    body = {"model": "m", "messages": QUESTION, "max_tokens": 4, "stream": True}
    request = Request(
        "POST",
        f"/e/{token}/v1/chat/completions",
        "",
        {"content-type": "application/json"},
        [],
        orjson.dumps(body),
        None,
        "1.1",
        asyncio.Event(),
    )
    assert stack.gateway.app is not None
    response = await stack.gateway.app(request)
    assert isinstance(response, StreamingResponse)
    assert stack.gateway.book.in_flight == 1
    await aclose(response.chunks)  # what the server does with it once the harness is gone
    assert stack.gateway.book.in_flight == 0
    async with httpx.AsyncClient() as http:
        closed = await asyncio.wait_for(
            http.post(
                f"{stack.gateway_url}/admin/episodes/ep-gone/close",
                headers={"authorization": f"Bearer {ADMIN}"},
                json={"attempt": 1, "group_id": "g-1"},
            ),
            30,
        )
    assert closed.json() == {"episode_id": "ep-gone", "attempt": 1, "call_count": 0}
