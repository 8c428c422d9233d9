"""Anthropic Messages <-> OpenAI chat completions, checked against the real `anthropic` SDK.

Requests are built by the SDK itself and captured at the transport; answers translated by
the gateway module are handed back to the SDK, which must parse them into the right objects
(whole messages, `messages.stream(...)` and `create(stream=True)`). `httpx2.MockTransport`
stands in for the network only. The engine's answers are written here in the exact shapes
of services/inference/engine_chat.py (and vLLM's split tool-call chunks): no model runs in a unit
test.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import anthropic
import httpx2
import orjson
import pydantic
import pytest
from anthropic.types import (
    ContentBlock,
    Message,
    MessageParam,
    RawMessageStreamEvent,
    ToolParam,
    ToolUseBlock,
)
from anthropic.types.shared import ErrorResponse

from harnessrl.services.gateway.dialects.anthropic_request import (
    TOOL_ERROR_PREFIX,
    ChatRequest,
    messages_to_chat,
)
from harnessrl.services.gateway.dialects.anthropic_response import (
    RAW_ARGUMENTS_KEY,
    MessageStream,
    chat_error_to_anthropic,
    chat_to_message,
    encode_sse,
)
from harnessrl.services.gateway.errors import ANTHROPIC, GatewayError, render_engine
from harnessrl.services.inference.protocol import ChatCompletionRequest

MODEL = "claude-sonnet-4-6"
USER: list[MessageParam] = [{"role": "user", "content": "What is 17 + 25?"}]
CALCULATOR: ToolParam = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression.",
    "input_schema": {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
}
WEATHER: ToolParam = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
EVENTS = pydantic.TypeAdapter(RawMessageStreamEvent)

Handler = Callable[[httpx2.Request], httpx2.Response]


def client(handler: Handler) -> anthropic.Anthropic:
    transport = httpx2.MockTransport(handler)
    return anthropic.Anthropic(
        api_key="sk-test",
        base_url="http://gateway.test/e/token",
        max_retries=0,
        http_client=httpx2.Client(transport=transport),
    )


def sent_by_sdk(**create: Any) -> dict[str, Any]:
    """The JSON body the SDK sends for `messages.create(**create)`."""
    captured: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        captured.append(json.loads(request.content))
        return httpx2.Response(200, json=chat_to_message(completion("ok"), model=MODEL))

    client(handler).messages.create(**{"model": MODEL, "max_tokens": 64, **create})
    return captured[0]


def translated(**create: Any) -> ChatRequest:
    """The chat request for what the SDK sends; the engine's own validation accepts it."""
    chat = messages_to_chat(sent_by_sdk(**create))
    ChatCompletionRequest.model_validate(chat.body)
    return chat


def answering(completion_body: dict[str, Any]) -> Handler:
    """A gateway in miniature answering every request with `completion_body` translated."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        chat = messages_to_chat(json.loads(request.content))
        assert not chat.stream
        return httpx2.Response(200, json=chat_to_message(completion_body, model=chat.model))

    return handler


def streaming(chunks: list[dict[str, Any]], seen: list[dict[str, Any]] | None = None) -> Handler:
    """A gateway in miniature streaming `chunks` translated as Anthropic SSE."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        chat = messages_to_chat(json.loads(request.content))
        assert chat.stream and chat.body["stream_options"] == {"include_usage": True}
        stream = MessageStream(model=chat.model)
        events = [e for c in chunks for e in stream.feed(c)] + stream.finish()
        if seen is not None:
            seen.extend(data for _, data in events)
        body = b"".join(encode_sse(name, data) for name, data in events)
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    return handler


def text_of(block: ContentBlock) -> str:
    assert block.type == "text"
    return block.text


def tool_use(block: ContentBlock) -> ToolUseBlock:
    assert block.type == "tool_use"
    return block


def input_of(block: ContentBlock) -> object:
    return tool_use(block).input


# -- the engine's answers, in services/inference/engine_chat.py's shapes --------------------

CHAT_ID = "chatcmpl-5f1e2d"
HEAD = {"id": CHAT_ID, "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
LOGPROBS = {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]}


