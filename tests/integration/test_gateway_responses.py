"""The OpenAI Responses API through the gateway, with the real `openai` SDK and the OpenAI
Agents SDK's default model class: every call captured on the real broker with the engine's
exact token ids, as a chat call of the same conversation would be."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import torch
from agents import (
    Agent,
    ModelSettings,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)

from harnessrl.v1 import events_pb2 as pb
from tests.integration.gateway_stack import Stack, running_stack
from tests.integration.shared_stack import embedded_broker, episode_calls
from tests.model_helpers import overfit

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

QUESTION = "What is 17 + 25?"
ANSWER = "The answer is 42."
CALLS: list[str] = []
"""Expressions the agent's calculator was called with."""


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    CALLS.append(expression)
    return str(sum(int(term) for term in expression.split("+")))


# The agent and the SDK calls offer the same tool with no instructions, so their prompts are
# the same and one trained model serves both.
TOOLS = [
    {
        "type": "function",
        "name": calculator.name,
        "description": calculator.description,
        "parameters": calculator.params_json_schema,
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
FORCE = {"type": "function", "name": "calculator"}
GREEDY = {"model": "gpt-5", "tools": TOOLS, "temperature": 0, "max_output_tokens": 48}
"""A request offering the calculator, decoded greedily (val-mode tokens keep temperature 0)."""
ARGUMENTS = '{"expression": "17 + 25"}'
CALL_TEXT = f'<tool_call>\n{{"name": "calculator", "arguments": {ARGUMENTS}}}\n</tool_call>'


def _after_tool(call_id: str) -> list[dict[str, Any]]:
    """The chat messages of the conversation once the calculator answered call `call_id`."""
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": ARGUMENTS},
    }
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "42"},
    ]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, trained to call the calculator, then to answer with its result (call
    ids are not in the chat template, so any id will do)."""
    # One thread: on a loaded CPU, torch's default of one per core is ~10x slower here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return overfit(
            tmp_path_factory.mktemp("responses-model"),
            [
                ([{"role": "user", "content": QUESTION}], CHAT_TOOLS, CALL_TEXT),
                (_after_tool("call_0"), CHAT_TOOLS, ANSWER),
            ],
            steps=200,
        )
    finally:
        torch.set_num_threads(threads)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, tool_model: Path) -> AsyncIterator[Stack]:
    tmp = tmp_path_factory.mktemp("responses-stack")
    async with embedded_broker(tmp) as broker, running_stack(broker, tmp, tool_model) as running:
        yield running


def _client(stack: Stack, episode: str, mode: str = "val") -> openai.AsyncOpenAI:
    """A client of one episode; val mode keeps the harness's own temperature (0 here)."""
    token = stack.token(episode, mode=mode)
    return openai.AsyncOpenAI(base_url=stack.openai_base(token), api_key="sk-x", max_retries=0)


