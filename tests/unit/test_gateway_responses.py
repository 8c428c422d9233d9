"""OpenAI's Responses API over the engine's chat completions, checked against the real
`openai` SDK.

Requests are built by the SDK itself and captured at the transport (`httpx2.MockTransport`
stands in for the network only); responses and stream events translated by the gateway are
validated with the SDK's own pydantic models. The engine's answers are written here in the
shapes of services/inference/engine_chat.py and vLLM (tool calls streamed in pieces): no model runs
in a unit test.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import orjson
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent

from harnessrl.episode_token import EpisodeClaims
from harnessrl.services.gateway.dialects.responses import ResponsesDialect
from harnessrl.services.gateway.dialects.responses_output import Echo, chat_to_response
from harnessrl.services.gateway.dialects.responses_request import (
    Translation,
    responses_to_chat,
)
from harnessrl.services.gateway.dialects.responses_store import ResponseStore, Stored
from harnessrl.services.gateway.dialects.responses_stream import ResponseStream
from harnessrl.services.gateway.errors import OPENAI, GatewayError
from harnessrl.services.inference.protocol import ChatCompletionRequest
from tests.unit.test_gateway_request_fuzz import mutated

MODEL = "gpt-5-codex"
CLAIMS = EpisodeClaims("ep", 1, "g", "train", time.time() + 86_400)
OTHER = EpisodeClaims("other", 1, "g", "train", time.time() + 86_400)
SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}}
CALC = {"type": "function", "name": "calc", "description": "Adds.", "parameters": SCHEMA}
WEATHER = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
SPAWN = {"type": "function", "name": "spawn_agent", "parameters": {"type": "object"}}
AGENTS = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [SPAWN]}
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {"input": {"type": "string"}},
    "required": ["input"],
}
RESPONSE = pydantic.TypeAdapter(Response)
EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def sent_by_sdk(**create: Any) -> dict[str, Any]:
    """The JSON body the SDK sends for `responses.create(**create)` (answered by the
    gateway's translation of a one-word completion, which the SDK must parse)."""
    captured: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        captured.append(body)
        answer = chat_to_response(completion("ok"), echo_for(body, translate(body)))
        return httpx2.Response(200, json=answer)

    sdk = openai.OpenAI(
        api_key="sk-test",
        base_url="http://gateway.test/e/token/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    sdk.responses.create(**{"model": MODEL, **create})
    return captured[0]


def translate(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> Translation:
    return responses_to_chat(body, history or [])


def translated(**create: Any) -> Translation:
    """The translation of what the SDK sends; the engine's own validation accepts it."""
    translation = translate(sent_by_sdk(**create))
    ChatCompletionRequest.model_validate(translation.chat)
    return translation


def echo_for(body: dict[str, Any], translation: Translation) -> Echo:
    return Echo(body, body["model"], translation.custom_tools, translation.namespaces)


def refused(body: dict[str, Any], **options: Any) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        responses_to_chat({"model": MODEL, **body}, [], **options)
    assert caught.value.status == 400
    return caught.value


# -- the engine's answers ----------------------------------------------------------------------

CHAT_ID = "chatcmpl-7d3f0a"


@pytest.fixture(autouse=True)
def fixed_response_ids(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Responses get fresh random ids; the tests that compare whole items fix the id to
    `resp_7d3f0a` (what is derived from it stays what is checked)."""
    if "fresh_ids" in request.keywords:
        return
    from harnessrl.services.gateway.dialects import responses, responses_output

    for module in (responses_output, responses):
        monkeypatch.setattr(module, "response_id", lambda: "resp_7d3f0a")


@pytest.mark.fresh_ids
def test_every_response_gets_an_id_of_its_own_even_for_a_repeated_engine_answer() -> None:
    body = {"model": MODEL, "input": "17 + 25?"}
    echo = echo_for(body, translate(body))
    first = chat_to_response(completion("42"), echo)
    again = chat_to_response(completion("42"), echo)
    assert first["id"] != again["id"] and first["id"].startswith("resp_")
    assert first["output"][0]["id"] != again["output"][0]["id"]


CREATED = 1_700_000_000
HEAD = {"id": CHAT_ID, "object": "chat.completion.chunk", "created": CREATED, "model": "tiny"}


def completion(
    content: str | None,
    *,
    calls: list[tuple[str, str, str]] | None = None,  # (id, name, arguments)
    reasoning: str | None = None,
    finish: str = "stop",
    prompt_ids: int = 12,
    ids: int = 5,
    usage: bool = True,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in calls
        ]
    answer: dict[str, Any] = {
        "id": CHAT_ID,
        "object": "chat.completion",
        "created": CREATED,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "token_ids": list(range(ids)),
                "logprobs": None,
            }
        ],
        "prompt_token_ids": list(range(prompt_ids)),
    }
    if usage:
        answer["usage"] = {
            "prompt_tokens": prompt_ids,
            "completion_tokens": ids,
            "total_tokens": prompt_ids + ids,
        }
    return answer


# -- requests ----------------------------------------------------------------------------------


def test_a_string_input_is_one_user_message() -> None:
    translation = translated(input="What is 17 + 25?")
    assert translation.chat == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is 17 + 25?"}],
        "stream": False,
    }
    assert translation.items == [{"type": "message", "role": "user", "content": "What is 17 + 25?"}]
    assert translation.dropped == ()


def test_input_text_parts_are_joined_into_one_message() -> None:
    parts = [
        {"type": "input_text", "text": "Here is a file:"},
        {"type": "input_text", "text": "print('hi')"},
    ]
    translation = translated(input=[{"role": "user", "content": parts}])
    assert translation.chat["messages"] == [
        {"role": "user", "content": "Here is a file:\nprint('hi')"}
    ]


def test_instructions_come_first_as_a_system_message_and_developer_is_system() -> None:
    translation = translated(
        instructions="Be terse.",
        input=[
            {"role": "developer", "content": "Use the calculator."},
            {"role": "user", "content": "What is 17 + 25?"},
        ],
    )
    assert translation.chat["messages"] == [
        {"role": "system", "content": "Be terse."},
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 17 + 25?"},
    ]
    history = [{"type": "message", "role": "user", "content": "Earlier."}]
    chained = translate({"model": MODEL, "instructions": "Be terse.", "input": "Now."}, history)
    assert [m["content"] for m in chained.chat["messages"]] == ["Be terse.", "Earlier.", "Now."]
    assert chained.items == [{"type": "message", "role": "user", "content": "Now."}]


def test_function_calls_join_the_assistant_message_before_them() -> None:
    translation = translated(
        input=[
            {"role": "user", "content": "Weather in Paris, and 17 + 25?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"c": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "calc", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "42"}],
            },
        ],
        tools=[CALC, WEATHER],
    )
    assert translation.chat["messages"][1:] == [
        {
            "role": "assistant",
            "content": "Let me check.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"c": 1}'},
                },
                {"id": "c2", "type": "function", "function": {"name": "calc", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "42"},
    ]


def test_a_function_call_with_no_assistant_message_before_it_starts_one() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"}
    translation = translated(input=[{"role": "user", "content": "17 + 25?"}, call])
    assert translation.chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
        ],
    }


def test_custom_tools_are_function_tools_taking_one_input_string() -> None:
    translation = translated(input="Fix the bug.", tools=[APPLY_PATCH, CALC])
    assert translation.chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "apply_patch",
                "description": "Apply a patch.",
                "parameters": CUSTOM_PARAMETERS,
            },
        },
        {
            "type": "function",
            "function": {"name": "calc", "description": "Adds.", "parameters": SCHEMA},
        },
    ]
    assert translation.custom_tools == frozenset({"apply_patch"})


def test_a_custom_tool_call_round_trips_as_its_input_string() -> None:
    body = {"model": MODEL, "input": "Fix the bug.", "tools": [APPLY_PATCH]}
    translation = translate(body)
    patch = '*** Begin Patch\n*** Update File: a.py\n+print("hi")\n*** End Patch'
    engine = completion(
        None,
        calls=[("call_p", "apply_patch", json.dumps({"input": patch}))],
        finish="tool_calls",
    )
    response = chat_to_response(engine, echo_for(body, translation))
    call = response["output"][0]
    assert call == {
        "type": "custom_tool_call",
        "id": "ctc_7d3f0a_0",
        "call_id": "call_p",
        "name": "apply_patch",
        "input": patch,
        "status": "completed",
    }
    output = {"type": "custom_tool_call_output", "call_id": "call_p", "output": "Done!"}
    follow_up = translate({**body, "input": [*translation.items, call, output]})
    assistant, tool = follow_up.chat["messages"][1:]
    assert assistant["content"] is None
    [sent] = assistant["tool_calls"]
    assert (sent["id"], sent["function"]["name"]) == ("call_p", "apply_patch")
    assert json.loads(sent["function"]["arguments"]) == {"input": patch}
    assert tool == {"role": "tool", "tool_call_id": "call_p", "content": "Done!"}


def test_namespace_tools_are_flattened_into_functions_and_calls_name_their_namespace() -> None:
    body = {"model": MODEL, "input": "Delegate.", "tools": [AGENTS, CALC]}
    translation = translate(body)
    names = [t["function"]["name"] for t in translation.chat["tools"]]
    assert names == ["spawn_agent", "calc"]
    assert translation.namespaces == {"spawn_agent": "agents"}
    engine = completion(
        None,
        calls=[("c1", "spawn_agent", "{}"), ("c2", "calc", "{}")],
        finish="tool_calls",
    )
    response = chat_to_response(engine, echo_for(body, translation))
    assert response["output"][0]["namespace"] == "agents"
    assert "namespace" not in response["output"][1]
    inner = {**AGENTS, "tools": [SPAWN, {"type": "web_search"}]}
    assert refused({"input": "x", "tools": [inner]}).param == "tools.0.tools.1.type"


HOSTED = [
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "tool_search"},
    {"type": "code_interpreter", "container": {"type": "auto"}},
]


def test_hosted_tools_are_left_out_by_default() -> None:
    translation = translate({"model": MODEL, "input": "x", "tools": [HOSTED[0], CALC, *HOSTED[1:]]})
    assert [t["function"]["name"] for t in translation.chat["tools"]] == ["calc"]
    assert translation.dropped == ("web_search", "file_search", "tool_search", "code_interpreter")
    only_hosted = translate({"model": MODEL, "input": "x", "tools": HOSTED})
    assert "tools" not in only_hosted.chat
    counted: list[str] = []  # the gateway counts them in harnessrl_gateway_tools_dropped
    dialect = ResponsesDialect(ResponseStore(1), on_dropped=counted.append)
    dialect.translate({"model": MODEL, "input": "x", "tools": HOSTED}, CLAIMS)
    assert counted == ["web_search", "file_search", "tool_search", "code_interpreter"]


@pytest.mark.parametrize("hosted", HOSTED, ids=lambda tool: tool["type"])
def test_hosted_tools_are_refused_naming_the_tool_when_not_dropped(hosted: dict[str, Any]) -> None:
    err = refused({"input": "x", "tools": [CALC, hosted]}, drop_unserved=False)
    assert err.param == "tools.1.type"
    assert str(err).startswith(f"tools.1.type: {hosted['type']!r} is a hosted tool")


@pytest.mark.parametrize(
    ("choice", "expected", "tools"),
    [
        ("auto", "auto", ["calc", "weather", "apply_patch"]),
        ("none", "none", ["calc", "weather", "apply_patch"]),
        ("required", "required", ["calc", "weather", "apply_patch"]),
        (
            {"type": "function", "name": "calc"},
            {"type": "function", "function": {"name": "calc"}},
            ["calc", "weather", "apply_patch"],
        ),
        (
            {"type": "custom", "name": "apply_patch"},
            {"type": "function", "function": {"name": "apply_patch"}},
            ["calc", "weather", "apply_patch"],
        ),
        (
            {
                "type": "allowed_tools",
                "mode": "auto",
                "tools": [{"type": "function", "name": "calc"}],
            },
            "auto",
            ["calc"],
        ),
        (
            {
                "type": "allowed_tools",
                "mode": "required",
                "tools": [
                    {"type": "function", "name": "weather"},
                    {"type": "custom", "name": "apply_patch"},
                ],
            },
            "required",
            ["weather", "apply_patch"],
        ),
    ],
)
def test_every_tool_choice_maps_to_chats(choice: Any, expected: Any, tools: list[str]) -> None:
    translation = translated(input="x", tools=[CALC, WEATHER, APPLY_PATCH], tool_choice=choice)
    assert translation.chat["tool_choice"] == expected
    assert [t["function"]["name"] for t in translation.chat["tools"]] == tools


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        (
            {"tools": [CALC], "tool_choice": {"type": "function", "name": "search"}},
            "tool_choice.name",
            "no tool named 'search' in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        ({"tools": [CALC], "tool_choice": "sometimes"}, "tool_choice", "must be auto"),
        ({"tools": [CALC], "tool_choice": {"type": "mcp"}}, "tool_choice.type", "'mcp'"),
        (
            {"tools": [CALC], "tool_choice": {"type": "allowed_tools", "tools": [], "mode": "x"}},
            "tool_choice.mode",
            "must be auto or required",
        ),
    ],
)
def test_a_bad_tool_choice_is_refused(fields: dict[str, Any], param: str, message: str) -> None:
    err = refused({"input": "x", **fields})
    assert err.param == param
    assert str(err).startswith(f"{param}: {message}"), str(err)


def test_max_output_tokens_is_the_chat_budget_and_sampling_is_passed_on() -> None:
    translation = translated(input="x", max_output_tokens=256, temperature=0.7, top_p=0.9)
    assert translation.chat["max_tokens"] == 256
    assert (translation.chat["temperature"], translation.chat["top_p"]) == (0.7, 0.9)
    assert "max_output_tokens" not in translation.chat
    assert "max_tokens" not in translated(input="x").chat


def test_a_streaming_request_asks_for_usage() -> None:
    chat = translate({"model": MODEL, "input": "x", "stream": True}).chat
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_a_json_schema_text_format_is_a_response_format() -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    # vLLM serves structured output; the project's own engine does not, so no engine check.
    translation = translate(sent_by_sdk(input="x", text={"format": fmt}))
    assert translation.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": schema, "strict": True},
    }
    json_object = translate(
        {"model": MODEL, "input": "x", "text": {"format": {"type": "json_object"}}}
    )
    assert json_object.chat["response_format"] == {"type": "json_object"}
    plain = translate({"model": MODEL, "input": "x", "text": {"format": {"type": "text"}}})
    assert "response_format" not in plain.chat


def test_reasoning_items_become_the_next_assistant_messages_reasoning_content() -> None:
    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": "Add them."}],
        "content": [{"type": "reasoning_text", "text": "17 + 25 is 42."}],
    }
    summary_only = {**reasoning, "content": None}
    call = {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"}
    translation = translated(
        input=[
            {"role": "user", "content": "17 + 25?"},
            reasoning,
            {"type": "message", "role": "assistant", "content": "42"},
            {"role": "user", "content": "Check it."},
            summary_only,
            call,
        ]
    )
    messages = translation.chat["messages"]
    assert messages[1] == {
        "role": "assistant",
        "content": "42",
        "reasoning_content": "17 + 25 is 42.",
    }
    assert messages[3]["reasoning_content"] == "Add them."
    assert messages[3]["tool_calls"][0]["id"] == "c1"


@pytest.mark.parametrize(
    ("content", "param"),
    [
        (
            [{"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "x"}],
            "input.0.content.1.type",
        ),
        ([{"type": "input_file", "file_id": "file-1"}], "input.0.content.0.type"),
        ([{"type": "input_audio", "input_audio": {}}], "input.0.content.0.type"),
    ],
)
def test_images_files_and_audio_are_refused_naming_the_part(
    content: list[dict[str, Any]], param: str
) -> None:
    err = refused({"input": [{"role": "user", "content": content}]})
    assert err.param == param
    assert "not supported by this engine" in str(err)


CALL = {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"model": None}, "model"),
        ({"model": 5}, "model"),
        ({"model": "m" * 257}, "model"),
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input.0"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": [{"role": "user", "content": 5}]}, "input.0.content"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
            "input.0.content.0.text",
        ),
        ({"input": [{**CALL, "arguments": {}}]}, "input.0.arguments"),
        ({"input": [{**CALL, "call_id": ""}]}, "input.0.call_id"),
        ({"input": [{**CALL, "name": None}]}, "input.0.name"),
        ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input.0.output"),
        (
            {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p", "input": 1}]},
            "input.0.input",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
        ({"input": [{"type": "reasoning", "summary": "no"}]}, "input.0.summary"),
        ({"instructions": ["be terse"]}, "instructions"),
        ({"stream": "yes"}, "stream"),
        ({"store": 1}, "store"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": "64"}, "max_output_tokens"),
        ({"max_output_tokens": True}, "max_output_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": False}, "top_p"),
        ({"text": "json"}, "text"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tools": {"calc": CALC}}, "tools"),
        ({"tools": [{**CALC, "parameters": "object"}]}, "tools.0.parameters"),
        ({"tools": [{**CALC, "name": ""}]}, "tools.0.name"),
        ({"tools": [CALC, CALC]}, "tools"),
        ({"tools": [{"name": "calc"}]}, "tools.0.type"),
        ({"tools": [{**AGENTS, "tools": None}]}, "tools.0.tools"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    body = {"model": MODEL, "input": "x", **fields}
    with pytest.raises(GatewayError) as caught:
        responses_to_chat(body, [])
    err = caught.value
    assert (err.status, err.param) == (400, param)
    assert str(err).startswith(f"{param}: ")
    shaped = OPENAI.body(err.status, str(err), err.param, err.code)
    assert shaped["error"]["type"] == "invalid_request_error" and shaped["error"]["param"] == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"role": ["user"], "content": "x"}]}, "input.0.role"),
        ({"tools": [CALC], "tool_choice": {"type": "function", "name": ["calc"]}}, "tool_choice"),
        (
            {"tools": [CALC], "tool_choice": {"type": "allowed_tools", "tools": [{"name": {}}]}},
            "tool_choice.tools",
        ),
    ],
    ids=["role", "tool_choice.name", "allowed_tools.name"],
)
def test_a_name_that_is_not_a_string_is_refused_as_a_400(
    fields: dict[str, Any], param: str
) -> None:
    """Regression: a list or object where a role or tool name goes was looked up in a dict
    or set and raised TypeError (unhashable), which the harness saw as a 500."""
    with pytest.raises(GatewayError) as caught:
        responses_to_chat({"model": MODEL, "input": "x", **fields}, [])
    assert caught.value.status == 400
    assert (caught.value.param or "").startswith(param)


RESPONSES_BODY: dict[str, Any] = {
    "model": MODEL,
    "instructions": "You add numbers.",
    "previous_response_id": "resp_prev",
    "input": [
        {"role": "developer", "content": "Use the calculator."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "17+25?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "Use calc."}],
            "content": [{"type": "reasoning_text", "text": "calc it"}],
        },
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Ok."}],
        },
        {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": '{"e": "17+25"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
        {
            "type": "custom_tool_call_output",
            "call_id": "c2",
            "output": [{"type": "input_text", "text": "Done"}],
        },
    ],
    "tools": [CALC, APPLY_PATCH, AGENTS, {"type": "web_search"}],
    "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"name": "calc"}]},
    "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
    "max_output_tokens": 64,
    "temperature": 0.5,
    "top_p": 0.9,
    "stream": True,
    "store": True,
    "parallel_tool_calls": True,
    "metadata": {"k": "v"},
    "reasoning": {"effort": "low"},
    "seed": 1,
    "stop": ["\n\n"],
}


@settings(max_examples=400, deadline=None)
@given(mutated(RESPONSES_BODY), st.booleans())
def test_a_responses_request_with_any_value_anywhere_is_translated_or_refused_as_a_400(
    body: dict[str, Any], drop: bool
) -> None:
    store = ResponseStore(8)
    earlier = chat_to_response(completion("42"), Echo({}, MODEL, frozenset(), {}))
    earlier["id"] = "resp_prev"
    store.put(("ep", 1), Stored(earlier, [{"role": "user", "content": "Hi"}], None, 1e12))
    try:
        call = ResponsesDialect(store, drop_unserved=drop).translate(body, CLAIMS)
    except GatewayError as err:
        assert err.status == 400 and str(err)
        assert OPENAI.body(err.status, str(err), err.param, err.code)["error"]["message"]
        return
    chat = call.body
    orjson.dumps(chat)  # sendable as it is
    assert chat["model"] == body["model"] == call.model
    assert chat["stream"] is call.stream
    assert chat["messages"], "an engine request needs a message"
    for message in chat["messages"]:
        assert message["role"] in ("system", "user", "assistant", "tool")
        content = message.get("content")
        assert isinstance(content, str) or (content is None and message.get("tool_calls"))


# -- whole responses -----------------------------------------------------------------------------


def test_a_text_completion_is_a_completed_response_with_one_message() -> None:
    body = {"model": MODEL, "input": "17 + 25?"}
    echo = echo_for(body, translate(body))
    response = chat_to_response(completion("42", prompt_ids=12, ids=5), echo)
    assert (response["id"], response["object"], response["status"]) == (
        "resp_7d3f0a",
        "response",
        "completed",
    )
    assert response["created_at"] == CREATED and response["model"] == MODEL
    assert response["output"] == [
        {
            "type": "message",
            "id": "msg_7d3f0a",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "42", "annotations": [], "logprobs": []}],
        }
    ]
    assert response["incomplete_details"] is None and response["error"] is None
    # The same answer renders the same response (its fresh ids aside).
    assert chat_to_response(completion("42", prompt_ids=12, ids=5), echo) == response


def test_tool_calls_are_function_call_and_custom_tool_call_items_after_the_text() -> None:
    body = {"model": MODEL, "input": "x", "tools": [CALC, APPLY_PATCH]}
    engine = completion(
        "Let me compute.",
        calls=[("call_a", "calc", '{"expression": "17 + 25"}'), ("", "apply_patch", "raw patch")],
        finish="tool_calls",
    )
    response = chat_to_response(engine, echo_for(body, translate(body)))
    assert [item["type"] for item in response["output"]] == [
        "message",
        "function_call",
        "custom_tool_call",
    ]
    assert response["output"][1] == {
        "type": "function_call",
        "id": "fc_7d3f0a_0",
        "call_id": "call_a",
        "name": "calc",
        "arguments": '{"expression": "17 + 25"}',
        "status": "completed",
    }
    custom = response["output"][2]
    # No engine call id: one is derived; arguments that are not {"input": ...} pass as they are.
    assert (custom["id"], custom["call_id"], custom["input"]) == (
        "ctc_7d3f0a_1",
        "call_7d3f0a_1",
        "raw patch",
    )
    assert response["status"] == "completed"


def test_reasoning_comes_first_as_a_reasoning_item() -> None:
    body = {"model": MODEL, "input": "x"}
    engine = completion("42", reasoning="17 + 25 is 42.")
    response = chat_to_response(engine, echo_for(body, translate(body)))
    assert response["output"][0] == {
        "type": "reasoning",
        "id": "rs_7d3f0a",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "17 + 25 is 42."}],
    }
    assert [item["type"] for item in response["output"]] == ["reasoning", "message"]


def test_a_completion_cut_by_its_budget_is_incomplete() -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 5}
    response = chat_to_response(
        completion("one two", finish="length"), echo_for(body, translate(body))
    )
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["max_output_tokens"] == 5


def test_usage_is_in_responses_words_and_falls_back_to_token_ids() -> None:
    body = {"model": MODEL, "input": "x"}
    echo = echo_for(body, translate(body))
    expected = {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 10,
    }
    assert chat_to_response(completion("hi", prompt_ids=7, ids=3), echo)["usage"] == expected
    counted = chat_to_response(completion("hi", prompt_ids=7, ids=3, usage=False), echo)
    assert counted["usage"] == expected


ECHOED: dict[str, Any] = {
    "model": MODEL,
    "input": "x",
    "instructions": "Be terse.",
    "max_output_tokens": 64,
    "previous_response_id": "resp_1",
    "reasoning": {"effort": "low"},
    "text": {"format": {"type": "text"}},
    "tools": [CALC],
    "tool_choice": "required",
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "u-1",
    "metadata": {"run": "7"},
    "store": False,
    "parallel_tool_calls": False,
}


def test_a_response_echoes_its_request() -> None:
    body = ECHOED
    response = chat_to_response(completion("hi"), echo_for(body, translate(body)))
    for name in ("instructions", "max_output_tokens", "previous_response_id", "reasoning"):
        assert response[name] == body[name], name
    for name in ("text", "tools", "tool_choice", "temperature", "top_p", "user", "metadata"):
        assert response[name] == body[name], name
    assert response["store"] is False and response["parallel_tool_calls"] is False
    defaults = chat_to_response(completion("hi"), Echo({"model": MODEL}, MODEL, frozenset(), {}))
    assert (defaults["store"], defaults["parallel_tool_calls"], defaults["tools"]) == (
        True,
        True,
        [],
    )
    assert defaults["instructions"] is None and defaults["previous_response_id"] is None


# -- streams ---------------------------------------------------------------------------------------


def first_chunk(prompt_ids: int = 12) -> dict[str, Any]:
    delta = {"role": "assistant", "content": ""}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return {**HEAD, "choices": [choice], "prompt_token_ids": list(range(prompt_ids))}


def token(delta: dict[str, Any], *, finish: str | None = None, ids: int = 1) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": finish,
        "token_ids": list(range(ids)),
    }
    if finish is not None:
        choice["stop_reason"] = None
    return {**HEAD, "choices": [choice]}


def call_piece(
    arguments: str, call_id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
    if call_id is not None:
        call.update(id=call_id, type="function")
        call["function"]["name"] = name
    return {"tool_calls": [call]}


def usage_chunk(prompt: int, completion_tokens: int) -> dict[str, Any]:
    counts = {"prompt_tokens": prompt, "completion_tokens": completion_tokens}
    return {**HEAD, "choices": [], "usage": {**counts, "total_tokens": prompt + completion_tokens}}


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """The events of a Responses SSE stream (`event: X\\ndata: {...}\\n\\n`), each checked
    to name its own type."""
    assert raw.endswith(b"\n\n")
    events = []
    for block in raw.split(b"\n\n")[:-1]:
        head, data = block.split(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: ")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert event["type"] == head.removeprefix(b"event: ").decode()
        events.append(event)
    return events


def streamed(
    body: dict[str, Any], chunks: list[dict[str, Any]], end: Callable[[ResponseStream], bytes]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(events, responses handed to on_done) for `chunks` then `end` (finish or fail)."""
    done: list[dict[str, Any]] = []
    stream = ResponseStream(echo_for(body, translate(body)), done.append, "resp_7d3f0a")
    raw = b"".join(stream.feed(chunk) for chunk in chunks) + end(stream)
    return sse_events(raw), done


def check_sequence(events: list[dict[str, Any]]) -> None:
    """What every stream holds to: sequence numbers count from 0, items open at consecutive
    output indexes and their events name the open item, the deltas of an item add up to its
    done text or arguments, and the final response holds the items as they were done."""
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    open_items: dict[int, str] = {}
    deltas: dict[str, list[str]] = {}
    next_index = 0
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert event["output_index"] == next_index
            next_index += 1
            open_items[event["output_index"]] = event["item"]["id"]
        elif "item_id" in event:
            assert open_items.get(event["output_index"]) == event["item_id"], event
        if kind.endswith(".delta"):
            deltas.setdefault(event["item_id"], []).append(event["delta"])
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert "".join(deltas.pop(event["item_id"], [])) == event["text"]
        elif kind == "response.function_call_arguments.done":
            assert "".join(deltas.pop(event["item_id"], [])) == event["arguments"]
        elif kind == "response.custom_tool_call_input.done":
            assert "".join(deltas.pop(event["item_id"], [])) == event["input"]
        elif kind == "response.output_item.done":
            assert open_items.pop(event["output_index"]) == event["item"]["id"]
    final = events[-1]
    if final["type"] != "response.failed":
        assert not open_items and not deltas
        items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        assert final["response"]["output"] == items


TOOL_STREAM = [
    first_chunk(),
    token({"reasoning_content": "The user wants "}),
    token({"reasoning_content": "a sum."}),
    token({"content": "Let me "}),
    token({"content": "compute."}, ids=2),
    token(call_piece("", "call_9", "calc")),
    token(call_piece('{"expression": ')),
    token(call_piece('"17 + 25"}')),
    token({}, finish="tool_calls"),
    usage_chunk(12, 9),
]
TOOL_STREAM_WHOLE = completion(
    "Let me compute.",
    reasoning="The user wants a sum.",
    calls=[("call_9", "calc", '{"expression": "17 + 25"}')],
    finish="tool_calls",
    prompt_ids=12,
    ids=9,
)
ITEM = ["response.output_item.added", "response.content_part.added"]
ITEM_DONE = ["response.content_part.done", "response.output_item.done"]


def test_a_stream_is_the_responses_event_sequence_and_ends_with_the_whole_response() -> None:
    body = {"model": MODEL, "input": "17 + 25?", "tools": [CALC], "stream": True}
    events, done = streamed(body, TOOL_STREAM, ResponseStream.finish)
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        *ITEM,
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        *ITEM_DONE,
        *ITEM,
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        *ITEM_DONE,
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    check_sequence(events)
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    # Streamed or not, the harness gets the same response, and it is stored once.
    whole = chat_to_response(TOOL_STREAM_WHOLE, echo_for(body, translate(body)))
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message", "function_call"]
    assert events[-1]["response"] == whole
    assert done == [whole]


WHOLE_CALLS = [
    {
        "index": 0,
        "id": "call_a",
        "type": "function",
        "function": {"name": "calc", "arguments": "{}"},
    },
    {
        "index": 1,
        "id": "call_b",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"c": 1}'},
    },
]
WHOLE_CALLS_STREAM = [
    first_chunk(),
    token({}, ids=20),  # the calls' tokens, held back by the engine's tool parser
    token({"tool_calls": WHOLE_CALLS}, finish="tool_calls"),
    usage_chunk(12, 21),
]


def test_tool_calls_sent_whole_in_the_last_chunk_stream_as_one_item_each() -> None:
    # The project's engine sends the parsed calls with the finish, as one chunk.
    body = {"model": MODEL, "input": "x", "tools": [CALC, WEATHER], "stream": True}
    events, done = streamed(body, WHOLE_CALLS_STREAM, ResponseStream.finish)
    check_sequence(events)
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["call_id"], i["arguments"]) for i in items] == [
        ("call_a", "{}"),
        ("call_b", '{"c": 1}'),
    ]
    whole = completion(
        None,
        calls=[("call_a", "calc", "{}"), ("call_b", "weather", '{"c": 1}')],
        finish="tool_calls",
        ids=21,
    )
    assert done == [chat_to_response(whole, echo_for(body, translate(body)))]


PATCH = "*** Begin Patch\n*** End Patch"
PATCH_ARGUMENTS = json.dumps({"input": PATCH})
CUSTOM_STREAM = [
    first_chunk(),
    token(call_piece(PATCH_ARGUMENTS[:10], "call_p", "apply_patch")),
    token(call_piece(PATCH_ARGUMENTS[10:])),
    token({}, finish="tool_calls"),
]


def test_a_custom_tool_call_streams_its_input_whole_once_the_call_is_complete() -> None:
    body = {"model": MODEL, "input": "x", "tools": [APPLY_PATCH], "stream": True}
    events, done = streamed(body, CUSTOM_STREAM, ResponseStream.finish)
    check_sequence(events)
    assert [event["type"] for event in events][2:] == [
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-2]["item"]["input"] == PATCH
    whole = completion(
        None, calls=[("call_p", "apply_patch", PATCH_ARGUMENTS)], finish="tool_calls"
    )
    assert done[0]["output"] == chat_to_response(whole, echo_for(body, translate(body)))["output"]


def test_an_engine_error_mid_stream_is_response_failed() -> None:
    error = {"error": {"message": "engine overloaded", "type": "ServiceUnavailable", "code": 503}}
    body = {"model": MODEL, "input": "x", "stream": True}
    events, done = streamed(
        body, [first_chunk(), token({"content": "a"})], lambda stream: stream.fail(error)
    )
    check_sequence(events)
    assert [event["type"] for event in events] == [
        "response.created",
        "response.in_progress",
        *ITEM,
        "response.output_text.delta",
        "response.failed",
    ]
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "engine overloaded"}
    assert done == []  # a failed response is not stored
    before_any_chunk, _ = streamed(body, [], lambda stream: stream.fail(error))
    check_sequence(before_any_chunk)
    assert [e["type"] for e in before_any_chunk] == [
        "response.created",
        "response.in_progress",
        "response.failed",
    ]