def completion(
    content: str | None,
    *,
    calls: Sequence[tuple[str, str, str]] = (),  # (id, name, arguments)
    finish: str = "stop",
    stop_reason: str | int | None = None,
    prompt_ids: int = 12,
    ids: int = 5,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ]
    return {
        "id": CHAT_ID,
        "object": "chat.completion",
        "created": 1,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "logprobs": LOGPROBS,
                "token_ids": list(range(ids)),
            }
        ],
        "usage": {
            "prompt_tokens": prompt_ids,
            "completion_tokens": ids,
            "total_tokens": prompt_ids + ids,
        },
        "prompt_token_ids": list(range(prompt_ids)),
    }


def first(prompt_ids: int | None = 12) -> dict[str, Any]:
    delta = {"role": "assistant", "content": ""}
    chunk: dict[str, Any] = {
        **HEAD,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
    }
    if prompt_ids is not None:
        chunk["prompt_token_ids"] = list(range(prompt_ids))
    return chunk


def token(
    delta: dict[str, Any],
    *,
    finish: str | None = None,
    stop_reason: str | int | None = None,
    ids: int | None = 1,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": LOGPROBS,
        "finish_reason": finish,
    }
    if ids is not None:
        choice["token_ids"] = list(range(ids))
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return {**HEAD, "choices": [choice]}


def call_delta(
    index: int, arguments: str, call_id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if call_id is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def usage(prompt: int, completion_tokens: int) -> dict[str, Any]:
    counts = {"prompt_tokens": prompt, "completion_tokens": completion_tokens}
    return {**HEAD, "choices": [], "usage": {**counts, "total_tokens": prompt + completion_tokens}}


def text_chunks() -> list[dict[str, Any]]:
    return [
        first(),
        token({"content": "17 + 25"}),
        token({"content": " = 42"}, ids=2),
        token({}, finish="stop"),
        usage(12, 4),
    ]


# -- requests ---------------------------------------------------------------------------------


def test_a_system_string_becomes_the_first_system_message() -> None:
    chat = translated(system="You are terse.", messages=USER)
    assert chat.body["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 17 + 25?"},
    ]
    assert chat.model == MODEL
    assert chat.body["max_tokens"] == 64
    assert chat.stream is False


def test_system_blocks_are_joined_and_claude_codes_billing_line_dropped() -> None:
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.1.abc; cch=0f3a1;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "x-anthropic-billing-header: cch=12345;\nBe careful."},
    ]
    chat = translated(system=system, messages=USER)
    assert chat.body["messages"][0] == {
        "role": "system",
        "content": "You are Claude Code.\nBe careful.",
    }


def test_a_system_message_inside_messages_stays_in_place() -> None:
    messages: list[Any] = [
        *USER,
        {"role": "assistant", "content": "42"},
        {"role": "system", "content": [{"type": "text", "text": "Answer in French now."}]},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    chat = translated(messages=messages)
    assert [m["role"] for m in chat.body["messages"]] == ["user", "assistant", "system", "user"]
    assert chat.body["messages"][2]["content"] == "Answer in French now."


def test_multi_part_user_content_is_one_user_message() -> None:
    content = [
        {"type": "text", "text": "Here is a file:"},
        {"type": "text", "text": "print('hi')", "cache_control": {"type": "ephemeral"}},
    ]
    chat = translated(messages=[{"role": "user", "content": content}])
    assert chat.body["messages"] == [{"role": "user", "content": "Here is a file:\nprint('hi')"}]


def test_a_tool_loop_becomes_tool_calls_then_tool_messages() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris, and 17 + 25?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Two tools.", "signature": "sig"},
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "toolu_2",
                    "name": "calculator",
                    "input": {"expression": "17 + 25"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21°C"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [
                        {"type": "text", "text": "SyntaxError"},
                        {"type": "text", "text": "line 1"},
                    ],
                    "is_error": True,
                },
                {"type": "text", "text": "Go on."},
            ],
        },
    ]
    chat = translated(messages=messages, tools=[WEATHER, CALCULATOR])
    assert chat.body["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "toolu_2",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "17 + 25"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21°C"},
        {
            "role": "tool",
            "tool_call_id": "toolu_2",
            "content": TOOL_ERROR_PREFIX + "SyntaxError\nline 1",
        },
        {"role": "user", "content": "Go on."},
    ]


