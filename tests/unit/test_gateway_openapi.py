"""The gateway's OpenAPI document against what its Anthropic routes accept: a body the
gateway accepts must be valid under the document (the schema fuzzer of
tests/integration/test_fuzz_gateway.py sends schema-violating bodies and expects each
refused), and a body the document forbids is refused with a 400 naming the field."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.episode_token import EpisodeClaims
from harnessrl.services.gateway.dialects.anthropic import MessagesDialect
from harnessrl.services.gateway.errors import GatewayError
from harnessrl.services.gateway.openapi import document

CLAIMS = EpisodeClaims("ep", 1, "g", "train", 4_000_000_000.0)
BASE = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
CALC = {"name": "calc", "input_schema": {"type": "object"}}
JSON: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)
TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["custom", "web_search_20250305"]) | JSON},
    optional={k: st.just(v) | JSON for k, v in CALC.items()},
)


def _validator(name: str) -> jsonschema.Draft202012Validator:
    schemas = document()["components"]["schemas"]
    return jsonschema.Draft202012Validator({**schemas[name], "components": {"schemas": schemas}})


MESSAGES = _validator("MessagesRequest")
COUNT = _validator("CountTokensRequest")


def _accepted(body: dict[str, Any], *, count: bool = False, drop: bool = True) -> bool:
    """Whether the gateway accepts `body` on /v1/messages (or count_tokens, as app.py
    translates it there)."""
    if count:
        body = {"max_tokens": 1, **body, "stream": False}
    try:
        MessagesDialect(drop_unserved=drop).translate(body, CLAIMS)
    except GatewayError as err:
        assert err.status == 400
        return False
    return True


@pytest.mark.parametrize(
    "extra",
    [
        # Regression (the schema fuzzer): server tools are left out, so any `type` but
        # `custom` is accepted; the document said only "custom" or null.
        {"tools": [{"type": "/resume"}], "tool_choice": None},
        {"tools": [{"type": "\u00e9\U0001f600", "x": 1}, CALC], "tool_choice": {"type": "auto"}},
        {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]},
        {"tools": [{**CALC, "type": "custom"}], "tool_choice": {"type": "tool", "name": "calc"}},
    ],
)
def test_a_body_the_gateway_accepts_is_valid_under_the_document(extra: dict[str, Any]) -> None:
    body = {**BASE, **extra}
    assert _accepted(body) and _accepted(body, count=True)
    MESSAGES.validate(body)
    COUNT.validate(body)


def test_count_tokens_ignores_stream_and_so_does_its_schema() -> None:
    body = {**BASE, "stream": "yes"}
    assert _accepted(body, count=True)
    COUNT.validate(body)
    assert not MESSAGES.is_valid(body) and not _accepted(body)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tools": [{**CALC, "type": 5}]}, "tools.0.type: 5 tools are not supported"),
        ({"tools": [{"type": "custom"}]}, "tools.0.name: Field required"),
        ({"tool_choice": "any"}, "tool_choice: Input should be a valid dictionary"),
        (
            {"tools": [CALC], "tool_choice": {"type": "any", "disable_parallel_tool_use": None}},
            "tool_choice.disable_parallel_tool_use: Input should be a valid boolean",
        ),
    ],
)
def test_a_body_the_document_forbids_is_refused_naming_the_field(
    extra: dict[str, Any], message: str
) -> None:
    body = {**BASE, **extra}
    assert not MESSAGES.is_valid(body)
    with pytest.raises(GatewayError) as err:
        MessagesDialect().translate(body, CLAIMS)
    assert err.value.status == 400 and str(err.value).startswith(message)


def test_with_unserved_tools_rejected_a_server_tool_is_refused_by_name() -> None:
    body = {**BASE, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    with pytest.raises(GatewayError) as err:
        MessagesDialect(drop_unserved=False).translate(body, CLAIMS)
    assert err.value.status == 400
    assert str(err.value).startswith("tools.0.type: 'web_search_20250305' tools are not")


@settings(max_examples=300, deadline=None)
@given(
    tools=st.lists(JSON | TOOL, max_size=3),
    choice=JSON,
    count=st.booleans(),
)
def test_any_tools_and_tool_choice_the_gateway_accepts_are_valid_under_the_document(
    tools: list[Any], choice: Any, count: bool
) -> None:
    body = {**BASE, "tools": tools, "tool_choice": choice}
    if _accepted(body, count=count):
        (COUNT if count else MESSAGES).validate(body)