def test_a_stream_cut_by_its_budget_is_response_incomplete() -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2, "stream": True}
    chunks = [first_chunk(), token({"content": "one two"}, finish="length", ids=2)]
    events, done = streamed(body, chunks, ResponseStream.finish)
    check_sequence(events)
    assert events[-1]["type"] == "response.incomplete"
    incomplete = events[-1]["response"]
    assert incomplete["status"] == "incomplete"
    assert incomplete["incomplete_details"] == {"reason": "max_output_tokens"}
    assert incomplete["usage"]["output_tokens"] == 2 and incomplete["usage"]["input_tokens"] == 12
    assert done == [incomplete]


# -- what the SDK parses -------------------------------------------------------------------------

ENGINE_ERROR = {"error": {"message": "engine overloaded", "type": "ServiceUnavailable"}}
TOOLS_BODY = {"model": MODEL, "input": "x", "tools": [CALC, WEATHER, APPLY_PATCH, AGENTS]}
SDK_RESPONSES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "text": ({"model": MODEL, "input": "x"}, completion("42")),
    "reasoning": ({"model": MODEL, "input": "x"}, completion("42", reasoning="Add.")),
    "tool calls": (
        TOOLS_BODY,
        completion(
            "Let me.",
            calls=[
                ("c1", "calc", "{}"),
                ("c2", "apply_patch", PATCH_ARGUMENTS),
                ("c3", "spawn_agent", "{}"),
            ],
            finish="tool_calls",
        ),
    ),
    "incomplete": (
        {"model": MODEL, "input": "x", "max_output_tokens": 1},
        completion("one", finish="length"),
    ),
    "echo": (ECHOED, completion("hi", usage=False)),
}
SDK_STREAMS: dict[str, tuple[dict[str, Any], list[dict[str, Any]], bool]] = {
    "reasoning, text and a streamed tool call": (TOOLS_BODY, TOOL_STREAM, True),
    "tool calls sent whole": (TOOLS_BODY, WHOLE_CALLS_STREAM, True),
    "a custom tool call": (TOOLS_BODY, CUSTOM_STREAM, True),
    "cut by its budget": (
        {"model": MODEL, "input": "x", "max_output_tokens": 1},
        [first_chunk(), token({"content": "one"}, finish="length")],
        True,
    ),
    "failed": ({"model": MODEL, "input": "x"}, [first_chunk(), token({"content": "a"})], False),
}