def test_an_assistant_turn_of_tool_calls_only_has_no_content() -> None:
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "calculator", "input": {}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
    ]
    chat = translated(messages=messages, tools=[CALCULATOR])
    assert chat.body["messages"][1]["content"] is None
    assert chat.body["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{}"
    assert chat.body["messages"][2:] == [{"role": "tool", "tool_call_id": "t1", "content": ""}]


def test_tools_become_function_tools() -> None:
    chat = translated(messages=USER, tools=[CALCULATOR, WEATHER])
    assert chat.body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "parameters": CALCULATOR["input_schema"],
                "description": "Evaluate an arithmetic expression.",
            },
        },
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": WEATHER["input_schema"]},
        },
    ]
    assert "tool_choice" not in chat.body


@pytest.mark.parametrize(
    ("tool_choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any"}, "required", None),
        (
            {"type": "tool", "name": "calculator"},
            {"type": "function", "function": {"name": "calculator"}},
            None,
        ),
        ({"type": "none"}, "none", None),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ],
)
def test_every_tool_choice_maps_to_openais(
    tool_choice: dict[str, Any], expected: object, parallel: bool | None
) -> None:
    chat = translated(messages=USER, tools=[CALCULATOR], tool_choice=tool_choice)
    assert chat.body["tool_choice"] == expected
    assert chat.body.get("parallel_tool_calls") == parallel


def test_tool_choice_auto_or_none_without_tools_asks_nothing() -> None:
    for choice in ({"type": "auto"}, {"type": "none"}):
        chat = translated(messages=USER, tool_choice=choice)
        assert "tools" not in chat.body and "tool_choice" not in chat.body


def test_stop_sequences_and_sampling_are_passed_on() -> None:
    # SDK 2.x has no sampling parameters of its own; older SDKs and raw HTTP send them.
    sampling = {"temperature": 0.7, "top_p": 0.9}
    chat = translated(messages=USER, stop_sequences=["###", "END"], extra_body=sampling)
    assert chat.body["stop"] == ["###", "END"]
    assert chat.body["temperature"] == 0.7
    assert chat.body["top_p"] == 0.9


def test_unset_sampling_is_left_to_the_engine() -> None:
    chat = translated(messages=USER)
    assert not {"stop", "temperature", "top_p", "tools", "stream_options"} & chat.body.keys()


