"""Property tests of the gateway's request handling: arbitrary JSON in any field of an
Anthropic or OpenAI request gives either an engine request or a 4xx in the API's own error
shape, never another exception.

Requests start from rich valid ones (system prompt, tools, a tool-use round trip, a
prefill) and get one or two of their values, at any depth, replaced by arbitrary JSON, or a
field added; fully generated ones explore block combinations a mutation would not reach.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.episode_token import EpisodeClaims
from harnessrl.services.gateway.config import GatewaySection
from harnessrl.services.gateway.dialects.anthropic import MessagesDialect
from harnessrl.services.gateway.dialects.anthropic_request import ChatRequest, messages_to_chat
from harnessrl.services.gateway.dialects.base import Dialect
from harnessrl.services.gateway.dialects.openai_chat import ChatDialect
from harnessrl.services.gateway.dialects.openai_completions import CompletionsDialect
from harnessrl.services.gateway.dialects.openai_passthrough import Passthrough
from harnessrl.services.gateway.errors import ANTHROPIC as ANTHROPIC_ERRORS
from harnessrl.services.gateway.errors import GatewayError
from harnessrl.trust.contract import CHAT_PATH, engine_request

JSON: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
CLAIMS = EpisodeClaims("ep", 1, "g", "train", 4_000_000_000.0)
TOOL_SCHEMA = {"type": "object", "properties": {"expression": {"type": "string"}}}
ANTHROPIC = {
    "model": "claude-sonnet-4-6",
    "max_tokens": 64,
    "system": [{"type": "text", "text": "You add numbers."}],
    "messages": [
        {"role": "user", "content": "What is 17 + 25?"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "easy", "signature": "s"},
                {"type": "text", "text": "Let me compute."},
                {"type": "tool_use", "id": "t1", "name": "calc", "input": {"expression": "17+25"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "42", "is_error": False},
                {"type": "text", "text": "Go on."},
            ],
        },
        {"role": "assistant", "content": "The answer is"},
    ],
    "tools": [{"name": "calc", "description": "Adds.", "input_schema": TOOL_SCHEMA}],
    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
    "stop_sequences": ["\n\n"],
    "temperature": 0.5,
    "top_p": 0.9,
    "stream": True,
    "metadata": {"user_id": "u"},
}
CHAT_BODY = {
    "model": "gpt-x",
    "messages": [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": [{"type": "text", "text": "What is 17 + 25?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ],
    "tools": [{"type": "function", "function": {"name": "calc", "parameters": TOOL_SCHEMA}}],
    "stream": False,
    "stream_options": {"include_usage": True},
    "logprobs": True,
    "top_logprobs": 2,
    "return_token_ids": False,
    "temperature": 0.7,
    "max_tokens": 16,
    "n": 2,
    "stop": ["\n"],
}
COMPLETION_BODY = {
    "model": "gpt-x",
    "prompt": [[1, 2, 3], [4, 5]],
    "logprobs": 1,
    "max_tokens": 8,
    "stream": True,
    "echo": False,
}


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `node` (the root excluded)."""
    found: list[tuple[Any, ...]] = []
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for key, value in items:
        found.append((*prefix, key))
        found.extend(_paths(value, (*prefix, key)))
    return found


@st.composite
def mutated(draw: st.DrawFn, base: dict[str, Any]) -> dict[str, Any]:
    """`base` with one or two values replaced by arbitrary JSON, or a key added."""
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 2))):
        paths = _paths(body)
        path = draw(st.sampled_from(paths))
        parent: Any = body
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and draw(st.booleans()):
            parent[draw(st.text(max_size=8))] = draw(JSON)  # an added field
        else:
            parent[path[-1]] = draw(JSON)
    return body


BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.text(max_size=4),
            "name": st.text(max_size=4),
            "input": st.dictionaries(st.text(max_size=4), JSON, max_size=2),
        }
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": st.text(max_size=4),
            "content": st.text(max_size=8)
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text()})),
            "is_error": st.booleans(),
        }
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "image"])}),
)
GENERATED = st.fixed_dictionaries(
    {
        "model": st.text(min_size=1, max_size=8),
        "max_tokens": st.integers(1, 100),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["user", "assistant", "system"]),
                    "content": st.text(max_size=8) | st.lists(BLOCK, max_size=3),
                }
            ),
            min_size=1,
            max_size=4,
        ),
    },
    optional={
        "tools": st.lists(
            st.fixed_dictionaries(
                {"name": st.sampled_from(["a", "b"]), "input_schema": st.just(TOOL_SCHEMA)}
            ),
            max_size=2,
        ),
        "tool_choice": st.fixed_dictionaries(
            {"type": st.sampled_from(["auto", "any", "none", "tool"])},
            optional={
                "name": st.sampled_from(["a", "c"]),
                "disable_parallel_tool_use": st.booleans(),
            },
        ),
        "system": st.text(max_size=40) | st.lists(BLOCK, max_size=2),
        "stream": st.booleans(),
    },
)