@pytest.mark.parametrize("case", SDK_RESPONSES)
def test_a_response_is_valid_by_the_sdks_own_model(case: str) -> None:
    body, engine = SDK_RESPONSES[case]
    response = chat_to_response(engine, echo_for(body, translate(body)))
    parsed = RESPONSE.validate_python(response)
    assert (parsed.id, parsed.status, len(parsed.output)) == (
        response["id"],
        response["status"],
        len(response["output"]),
    )


@pytest.mark.parametrize("case", SDK_STREAMS)
def test_every_stream_event_is_valid_by_the_sdks_own_models(case: str) -> None:
    body, chunks, completes = SDK_STREAMS[case]
    end = ResponseStream.finish if completes else (lambda s: s.fail(ENGINE_ERROR))
    events, _ = streamed({**body, "stream": True}, chunks, end)
    invalid = []
    for event in events:
        try:
            assert EVENT.validate_python(event).type == event["type"]
        except pydantic.ValidationError as err:
            invalid.append(f"{event['type']}: {_errors_of(err, event['type'])}")
    assert not invalid, invalid


def _errors_of(err: pydantic.ValidationError, kind: str) -> list[str]:
    """The errors of the union member the event's type selects (not of every member)."""
    own = [e for e in err.errors() if e["loc"] and _member_type(str(e["loc"][0])) == kind]
    return [f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in own or err.errors()[:3]]