def test_unknown_and_ignored_fields_do_not_reach_the_engine() -> None:
    chat = translated(
        messages=USER,
        metadata={"user_id": "u-1"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        service_tier="auto",
        output_config={"effort": "high"},
        extra_body={"not_an_anthropic_field": 1},
    )
    assert set(chat.body) == {"model", "messages", "max_tokens", "stream"}


def test_a_final_assistant_turn_is_continued() -> None:
    chat = translated(messages=[*USER, {"role": "assistant", "content": "The answer is"}])
    assert chat.body["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    assert chat.body["continue_final_message"] is True
    assert chat.body["add_generation_prompt"] is False


def test_a_streaming_request_asks_for_usage() -> None:
    chat = messages_to_chat({"model": MODEL, "max_tokens": 8, "messages": USER, "stream": True})
    assert chat.stream is True
    assert chat.body["stream"] is True
    assert chat.body["stream_options"] == {"include_usage": True}


BASE = {"model": MODEL, "max_tokens": 16, "messages": USER}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
TOOL_USE = {"type": "tool_use", "id": "t1", "name": "calculator", "input": {}}


def _with(**fields: Any) -> dict[str, Any]:
    return {key: value for key, value in {**BASE, **fields}.items() if value is not ...}


def _user(*content: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(content)}]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (_with(max_tokens=...), "max_tokens: Field required"),
        (_with(model=...), "model: Field required"),
        (_with(max_tokens="5"), "max_tokens: Input should be a valid integer"),
        (_with(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
        (
            _with(messages=[{"role": "tool", "content": "x"}]),
            "messages.0.role: Input should be 'user', 'assistant' or 'system'",
        ),
        (
            _with(messages=[{"role": "system", "content": [TOOL_USE]}, *USER]),
            "messages.0.content.0.type: 'tool_use' blocks do not belong in system messages",
        ),
        (
            _with(messages=_user({"type": "text", "text": "see"}, IMAGE)),
            "messages.0.content.1.type: 'image' is not supported by this engine",
        ),
        (
            _with(messages=_user({"type": "document", "source": {}})),
            "messages.0.content.0.type: 'document' is not supported by this engine",
        ),
        (
            _with(
                messages=[
                    *USER,
                    {"role": "assistant", "content": [TOOL_USE]},
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}
                        ],
                    },
                ]
            ),
            "messages.2.content.0.content.0.type: 'image' is not supported by this engine",
        ),
        (_with(top_k=-1), "top_k: Input should be greater than or equal to 0"),
        (
            _with(output_config={"format": {"type": "json_schema", "schema": {}}}),
            "output_config.format: structured output is not supported by this engine",
        ),
        (_with(temperature="0.5"), "temperature: Input should be a valid number"),
        (_with(temperature=1.5), "temperature: Input should be less than or equal to 1"),
        (_with(stream="yes"), "stream: Input should be a valid boolean"),
        (_with(stream=1), "stream: Input should be a valid boolean"),
        (_with(messages="hi"), "messages: Input should be a valid list"),
        (_with(messages=[]), "messages: List should have at least 1 item"),
        (
            _with(messages=[{"role": "user", "content": 5}]),
            "messages.0.content: must be a string or a list of content blocks",
        ),
        (
            _with(messages=_user({"type": "text", "text": 5})),
            "messages.0.content.0.text: Input should be a valid string",
        ),
        (_with(messages=_user({"type": "text"})), "messages.0.content.0.text: Field required"),
        (_with(messages=_user({"text": "no type"})), "messages.0.content.0.type: Field required"),
        (
            _with(
                messages=_user(
                    {"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}
                )
            ),
            "messages.0.content.0.type: 'server_tool_use' is not supported by this engine",
        ),
        (
            _with(messages=_user(TOOL_USE)),
            "messages.0.content.0.type: 'tool_use' blocks belong in assistant messages",
        ),
        (
            _with(messages=[*USER, {"role": "assistant", "content": [{**TOOL_USE, "input": [1]}]}]),
            "messages.1.content.0.input: Input should be a valid dictionary",
        ),
        (
            _with(
                messages=[
                    *USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_result", "tool_use_id": "t1"}],
                    },
                ]
            ),
            "messages.1.content.0.type: 'tool_result' blocks belong in user messages",
        ),
        (_with(system=5), "system: must be a string or a list of content blocks"),
        (
            _with(system=[{"type": "image", "source": {}}]),
            "system.0.type: 'image' is not supported by this engine",
        ),
        (_with(stop_sequences="###"), "stop_sequences: Input should be a valid list"),
        (
            _with(tools=[{"type": "bash_20250124", "name": "bash"}]),
            "tools.0.type: 'bash_20250124' tools are not supported by this engine",
        ),
        (
            _with(tools=[{**CALCULATOR, "input_schema": {"type": "array"}}]),
            "tools.0.input_schema: must be a JSON Schema with type 'object'",
        ),
        (_with(tools=[{"name": "calculator"}]), "tools.0.input_schema: Field required"),
        (_with(tools=[CALCULATOR, CALCULATOR]), "tools: tool names must be unique"),
        (
            _with(tools=[CALCULATOR], tool_choice={"type": "tool"}),
            "tool_choice.name: Field required",
        ),
        (
            _with(tools=[CALCULATOR], tool_choice={"type": "tool", "name": "search"}),
            "tool_choice.name: no tool named 'search' in tools",
        ),
        (
            _with(tools=[CALCULATOR], tool_choice={"type": "sometimes"}),
            "tool_choice.type: 'sometimes' is not supported by this engine",
        ),
        (_with(tool_choice={"type": "any"}), "tool_choice: type 'any' requires tools"),
    ],
)
def test_refusals_name_the_field_and_the_reason(body: dict[str, Any], message: str) -> None:
    with pytest.raises(GatewayError) as caught:
        messages_to_chat(body)
    err = caught.value
    assert err.status == 400
    assert str(err).startswith(message), str(err)
    assert ANTHROPIC.body(err.status, str(err), err.param, err.code) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": str(err)},
    }


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(GatewayError, match="the request body must be a JSON object"):
        messages_to_chat([BASE])


