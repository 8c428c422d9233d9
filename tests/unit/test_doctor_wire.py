"""What the doctor reads off a captured call, in each dialect the gateway serves."""

from __future__ import annotations

import json
from typing import Any

from harnessrl.apps.doctor.traffic_read import (
    counter_delta,
    overrides,
    read_call,
    requests,
    unparsed_cause,
)
from harnessrl.services.gateway.config import GatewaySection
from harnessrl.services.gateway.tool_markup import MARKUPS
from harnessrl.v1 import events_pb2 as pb


def call(request: dict[str, Any], response: dict[str, Any], **fields: Any) -> pb.ModelCall:
    return pb.ModelCall(
        request_body=json.dumps(request).encode(),
        response_body=json.dumps(response).encode(),
        completion_token_ids=[1, 2, 3],
        **fields,
    )


def text(_: Any) -> str:
    return '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'


def test_tool_calls_are_read_from_each_dialects_answer() -> None:
    chat = call(
        {"messages": [], "tools": [{"type": "function"}], "max_completion_tokens": 512},
        {"choices": [{"message": {"tool_calls": [{"id": "a"}, {"id": "b"}]}}]},
    )
    anthropic = call(
        {"messages": [], "tools": [{"name": "bash"}], "max_tokens": 64000, "top_k": 40},
        {"content": [{"type": "text"}, {"type": "tool_use", "id": "t"}]},
    )
    responses = call(
        {"input": [], "tools": [{"type": "function"}], "max_output_tokens": 2048},
        {
            "output": [
                {"type": "reasoning"},
                {"type": "function_call"},
                {"type": "custom_tool_call"},
            ]
        },
    )
    wires = [read_call(c, text, MARKUPS) for c in (chat, anthropic, responses)]
    assert [w.tool_calls for w in wires] == [2, 1, 2]
    assert [w.asked for w in wires] == [512, 64000, 2048]
    assert all(w.markup for w in wires)
    # Anthropic's top_k 40 is forced to vLLM's neutral -1 in train mode
    assert overrides(wires, GatewaySection().train) == [
        {"field": "top_k", "calls": 1, "harness_values": ["40"], "train": "forced to -1"}
    ]


def test_without_bodies_the_finish_reason_tells_and_the_cause_is_named() -> None:
    bare = pb.ModelCall(completion_token_ids=[1], finish_reason="tool_calls")
    assert read_call(bare, None, MARKUPS).tool_calls == 1
    assert read_call(bare, None, MARKUPS).request is None
    cut = pb.ModelCall(finish_reason="length")
    assert unparsed_cause(cut, read_call(cut, text, MARKUPS))[1] == "raise max_tokens"
    stopped = call({"stop": ["}}"]}, {"choices": [{"message": {}}]}, finish_reason="stop")
    assert "stop sequence" in unparsed_cause(stopped, read_call(stopped, text, MARKUPS))[0]
    truncated = call({"tools": [1]}, {}, bodies_truncated=True)
    assert read_call(truncated, text, MARKUPS).request is None


def test_only_the_harness_routes_count_and_only_the_run_s_increase() -> None:
    name = "harnessrl_gateway_requests_total"
    before = {f"{name}{{route=/v1/chat/completions,status=200}}": 5.0}
    after = {
        f"{name}{{route=/v1/chat/completions,status=200}}": 9.0,
        f"{name}{{route=/v1/messages,status=421}}": 2.0,
        f"{name}{{route=/admin/...,status=200}}": 4.0,
        f"{name}{{route=/metrics,status=200}}": 1.0,
        "harnessrl_gateway_max_tokens_clamped_total{}": 3.0,
    }
    assert requests(before, after) == {
        "/v1/chat/completions": {"200": 4},
        "/v1/messages": {"421": 2},
    }
    clamped = counter_delta(before, after, "harnessrl_gateway_max_tokens_clamped_total")
    assert clamped == {(): 3.0}