def _member_type(member: str) -> str | None:
    model = getattr(openai.types.responses, member, None)
    field = getattr(model, "model_fields", {}).get("type")
    args = getattr(field.annotation, "__args__", ()) if field is not None else ()
    return str(args[0]) if args else None


# -- stored responses ---------------------------------------------------------------------------

KEY = ("ep", 1)


def stored(response_id: str, previous: str | None = None, expires_at: float = 1e12) -> Stored:
    item = {"type": "message", "role": "user", "content": f"asked {response_id}"}
    output = [{"type": "message", "role": "assistant", "content": f"answered {response_id}"}]
    return Stored({"id": response_id, "output": output}, [item], previous, expires_at)


def test_a_chain_is_every_item_of_its_responses_oldest_first() -> None:
    store = ResponseStore(10)
    store.put(KEY, stored("resp_1"))
    store.put(KEY, stored("resp_2", "resp_1"))
    store.put(KEY, stored("resp_3", "resp_2"))
    assert store.get(KEY, "resp_2") == stored("resp_2", "resp_1")
    history = store.history(KEY, "resp_3")
    assert history is not None
    assert [item["content"] for item in history] == [
        "asked resp_1",
        "answered resp_1",
        "asked resp_2",
        "answered resp_2",
        "asked resp_3",
        "answered resp_3",
    ]
    assert store.history(KEY, "resp_1") == [
        *stored("resp_1").items,
        *stored("resp_1").response["output"],
    ]