def test_top_k_is_passed_to_the_engine() -> None:
    chat = translated(messages=USER, extra_body={"top_k": 40})
    assert chat.body["top_k"] == 40
    assert "top_k" not in translated(messages=USER).body


def test_a_refusal_reaches_the_sdk_as_a_bad_request() -> None:
    def handler(request: httpx2.Request) -> httpx2.Response:
        try:
            messages_to_chat(json.loads(request.content))
        except GatewayError as err:
            body = ANTHROPIC.body(err.status, str(err), err.param, err.code)
            return httpx2.Response(err.status, json=body)
        raise AssertionError("the request should have been refused")

    structured = {"output_config": {"format": {"type": "json_schema", "schema": {}}}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client(handler).messages.create(
            model=MODEL, max_tokens=8, messages=USER, extra_body=structured
        )
    assert caught.value.type == "invalid_request_error"
    assert caught.value.api_message == (
        "output_config.format: structured output is not supported by this engine"
    )
    ErrorResponse.model_validate(caught.value.body)


# -- whole responses --------------------------------------------------------------------------


def test_a_text_completion_is_a_message_the_sdk_parses() -> None:
    sdk = client(answering(completion("17 + 25 = 42", prompt_ids=12, ids=5)))
    message = sdk.messages.create(model=MODEL, max_tokens=64, messages=USER)
    assert isinstance(message, Message)
    assert message.id == "msg_5f1e2d"
    assert message.model == MODEL
    assert message.role == "assistant"
    assert [b.type for b in message.content] == ["text"]
    assert text_of(message.content[0]) == "17 + 25 = 42"
    assert message.stop_reason == "end_turn"
    assert message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 5)


