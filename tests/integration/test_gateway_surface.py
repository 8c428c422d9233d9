"""The gateway's surface beyond generation, with the real SDKs over loopback: Anthropic's
token count, the model routes, completion budgets against a small engine context, hostile
nesting, and the access log and its metric."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harnessrl.broker import EmbeddedBroker
from harnessrl.v1 import events_pb2 as pb
from tests.integration.fuzzing import anthropic_error_shape, openai_error_shape
from tests.integration.gateway_stack import Stack, running_stack
from tests.integration.shared_stack import embedded_broker, episode_calls
from tests.model_helpers import TINY

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

TOOLS = [
    {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "input_schema": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    }
]
SMALL_CONTEXT = 48
"""The engine context of the budget tests, in tokens."""
LONG = [{"role": "user", "content": "count " * 120}]
"""A prompt longer than SMALL_CONTEXT."""
MAX_DEPTH = 64
"""The gateway's default `max_json_depth`."""
PARSER_DEPTH = 1024
"""The deepest nesting the JSON parser (orjson) reads."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def module_broker(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedBroker]:
    async with embedded_broker(tmp_path_factory.mktemp("surface-broker")) as broker:
        yield broker


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(
    module_broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    async with running_stack(module_broker, tmp_path_factory.mktemp("surface"), TINY) as running:
        yield running


def _anthropic(stack: Stack, episode: str) -> anthropic.AsyncAnthropic:
    token = stack.token(episode, mode="val")
    return anthropic.AsyncAnthropic(
        base_url=stack.anthropic_base(token), api_key="sk-ant", max_retries=0
    )


def _openai(stack: Stack, episode: str) -> openai.AsyncOpenAI:
    token = stack.token(episode, mode="val")
    return openai.AsyncOpenAI(base_url=stack.openai_base(token), api_key="sk-x", max_retries=0)


async def _engine_count(stack: Stack, messages: list[dict[str, Any]]) -> int:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{stack.engine_url}/tokenize", json={"messages": messages})
    response.raise_for_status()
    return int(response.json()["count"])


def _sample(stack: Stack, name: str, labels: dict[str, str] | None = None) -> float:
    return stack.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.parametrize(
    "request_",
    [
        {"messages": [{"role": "user", "content": "What is 17 + 25?"}]},
        {
            "system": "You are terse.",
            "tools": TOOLS,
            "messages": [
                {"role": "user", "content": "What is 17 + 25?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me see."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "calculator",
                            "input": {"expression": "17 + 25"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}],
                },
            ],
        },
        {  # no tools offered to the model: none in the prompt, none in its count
            "tools": TOOLS,
            "tool_choice": {"type": "none"},
            "messages": [{"role": "user", "content": "What is 17 + 25?"}],
        },
        {  # a server tool: left out of the call, so out of its count too
            "tools": [*TOOLS, {"type": "web_search_20250305", "name": "web_search"}],
            "messages": [{"role": "user", "content": "What is 17 + 25?"}],
        },
    ],
    ids=["plain", "tools-and-history", "tool-choice-none", "server-tool"],
)
async def test_count_tokens_is_the_prompt_the_same_request_is_served_with(
    stack: Stack, request_: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    episode = f"ep-count-{request.node.callspec.id}"
    client = _anthropic(stack, episode)
    counted = await client.messages.count_tokens(model="claude-x", **request_)
    message = await client.messages.create(
        model="claude-x", max_tokens=2, extra_body={"temperature": 0}, **request_
    )
    (call,) = await episode_calls(stack, episode, 1)
    assert call.api == pb.API_ANTHROPIC_MESSAGES
    assert counted.input_tokens == message.usage.input_tokens == len(call.prompt_token_ids)
    assert message.usage.output_tokens == len(call.completion_token_ids)


async def test_model_routes_answer_in_the_shape_of_the_api_asked(stack: Stack) -> None:
    claude = _anthropic(stack, "ep-models")
    listed = await claude.models.list()
    assert [(m.type, m.id) for m in listed.data] == [("model", "tiny-model")]
    assert listed.has_more is False and listed.first_id == "tiny-model"
    one = await claude.models.retrieve("claude-x")
    assert (one.type, one.id, one.display_name) == ("model", "claude-x", "claude-x")
    gpt = _openai(stack, "ep-models")
    model = await gpt.models.retrieve("gpt-x")
    assert (model.object, model.id) == ("model", "gpt-x")
    assert [m.id for m in (await gpt.models.list()).data] == ["tiny-model"]
    async with httpx.AsyncClient() as http:
        token = stack.token("ep-models")
        missing = await http.post(f"{stack.anthropic_base(token)}/v1/messages/foo", json={})
        assert missing.status_code == 404
        anthropic_error_shape("/v1/messages/foo", missing.json())
        assert missing.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        await claude.post("/v1/messages/foo", body={}, cast_to=object)


async def test_a_large_budget_is_clamped_to_the_context_and_a_long_prompt_refused(
    module_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    engine = {"max_model_len": SMALL_CONTEXT}
    async with running_stack(module_broker, tmp_path, TINY, engine_settings=engine) as small:
        claude = _anthropic(small, "ep-clamp")
        before = _sample(small, "harnessrl_gateway_max_tokens_clamped_total")
        async with claude.messages.stream(  # streamed, as Claude Code asks for 64000
            model="claude-x",
            max_tokens=64000,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": 0},
        ) as stream:
            message = await stream.get_final_message()
        assert _sample(small, "harnessrl_gateway_max_tokens_clamped_total") == before + 1
        (call,) = await episode_calls(small, "ep-clamp", 1)
        assert message.usage.input_tokens == len(call.prompt_token_ids)
        assert message.usage.output_tokens == len(call.completion_token_ids)
        assert len(call.prompt_token_ids) + len(call.completion_token_ids) <= SMALL_CONTEXT

        tokens = (await claude.messages.count_tokens(model="claude-x", messages=LONG)).input_tokens
        assert tokens > SMALL_CONTEXT
        with pytest.raises(anthropic.BadRequestError) as refused:
            await claude.messages.create(model="claude-x", max_tokens=4, messages=LONG)
        text = refused.value.message
        assert "prompt is too long" in text
        assert f"{tokens} tokens" in text and f"{SMALL_CONTEXT}-token" in text
        assert "messages" in text
        assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

        chat_tokens = await _engine_count(small, LONG)
        with pytest.raises(openai.BadRequestError) as chat_refused:
            await _openai(small, "ep-clamp").chat.completions.create(
                model="gpt-x", max_tokens=4, messages=LONG
            )
        error = chat_refused.value
        assert (
            f"{chat_tokens} tokens" in error.message and f"{SMALL_CONTEXT}-token" in error.message
        )
        assert error.param == "messages" and error.code == "context_length_exceeded"
        assert len(await episode_calls(small, "ep-clamp", 2, timeout=1.0)) == 1  # refusals: none


async def test_with_the_reject_policy_a_budget_over_the_context_is_refused(
    module_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    engine = {"max_model_len": SMALL_CONTEXT}
    async with running_stack(
        module_broker, tmp_path, TINY, engine_settings=engine, max_tokens_policy="reject"
    ) as strict:
        claude = _anthropic(strict, "ep-reject")
        hi = [{"role": "user", "content": "hi"}]
        with pytest.raises(anthropic.BadRequestError, match="max_tokens: 64000 tokens"):
            async with claude.messages.stream(
                model="claude-x", max_tokens=64000, messages=hi
            ) as stream:
                await stream.get_final_message()
        fits = await claude.messages.create(model="claude-x", max_tokens=4, messages=hi)
        assert fits.usage.output_tokens <= 4
        assert _sample(strict, "harnessrl_gateway_max_tokens_clamped_total") == 0
        (call,) = await episode_calls(strict, "ep-reject", 1)
        assert call.seq == 0 and len(call.completion_token_ids) == fits.usage.output_tokens


def _nest(depth: int, kind: str) -> str:
    """JSON text of `depth` nested non-empty containers (an empty one counts no level),
    written by hand: Python's json recurses and stops near 1,000 levels."""
    if kind == "list":
        return "[" * depth + "1" + "]" * depth
    return '{"k":' * depth + "1" + "}" * depth