def test_another_episodes_response_is_not_found() -> None:
    store = ResponseStore(10)
    store.put(KEY, stored("resp_1"))
    assert store.get(("other", 1), "resp_1") is None
    assert store.get(("ep", 2), "resp_1") is None  # another attempt of the same episode
    assert store.history(("other", 1), "resp_1") is None
    assert store.history(KEY, "resp_missing") is None


def test_a_chain_with_a_forgotten_link_is_not_found() -> None:
    store = ResponseStore(10)
    store.put(KEY, stored("resp_1"))
    store.put(KEY, stored("resp_2", "resp_1"))
    assert store.delete(KEY, "resp_1")
    assert store.history(KEY, "resp_2") is None


def test_a_chain_that_leads_back_to_itself_ends() -> None:
    """Response ids derive from the engine's completion ids, so an engine that repeats one
    (a stand-in, a deterministic or replaying server) stores a response
    that continues itself. Resolving such a chain must end, not spin the event loop."""
    store = ResponseStore(10)
    dialect = ResponsesDialect(store)
    first = dialect.translate({"model": MODEL, "input": "one"}, CLAIMS)
    response = first.renderer.body(completion("1"))
    follow_up = {"model": MODEL, "input": "two", "previous_response_id": response["id"]}
    dialect.translate(follow_up, CLAIMS).renderer.body(completion("2"))  # the same engine id
    walked = 0
    real_get = store.get

    def get(key: tuple[str, int], response_id: str) -> Stored | None:
        nonlocal walked
        walked += 1
        assert walked <= 100, "history() walked past 100 links of a two-response chain"
        return real_get(key, response_id)

    store.get = get  # type: ignore[method-assign]  # counts the links walked
    try:
        dialect.translate(follow_up, CLAIMS)
    except GatewayError as err:
        assert (err.status, err.param) == (400, "previous_response_id")