def test_tool_calls_are_tool_use_blocks_after_the_text() -> None:
    calls = [
        ("call_a1", "calculator", '{"expression": "17 + 25"}'),
        ("call_b2", "get_weather", '{"city": "Paris"}'),
    ]
    body = completion("Let me compute.", calls=calls, finish="tool_calls")
    message = client(answering(body)).messages.create(
        model=MODEL, max_tokens=64, messages=USER, tools=[CALCULATOR, WEATHER]
    )
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    tool = message.content[1]
    assert tool.type == "tool_use"
    assert (tool.id, tool.name, tool.input) == ("call_a1", "calculator", {"expression": "17 + 25"})
    assert input_of(message.content[2]) == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    # The harness sends the message back with its results; the ids lead to the engine's calls.
    results = [
        {"type": "tool_result", "tool_use_id": "call_a1", "content": "42"},
        {"type": "tool_result", "tool_use_id": "call_b2", "content": "Sunny"},
    ]
    follow_up = translated(
        messages=[*USER, message.to_param(), {"role": "user", "content": results}],
        tools=[CALCULATOR, WEATHER],
    )
    assert follow_up.body["messages"][1] == {
        "role": "assistant",
        "content": "Let me compute.",
        "tool_calls": [
            {
                "id": "call_a1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "17 + 25"}'},
            },
            {
                "id": "call_b2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
        ],
    }
    assert follow_up.body["messages"][2:] == [
        {"role": "tool", "tool_call_id": "call_a1", "content": "42"},
        {"role": "tool", "tool_call_id": "call_b2", "content": "Sunny"},
    ]


def test_only_tool_calls_means_no_text_block() -> None:
    body = completion(None, calls=[("call_1", "calculator", "{}")], finish="tool_calls")
    message = chat_to_message(body, model=MODEL)
    assert message["content"] == [
        {"type": "tool_use", "id": "call_1", "name": "calculator", "input": {}}
    ]
    Message.model_validate(message)


@pytest.mark.parametrize("arguments", ['{"expression": "17 +', "[1, 2]", "null"])
def test_tool_arguments_that_are_not_a_json_object_are_kept_raw(arguments: str) -> None:
    body = completion(None, calls=[("call_1", "calculator", arguments)], finish="tool_calls")
    message = client(answering(body)).messages.create(model=MODEL, max_tokens=64, messages=USER)
    assert input_of(message.content[0]) == {RAW_ARGUMENTS_KEY: arguments}


@pytest.mark.parametrize(
    ("finish", "matched", "calls", "reason", "sequence"),
    [
        ("stop", None, False, "end_turn", None),
        ("stop", 151645, False, "end_turn", None),  # a stop token id, not a stop sequence
        ("stop", "###", False, "stop_sequence", "###"),
        ("length", None, False, "max_tokens", None),
        ("length", None, True, "max_tokens", None),
        ("tool_calls", None, True, "tool_use", None),
        ("stop", None, True, "tool_use", None),  # vLLM finishes a forced tool call with "stop"
        ("content_filter", None, False, "refusal", None),
    ],
)
def test_each_finish_reason_maps_to_a_stop_reason(
    finish: str, matched: str | int | None, calls: bool, reason: str, sequence: str | None
) -> None:
    tool_calls = [("call_1", "calculator", "{}")] if calls else []
    body = completion("text", calls=tool_calls, finish=finish, stop_reason=matched)
    message = Message.model_validate(chat_to_message(body, model=MODEL))
    assert (message.stop_reason, message.stop_sequence) == (reason, sequence)


def test_usage_falls_back_to_token_ids() -> None:
    body = completion("hi", prompt_ids=7, ids=3)
    del body["usage"]
    message = chat_to_message(body, model=MODEL)
    assert message["usage"]["input_tokens"] == 7
    assert message["usage"]["output_tokens"] == 3


def test_a_completion_without_choices_is_an_error() -> None:
    with pytest.raises(ValueError, match="no choices"):
        chat_to_message({**completion("x"), "choices": []}, model=MODEL)


# -- streams ----------------------------------------------------------------------------------


def stream_events(handler: Handler, **create: Any) -> list[str]:
    """The event types the SDK yields for `create(stream=True)`."""
    body = {"model": MODEL, "max_tokens": 64, "messages": USER, **create}
    with client(handler).messages.create(**body, stream=True) as events:
        return [event.type for event in events]


def final_message(handler: Handler, **create: Any) -> tuple[str, Message]:
    """(streamed text, final message) through the SDK's `messages.stream` helper."""
    body = {"model": MODEL, "max_tokens": 64, "messages": USER, **create}
    with client(handler).messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def test_a_text_stream_is_anthropics_event_sequence() -> None:
    seen: list[dict[str, Any]] = []
    assert stream_events(streaming(text_chunks(), seen)) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for data in seen:
        EVENTS.validate_python(data)
    text, message = final_message(streaming(text_chunks()))
    assert text == "17 + 25 = 42"
    assert message.id == "msg_5f1e2d"
    assert message.model == MODEL
    assert text_of(message.content[0]) == "17 + 25 = 42"
    assert message.stop_reason == "end_turn"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (12, 4)


def test_a_tool_call_split_over_chunks_streams_as_one_tool_use_block() -> None:
    chunks = [
        first(),
        token(call_delta(0, "", "chatcmpl-tool-9", "get_weather")),
        token(call_delta(0, '{"city": ')),
        token(call_delta(0, '"Par')),
        token(call_delta(0, 'is"}')),
        token({}, finish="tool_calls"),
        usage(12, 5),
    ]
    seen: list[dict[str, Any]] = []
    assert stream_events(streaming(chunks, seen), tools=[WEATHER]) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    for data in seen:
        EVENTS.validate_python(data)
    assert seen[1]["content_block"] == {
        "type": "tool_use",
        "id": "chatcmpl-tool-9",
        "name": "get_weather",
        "input": {},
    }
    assert seen[2]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    _, message = final_message(streaming(chunks), tools=[WEATHER])
    assert message.content[0].type == "tool_use"
    assert message.content[0].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens == 5


def test_text_then_tool_calls_as_the_engine_streams_them() -> None:
    calls = {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_a1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "17 + 25"}'},
            },
            {
                "index": 1,
                "id": "call_b2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
        ]
    }
    chunks = [
        first(),
        token({"content": "Let me "}),
        token({"content": "compute."}),
        token({}, ids=30),  # the tool call's tokens: held back by the engine's parser
        {
            **HEAD,
            "choices": [
                {
                    "index": 0,
                    "delta": calls,
                    "logprobs": None,
                    "finish_reason": "tool_calls",
                    "stop_reason": None,
                }
            ],
        },
        usage(12, 32),
    ]
    seen: list[dict[str, Any]] = []
    types = stream_events(streaming(chunks, seen), tools=[CALCULATOR, WEATHER])
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert types == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        *block,
        *block,
        "message_delta",
        "message_stop",
    ]
    assert [d["index"] for d in seen if d["type"].startswith("content_block")] == [
        0,
        0,
        0,
        0,
        1,
        1,
        1,
        2,
        2,
        2,
    ]
    text, message = final_message(streaming(chunks), tools=[CALCULATOR, WEATHER])
    assert text == "Let me compute."
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert input_of(message.content[1]) == {"expression": "17 + 25"}
    assert tool_use(message.content[2]).id == "call_b2"
    assert message.stop_reason == "tool_use"
    assert message.usage.output_tokens == 32
    # Streamed or not, the harness gets the same message.
    whole = completion(
        "Let me compute.",
        calls=[
            ("call_a1", "calculator", '{"expression": "17 + 25"}'),
            ("call_b2", "get_weather", '{"city": "Paris"}'),
        ],
        finish="tool_calls",
        ids=32,
    )
    assert message.to_dict(exclude_none=True) == Message.model_validate(
        chat_to_message(whole, model=MODEL)
    ).to_dict(exclude_none=True)