async def _engine_prompt(
    stack: Stack, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt ids the engine builds for a chat request (its own /tokenize)."""
    body: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{stack.engine_url}/tokenize", json=body)
    response.raise_for_status()
    return list(response.json()["tokens"])


def _assert_usage(response: Any, call: pb.ModelCall) -> None:
    assert response.usage.input_tokens == len(call.prompt_token_ids) > 0
    assert response.usage.output_tokens == len(call.completion_token_ids) > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same delta type counted once."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1] or "delta" not in t]


async def test_a_response_is_captured_with_the_engines_prompt_for_its_input(
    stack: Stack,
) -> None:
    client = _client(stack, "ep-plain", mode="train")
    plain = await client.responses.create(
        model="gpt-5", instructions="Be brief.", input="Say hi.", max_output_tokens=8
    )
    items = await client.responses.create(
        model="gpt-5",
        max_output_tokens=8,
        input=[
            {"type": "message", "role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Say"},
                    {"type": "input_text", "text": "hi."},
                ],
            },
        ],
    )
    captured = await episode_calls(stack, "ep-plain", 2)
    assert [(c.seq, c.api, c.model, c.stream) for c in captured] == [
        (0, pb.API_OPENAI_RESPONSES, "gpt-5", False),
        (1, pb.API_OPENAI_RESPONSES, "gpt-5", False),
    ]
    system = {"role": "system", "content": "Be brief."}
    assert list(captured[0].prompt_token_ids) == await _engine_prompt(
        stack, [system, {"role": "user", "content": "Say hi."}]
    )
    # A developer message is a system one; text parts are joined with a newline.
    assert list(captured[1].prompt_token_ids) == await _engine_prompt(
        stack, [system, {"role": "user", "content": "Say\nhi."}]
    )
    for response, call in zip((plain, items), captured, strict=True):
        _assert_usage(response, call)
        assert response.object == "response" and response.model == "gpt-5"
        assert response.id.startswith("resp_") and response.instructions == (
            "Be brief." if response is plain else None
        )
        assert response.status in ("completed", "incomplete")
        assert (response.status == "incomplete") == (call.finish_reason == "length")
        assert response.output, "the engine produced tokens, so there is an output item"
        for item in response.output:
            assert item.type == "message" and item.role == "assistant"
            assert [part.type for part in item.content] == ["output_text"]
        assert response.output_text == "".join(p.text for i in response.output for p in i.content)


async def test_a_forced_function_call_round_trip_extends_the_first_calls_context(
    stack: Stack,
) -> None:
    client = _client(stack, "ep-tool")
    first = await client.responses.create(input=QUESTION, tool_choice=FORCE, **GREEDY)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "calculator" and call.status == "completed"
    assert json.loads(call.arguments) == {"expression": "17 + 25"}
    assert call.call_id and call.id.startswith("fc_")
    assert first.status == "completed" and first.output_text == ""
    second = await client.responses.create(
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
        ],
        **GREEDY,
    )
    assert second.output_text == ANSWER and second.status == "completed"
    captured = await episode_calls(stack, "ep-tool", 2)
    assert [c.seq for c in captured] == [0, 1]
    for response, model_call in zip((first, second), captured, strict=True):
        _assert_usage(response, model_call)
    assert list(captured[0].prompt_token_ids) == await _engine_prompt(
        stack, [{"role": "user", "content": QUESTION}], CHAT_TOOLS
    )
    assert list(captured[1].prompt_token_ids) == await _engine_prompt(
        stack, _after_tool(call.call_id), CHAT_TOOLS
    )
    # The second prompt extends the first prompt + completion: the ids a sample can merge.
    context = [*captured[0].prompt_token_ids, *captured[0].completion_token_ids]
    assert list(captured[1].prompt_token_ids[: len(context)]) == context


async def test_chaining_by_previous_response_id_gives_the_whole_conversations_prompt(
    stack: Stack,
) -> None:
    client = _client(stack, "ep-chain")
    first = await client.responses.create(input=QUESTION, tool_choice=FORCE, **GREEDY)
    (call,) = first.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "42"}
    whole = await client.responses.create(
        input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), output],
        store=False,
        **GREEDY,
    )
    chained = await client.responses.create(previous_response_id=first.id, input=[output], **GREEDY)
    assert chained.previous_response_id == first.id
    assert chained.output_text == whole.output_text == ANSWER
    captured = await episode_calls(stack, "ep-chain", 3)
    assert [c.seq for c in captured] == [0, 1, 2]
    assert captured[2].prompt_token_ids == captured[1].prompt_token_ids
    assert captured[2].completion_token_ids == captured[1].completion_token_ids
    _assert_usage(chained, captured[2])

    stored = await client.responses.retrieve(first.id)
    assert stored.model_dump() == first.model_dump()
    listed = await client.responses.input_items.list(chained.id)
    assert [item.type for item in listed.data] == ["function_call_output"]
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(whole.id)  # store: false keeps nothing
    other = _client(stack, "ep-chain-other")
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match=first.id):
        await other.responses.create(previous_response_id=first.id, input=[output], **GREEDY)
    with pytest.raises(openai.BadRequestError, match="resp_unknown") as unknown:
        await client.responses.create(previous_response_id="resp_unknown", input="hi", **GREEDY)
    assert unknown.value.param == "previous_response_id"
    await client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError, match=chained.id):
        # the chain it continued is gone with the response deleted
        await client.responses.create(previous_response_id=chained.id, input="hi", **GREEDY)
    assert len(await episode_calls(stack, "ep-chain", 4, timeout=1.0)) == 3  # refusals: none


async def test_a_streamed_function_call_is_the_documented_event_sequence(
    stack: Stack,
) -> None:
    client = _client(stack, "ep-stream")
    stream = await client.responses.create(input=QUESTION, tool_choice=FORCE, stream=True, **GREEDY)
    events = [event async for event in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _collapsed([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(deltas) == json.loads(done.arguments) == {"expression": "17 + 25"}
    final = events[-1].response
    (item,) = final.output
    assert item.type == "function_call" and item.arguments == done.arguments
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    (captured,) = await episode_calls(stack, "ep-stream", 1)
    assert captured.stream and captured.api == pb.API_OPENAI_RESPONSES
    _assert_usage(final, captured)


async def test_the_sdks_stream_helper_gets_the_final_response_of_a_streamed_answer(
    stack: Stack,
) -> None:
    client = _client(stack, "ep-helper")
    first = await client.responses.create(input=QUESTION, tool_choice=FORCE, **GREEDY)
    (call,) = first.output
    async with client.responses.stream(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}],
        **GREEDY,
    ) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert final.output_text == ANSWER and final.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _collapsed([e.type for e in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(texts) == ANSWER
    captured = await episode_calls(stack, "ep-helper", 2)
    assert [(c.seq, c.stream) for c in captured] == [(0, False), (1, True)]
    _assert_usage(final, captured[1])
    assert (await client.responses.retrieve(final.id)).output_text == ANSWER  # stored too


async def test_a_response_and_a_chat_completion_of_one_conversation_capture_the_same_ids(
    stack: Stack,
) -> None:
    seed = {"seed": 7}
    responses = _client(stack, "ep-same-r", mode="train")
    chat = _client(stack, "ep-same-c", mode="train")
    response = await responses.responses.create(
        model="gpt-5",
        instructions="Be brief.",
        input="Say hi.",
        max_output_tokens=12,
        extra_body=seed,
    )
    completion = await chat.chat.completions.create(
        model="gpt-5",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi."},
        ],
        max_tokens=12,
        extra_body=seed,
    )
    (r,) = await episode_calls(stack, "ep-same-r", 1)
    (c,) = await episode_calls(stack, "ep-same-c", 1)
    assert (r.api, c.api) == (pb.API_OPENAI_RESPONSES, pb.API_OPENAI_CHAT)
    assert r.mode == c.mode == pb.MODE_TRAIN and r.temperature == c.temperature == 1.0
    assert r.prompt_token_ids == c.prompt_token_ids
    assert r.completion_token_ids == c.completion_token_ids
    assert list(r.completion_logprobs) == pytest.approx(list(c.completion_logprobs), abs=1e-5)
    assert r.finish_reason == c.finish_reason
    assert response.output_text == (completion.choices[0].message.content or "")
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.usage.output_tokens == completion.usage.completion_tokens


async def test_an_agents_sdk_run_with_its_default_model_is_captured_call_by_call(
    stack: Stack,
) -> None:
    """The Agents SDK's process-wide default client points at the gateway for this run
    (tracing off: it would export to api.openai.com)."""
    set_tracing_disabled(True)
    set_default_openai_client(_client(stack, "ep-agent"), use_for_tracing=False)
    agent = Agent(
        name="calculating",
        model="any-name",
        tools=[calculator],
        model_settings=ModelSettings(temperature=0, max_tokens=48),
    )
    CALLS.clear()
    result = await Runner.run(agent, QUESTION, max_turns=4)
    assert result.final_output == ANSWER
    assert CALLS == ["17 + 25"]
    captured = await episode_calls(stack, "ep-agent", 2)
    assert [(c.seq, c.api, c.model, c.stream) for c in captured] == [
        (0, pb.API_OPENAI_RESPONSES, "any-name", False),
        (1, pb.API_OPENAI_RESPONSES, "any-name", False),
    ]
    assert len(result.raw_responses) == 2
    for response, call in zip(result.raw_responses, captured, strict=True):
        assert response.usage.input_tokens == len(call.prompt_token_ids)
        assert response.usage.output_tokens == len(call.completion_token_ids)
    assert list(captured[0].prompt_token_ids) == await _engine_prompt(
        stack, [{"role": "user", "content": QUESTION}], CHAT_TOOLS
    )
    context = [*captured[0].prompt_token_ids, *captured[0].completion_token_ids]
    assert list(captured[1].prompt_token_ids[: len(context)]) == context
