"""Tool-call parsing of model output, complete and streamed."""

from __future__ import annotations

import json

from harnessrl.services.inference.tools import StreamingToolParser, parse_tool_calls

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>'


def test_text_without_calls_is_content() -> None:
    assert parse_tool_calls("The answer is 42.") == ("The answer is 42.", [])


def test_calls_are_parsed_and_content_is_what_surrounds_them() -> None:
    content, calls = parse_tool_calls("Let me compute.\n" + CALL + "\n" + CALL)
    assert content == "Let me compute."
    assert [c.name for c in calls] == ["calculator", "calculator"]
    assert json.loads(calls[0].arguments) == {"expression": "17 + 25"}
    assert calls[0].id != calls[1].id
    assert calls[0].to_openai(0)["function"] == {
        "name": "calculator",
        "arguments": calls[0].arguments,
    }


def test_only_calls_means_no_content() -> None:
    content, calls = parse_tool_calls(CALL)
    assert content is None
    assert len(calls) == 1


def test_a_malformed_call_leaves_the_output_as_content() -> None:
    broken = '<tool_call>{"name": "calculator", "arguments": {"expr</tool_call>'
    assert parse_tool_calls(broken) == (broken, [])
    nameless = '<tool_call>{"arguments": {}}</tool_call>'
    assert parse_tool_calls(nameless) == (nameless, [])


def test_streaming_holds_back_calls_and_partial_tags() -> None:
    parser = StreamingToolParser()
    text = "Let me compute.\n" + CALL
    streamed = ""
    for end in range(1, len(text) + 1):
        delta = parser.content_delta(text[:end])
        streamed += delta
        assert "<" not in delta  # never a piece of the tag or the call
    rest, calls = parser.finish(text)
    assert streamed == "Let me compute.\n"
    assert rest == ""
    assert [c.name for c in calls] == ["calculator"]


def test_streaming_releases_held_text_that_was_not_a_call() -> None:
    parser = StreamingToolParser()
    text = "a < b and <tool_cal"
    streamed = "".join(parser.content_delta(text[:end]) for end in range(1, len(text) + 1))
    assert streamed == "a < b and "
    rest, calls = parser.finish(text)
    assert streamed + rest == text
    assert calls == []