def test_a_stream_counts_output_tokens_from_token_ids_and_input_from_the_prompt() -> None:
    # No usage chunk at all: the counts come from vLLM's token ids.
    chunks = [first(prompt_ids=9), token({"content": "a"}, ids=2), token({}, finish="stop", ids=1)]
    _, message = final_message(streaming(chunks))
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 3)


def test_a_stream_without_token_ids_takes_counts_from_the_usage_chunk() -> None:
    chunks = [
        first(prompt_ids=None),
        token({"content": "a"}, ids=None),
        token({}, finish="stop", ids=None),
        usage(21, 8),
    ]
    seen: list[dict[str, Any]] = []
    _, message = final_message(streaming(chunks, seen))
    assert seen[0]["message"]["usage"]["input_tokens"] == 0  # not known yet at the start
    assert (message.usage.input_tokens, message.usage.output_tokens) == (21, 8)


def test_a_stream_stopped_by_a_stop_sequence_says_which() -> None:
    chunks = [first(), token({"content": "one two"}), token({}, finish="stop", stop_reason="###")]
    _, message = final_message(streaming(chunks), stop_sequences=["###"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "###")


def test_a_stream_cut_at_max_tokens_says_so() -> None:
    chunks = [first(), token({"content": "one two"}, finish="length")]
    _, message = final_message(streaming(chunks), max_tokens=1)
    assert message.stop_reason == "max_tokens"


def test_malformed_streamed_arguments_reach_the_harness_raw() -> None:
    chunks = [
        first(),
        token(call_delta(0, '{"expression": ', "call_1", "calculator")),
        token(call_delta(0, "17 +")),
        token({}, finish="tool_calls"),
    ]
    _, message = final_message(streaming(chunks), tools=[CALCULATOR])
    assert input_of(message.content[0]) == {RAW_ARGUMENTS_KEY: '{"expression": 17 +'}


def test_an_engine_error_mid_stream_is_an_error_event() -> None:
    error = {"error": {"message": "engine overloaded", "type": "ServiceUnavailable", "code": 503}}
    chunks = [first(), token({"content": "a"}), error]
    with pytest.raises(anthropic.APIStatusError) as caught:
        final_message(streaming(chunks))
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "engine overloaded"},
    }