def _through_the_dialect(body: Any) -> ChatRequest:
    """What MessagesDialect (server tools left out, as the gateway serves) makes of `body`."""
    call = MessagesDialect().translate(body, CLAIMS)
    assert call.path == CHAT_PATH and call.budget_field == "max_tokens"
    return ChatRequest(call.body, call.model, call.stream)


def _translated_or_refused(
    body: Any, translate: Callable[[Any], ChatRequest] = messages_to_chat
) -> None:
    try:
        chat = translate(body)
    except GatewayError as err:
        assert 400 <= err.status < 500
        shape = ANTHROPIC_ERRORS.body(err.status, str(err), err.param, err.code)
        assert shape["type"] == "error" and set(shape["error"]) == {"type", "message"}
        assert shape["error"]["type"] == "invalid_request_error" and shape["error"]["message"]
        return
    assert isinstance(chat, ChatRequest)
    upstream = chat.body
    orjson.dumps(upstream)  # sendable as it is
    assert upstream["model"] == chat.model and isinstance(chat.model, str)
    assert isinstance(upstream["max_tokens"], int) and upstream["max_tokens"] >= 1
    assert upstream["stream"] is chat.stream
    assert upstream["messages"], "an engine request needs a message"
    for message in upstream["messages"]:
        assert message["role"] in ("system", "user", "assistant", "tool")
        content = message.get("content")
        assert isinstance(content, str) or (content is None and message.get("tool_calls"))


@settings(max_examples=400, deadline=None)
@given(mutated(ANTHROPIC))
def test_an_anthropic_request_with_any_value_anywhere_is_translated_or_refused_as_a_400(
    body: dict[str, Any],
) -> None:
    _translated_or_refused(body)


@settings(max_examples=200, deadline=None)
@given(mutated(ANTHROPIC))
def test_the_messages_dialect_translates_or_refuses_any_value_anywhere_as_a_400(
    body: dict[str, Any],
) -> None:
    _translated_or_refused(body, _through_the_dialect)


@settings(max_examples=300, deadline=None)
@given(GENERATED)
def test_generated_anthropic_conversations_are_translated_or_refused_as_a_400(
    body: dict[str, Any],
) -> None:
    _translated_or_refused(body)


@settings(max_examples=100, deadline=None)
@given(JSON)
def test_an_anthropic_body_of_any_json_is_refused_as_a_400(body: Any) -> None:
    _translated_or_refused(body)


def _forwarded_or_refused(body: dict[str, Any], dialect: Dialect) -> None:
    section = GatewaySection()
    try:
        call = dialect.translate(body, CLAIMS)
    except GatewayError as err:
        assert err.status == 400
        assert err.param in ("model", "stream", "return_token_ids", "logprobs")
        return
    assert isinstance(call.renderer, Passthrough)
    for mode in (section.train, section.val):
        upstream = engine_request(call.body, call.path, "engine-model", mode)
        orjson.dumps(upstream)
        assert upstream["model"] == "engine-model" and upstream["return_token_ids"] is True
        # What the gateway believes it asked is what the engine will read.
        assert call.stream is upstream.get("stream", False)
        assert call.model == body["model"] and call.renderer.model == body["model"]
        assert body == orjson.loads(orjson.dumps(body)), "the harness's body is not modified"


@settings(max_examples=300, deadline=None)
@given(mutated(CHAT_BODY))
def test_a_chat_request_with_any_value_anywhere_is_forwarded_or_refused_as_a_400(
    body: dict[str, Any],
) -> None:
    _forwarded_or_refused(body, ChatDialect())


@settings(max_examples=200, deadline=None)
@given(mutated(COMPLETION_BODY))
def test_a_completion_request_with_any_value_anywhere_is_forwarded_or_refused_as_a_400(
    body: dict[str, Any],
) -> None:
    _forwarded_or_refused(body, CompletionsDialect())


def test_fields_the_gateway_reads_must_have_their_type() -> None:
    """Regression: `"stream": "true"` made the engine stream (its parser is lenient) while
    the gateway read a JSON answer, so the harness got a 500."""
    for field, value in [("stream", "true"), ("stream", 1), ("return_token_ids", "yes")]:
        body = {**CHAT_BODY, field: value}
        try:
            ChatDialect().translate(body, CLAIMS)
        except GatewayError as err:
            assert (err.status, err.param) == (400, field)
        else:
            raise AssertionError(f"{field}={value!r} was accepted")