_HI = '[{"role":"user","content":"hi"}]'
POSITIONS: dict[str, tuple[str, str, int, str]] = {
    # name: (route, top-level field holding the nest, levels of containers around the nest,
    #        the body with the nest as {})
    "top-level field": (
        "/v1/chat/completions",
        "unknown",
        1,
        '{"model":"m","max_tokens":1,"messages":' + _HI + ',"unknown":{}}',
    ),
    "tool parameters": (
        "/v1/chat/completions",
        "tools",
        6,
        '{"model":"m","max_tokens":1,"messages":' + _HI + ',"tools":[{"type":"function",'
        '"function":{"name":"t","parameters":{"type":"object","properties":{"p":{}}}}}]}',
    ),
    "chat messages": (
        "/v1/chat/completions",
        "messages",
        3,
        '{"model":"m","max_tokens":1,"messages":[{"role":"user","content":{}}]}',
    ),
    "anthropic input_schema": (
        "/v1/messages",
        "tools",
        5,
        '{"model":"c","max_tokens":1,"messages":' + _HI + ',"tools":[{"name":"t",'
        '"input_schema":{"type":"object","properties":{"p":{}}}}]}',
    ),
    "anthropic messages": (
        "/v1/messages",
        "messages",
        3,
        '{"model":"c","max_tokens":1,"messages":[{"role":"user","content":{}}]}',
    ),
    "responses tool parameters": (
        "/v1/responses",
        "tools",
        5,
        '{"model":"m","max_output_tokens":1,"input":"hi","tools":[{"type":"function",'
        '"name":"t","parameters":{"type":"object","properties":{"p":{}}}}]}',
    ),
}