def test_a_stream_that_ends_early_is_an_error_event() -> None:
    stream = MessageStream(model=MODEL)
    stream.feed(first())
    stream.feed(token({"content": "a"}))
    assert stream.finish() == [
        (
            "error",
            {
                "type": "error",
                "error": {
                    "type": "api_error",
                    "message": "the engine's stream ended before the message was complete",
                },
            },
        )
    ]
    assert stream.finish() == []
    with pytest.raises(ValueError, match="over"):
        stream.feed(token({"content": "b"}))


def test_finish_is_idempotent_and_nothing_follows_it() -> None:
    stream = MessageStream(model=MODEL)
    for chunk in text_chunks():
        stream.feed(chunk)
    assert [name for name, _ in stream.finish()] == ["message_delta", "message_stop"]
    assert stream.finish() == []
    with pytest.raises(ValueError, match="over"):
        stream.feed(usage(1, 1))


def test_a_tool_call_that_resumes_after_another_is_refused() -> None:
    stream = MessageStream(model=MODEL)
    stream.feed(first())
    stream.feed(token(call_delta(0, "{", "call_1", "calculator")))
    stream.feed(token(call_delta(1, "{}", "call_2", "get_weather")))
    with pytest.raises(ValueError, match="resumed"):
        stream.feed(token(call_delta(0, "}")))


def test_encode_sse_writes_one_event() -> None:
    assert encode_sse("message_stop", {"type": "message_stop"}) == (
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )


# -- engine errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type", "sdk_error"),
    [
        (400, "invalid_request_error", anthropic.BadRequestError),
        (401, "authentication_error", anthropic.AuthenticationError),
        (403, "permission_error", anthropic.PermissionDeniedError),
        (404, "not_found_error", anthropic.NotFoundError),
        (413, "request_too_large", anthropic.APIStatusError),
        (422, "invalid_request_error", anthropic.UnprocessableEntityError),
        (429, "rate_limit_error", anthropic.RateLimitError),
        (500, "api_error", anthropic.InternalServerError),
        (503, "overloaded_error", anthropic.InternalServerError),
        (504, "timeout_error", anthropic.InternalServerError),
        (529, "overloaded_error", anthropic.OverloadedError),
    ],
)
def test_engine_errors_become_anthropics(
    status: int, error_type: str, sdk_error: type[anthropic.APIStatusError]
) -> None:
    openai_body = {"error": {"message": "it went wrong", "type": "X", "param": None, "code": None}}
    mapped_status, body = chat_error_to_anthropic(status, openai_body)
    assert mapped_status == status
    assert body == {"type": "error", "error": {"type": error_type, "message": "it went wrong"}}

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(mapped_status, json=body)

    with pytest.raises(sdk_error) as caught:
        client(handler).messages.create(model=MODEL, max_tokens=8, messages=USER)
    assert caught.value.status_code == status
    assert (caught.value.type, caught.value.api_message) == (error_type, "it went wrong")


def test_engine_error_messages_in_other_shapes_are_kept() -> None:
    flat = {"object": "error", "message": "bad thing", "type": "BadRequestError", "code": 400}
    assert chat_error_to_anthropic(400, flat)[1]["error"]["message"] == "bad thing"
    assert (
        chat_error_to_anthropic(422, {"detail": "unprocessable"})[1]["error"]["message"]
        == "unprocessable"
    )
    generic = {"type": "api_error", "message": "the engine answered HTTP 502"}
    for body in (None, "", [1, 2], {"error": 5}):
        assert chat_error_to_anthropic(502, body)[1]["error"] == generic
    # A body that is not JSON is its own message (render_engine hands it over as text).
    answer = render_engine(ANTHROPIC, 502, b"<html>bad gateway</html>")
    assert (answer.status, orjson.loads(answer.body)) == (
        502,
        {"type": "error", "error": {"type": "api_error", "message": "<html>bad gateway</html>"}},
    )
    assert orjson.loads(render_engine(ANTHROPIC, 502, b"").body)["error"] == generic


def test_a_context_length_error_reads_as_a_prompt_too_long() -> None:
    message = (
        "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens"
    )
    status, body = chat_error_to_anthropic(
        400, {"error": {"message": message, "code": "context_length_exceeded"}}
    )
    assert status == 400
    assert body["error"]["message"] == "prompt is too long: " + message