def test_the_oldest_responses_are_evicted_past_the_bound() -> None:
    store = ResponseStore(2)
    store.put(KEY, stored("resp_1"))
    store.put(KEY, stored("resp_1"))  # idempotent: stored once
    store.put(KEY, stored("resp_2"))
    assert len(store) == 2
    store.put(KEY, stored("resp_3"))
    assert len(store) == 2
    assert store.get(KEY, "resp_1") is None
    assert store.get(KEY, "resp_2") is not None and store.get(KEY, "resp_3") is not None


def test_a_sweep_forgets_responses_whose_episode_expired() -> None:
    store = ResponseStore(10)
    store.put(KEY, stored("resp_1", expires_at=100.0))
    store.put(KEY, stored("resp_2", expires_at=200.0))
    store.put(("other", 1), stored("resp_3", expires_at=300.0))
    assert store.sweep(now=99.0) == 0
    assert store.sweep(now=200.0) == 2
    assert len(store) == 1 and store.get(("other", 1), "resp_3") is not None
    assert store.sweep(now=200.0) == 0


def test_delete_forgets_a_response_once() -> None:
    store = ResponseStore(10)
    store.put(KEY, stored("resp_1"))
    assert store.delete(KEY, "resp_1") is True
    assert store.get(KEY, "resp_1") is None
    assert store.delete(KEY, "resp_1") is False