async def test_hostile_nesting_anywhere_is_a_clear_400_in_the_routes_shape(stack: Stack) -> None:
    base = f"{stack.gateway_url}/e/{stack.token('ep-nest')}"
    seen: list[tuple[str, int, int]] = []

    @settings(
        max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(
        position=st.sampled_from(sorted(POSITIONS)),
        depth=st.integers(1, 1100),
        kind=st.sampled_from(["list", "dict"]),
    )
    @example(position="top-level field", depth=1100, kind="list")
    @example(position="top-level field", depth=PARSER_DEPTH - 1, kind="list")  # parsed, just
    @example(position="top-level field", depth=PARSER_DEPTH, kind="dict")  # one past the parser
    @example(position="anthropic input_schema", depth=1100, kind="dict")
    @example(position="responses tool parameters", depth=MAX_DEPTH, kind="dict")
    @example(position="anthropic messages", depth=MAX_DEPTH - 3, kind="list")
    def send(position: str, depth: int, kind: str) -> None:
        route, field, around, template = POSITIONS[position]
        body = template.replace("{}", _nest(depth, kind), 1).encode()
        with httpx.Client(timeout=60) as http:
            response = http.post(base + route, content=body)
        seen.append((position, depth, response.status_code))
        assert response.status_code < 500, (position, depth, response.text[:300])
        if route == "/v1/messages" and response.status_code >= 400:
            anthropic_error_shape(route, response.json())
        elif response.status_code >= 400:
            openai_error_shape(route, response.json())
        if around + depth > MAX_DEPTH:
            assert response.status_code == 400, (position, depth)
            message = orjson.loads(response.content)["error"]["message"]
            if around + depth > PARSER_DEPTH:
                assert message.startswith("body: not valid JSON"), message
            else:  # the path to where it goes too deep
                assert (
                    message.startswith(f"{field}.") and f"more than {MAX_DEPTH} levels" in message
                )

    await asyncio.to_thread(send)
    assert any(POSITIONS[p][2] + d > MAX_DEPTH for p, d, _ in seen)


async def test_each_request_is_one_access_log_line_and_one_count_without_the_token(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    token = stack.token("ep-log")
    labels_404 = {"route": "other", "status": "404"}
    labels_200 = {"route": "/v1/chat/completions", "status": "200"}
    name = "harnessrl_gateway_requests_total"
    before = (_sample(stack, name, labels_404), _sample(stack, name, labels_200))
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient() as http:
        missing = await http.post(f"{stack.openai_base(token)}/embeddings", json={"input": "x"})
        answered = await http.post(
            f"{stack.openai_base(token)}/chat/completions",
            json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        )
    assert (missing.status_code, answered.status_code) == (404, 200)
    assert (_sample(stack, name, labels_404), _sample(stack, name, labels_200)) == (
        before[0] + 1,
        before[1] + 1,
    )
    lines = [
        r.hrl_fields  # type: ignore[attr-defined]  # the project logger's key=value fields
        for r in caplog.records
        if r.name.endswith("gateway.app") and r.getMessage() == "request"
    ]
    assert [(f["method"], f["route"], f["status"], f["episode_id"]) for f in lines] == [
        ("POST", "other", 404, "ep-log"),
        ("POST", "/v1/chat/completions", 200, "ep-log"),
    ]
    assert all(isinstance(f["ms"], float) and f["ms"] > 0 for f in lines)
    assert token not in repr(lines)