def test_previous_response_id_continues_a_stored_response_of_the_same_episode() -> None:
    dialect = ResponsesDialect(ResponseStore(10))
    call = dialect.translate(
        {"model": MODEL, "instructions": "Be terse.", "input": "17 + 25?"}, CLAIMS
    )
    response = call.renderer.body(completion("42", reasoning="Add."))
    follow_up = {"model": MODEL, "input": "And 2 + 2?", "previous_response_id": response["id"]}
    chained = dialect.translate(follow_up, CLAIMS)
    assert chained.body["messages"] == [
        {"role": "user", "content": "17 + 25?"},
        {"role": "assistant", "content": "42", "reasoning_content": "Add."},
        {"role": "user", "content": "And 2 + 2?"},
    ]
    with pytest.raises(GatewayError) as caught:
        dialect.translate(follow_up, OTHER)
    assert (caught.value.status, caught.value.param) == (400, "previous_response_id")
    assert orjson.loads(dialect.route("GET", response["id"], CLAIMS).body) == response
    assert orjson.loads(dialect.route("DELETE", response["id"], CLAIMS).body)["deleted"] is True
    with pytest.raises(GatewayError) as gone:
        dialect.route("GET", response["id"], CLAIMS)
    assert gone.value.status == 404


def test_a_response_asked_not_to_be_stored_is_not() -> None:
    store = ResponseStore(10)
    call = ResponsesDialect(store).translate({"model": MODEL, "input": "x", "store": False}, CLAIMS)
    call.renderer.body(completion("hi"))
    assert len(store) == 0
