"""The engine's chat completion as an OpenAI Responses `Response` object: pure, no I/O.

Each response gets a fresh id (`resp_X`, its items `msg_X`, `rs_X`, `fc_X_<n>`): an
engine's completion ids need not be unique, and a stored response must be. The
output holds, in order: a `reasoning` item when the engine returned reasoning
(`reasoning_content`), a `message` item with the text, one `function_call` (or
`custom_tool_call`, for a custom tool) item per tool call. A completion cut by its budget
is `incomplete` (`max_output_tokens`).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from harnessrl.services.gateway.dialects.responses_request import CUSTOM_INPUT

_ECHOED = ("instructions", "max_output_tokens", "previous_response_id", "reasoning", "text")
_ECHOED_TOO = ("tool_choice", "tools", "top_p", "temperature", "user", "metadata", "truncation")


@dataclass(frozen=True, slots=True)
class Echo:
    """What a response repeats of its request, and the names it needs to render calls."""

    request: dict[str, Any]
    model: str
    custom_tools: frozenset[str]
    namespaces: dict[str, str]

    def response(self, response_id: str, created: int) -> dict[str, Any]:
        """A response object with no output yet (status in_progress)."""
        request = self.request
        body: dict[str, Any] = {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": "in_progress",
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": [],
            "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
            "store": request.get("store", True) is not False,
            "tool_choice": "auto",
            "tools": [],
            "temperature": 1.0,
            "top_p": 1.0,
            "truncation": "disabled",
            "metadata": {},
            "usage": None,
        }
        for name in (*_ECHOED, *_ECHOED_TOO):
            if request.get(name) is not None:
                body[name] = request[name]
        for name in _ECHOED:
            body.setdefault(name, None)
        return body


def response_id() -> str:
    """A fresh `resp_<hex>`."""
    return "resp_" + uuid.uuid4().hex


def suffix(resp_id: str) -> str:
    return resp_id.removeprefix("resp_")


def message_item(resp_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{suffix(resp_id)}",
        "status": status,
        "role": "assistant",
        "content": [output_text(text)],
    }


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(resp_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{suffix(resp_id)}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def call_item(
    echo: Echo,
    resp_id: str,
    index: int,
    *,
    call_id: object,
    name: str,
    arguments: str,
    status: str = "completed",
) -> dict[str, Any]:
    """A `function_call` item, or a `custom_tool_call` one for a custom tool."""
    cid = call_id if isinstance(call_id, str) and call_id else f"call_{suffix(resp_id)}_{index}"
    if name in echo.custom_tools:
        return {
            "type": "custom_tool_call",
            "id": f"ctc_{suffix(resp_id)}_{index}",
            "call_id": cid,
            "name": name,
            "input": custom_input(arguments),
            "status": status,
        }
    item = {
        "type": "function_call",
        "id": f"fc_{suffix(resp_id)}_{index}",
        "call_id": cid,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
    if name in echo.namespaces:
        item["namespace"] = echo.namespaces[name]
    return item


def custom_input(arguments: str) -> str:
    """A custom tool's input from the function arguments the engine wrote (`{"input": s}`);
    arguments of another shape are passed on as they are, for the harness to refuse."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str):
        return str(value[CUSTOM_INPUT])
    return arguments


def usage(prompt: int, completion: int) -> dict[str, Any]:
    # This engine keeps no prompt cache to bill, and counts reasoning with the output.
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def finished(response: dict[str, Any], finish_reason: object) -> dict[str, Any]:
    """`response` with its final status for the engine's finish reason (modified)."""
    if finish_reason == "length":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    elif finish_reason == "content_filter":
        response["status"] = "incomplete"
        response["incomplete_details"] = {"reason": "content_filter"}
    else:
        response["status"] = "completed"
    return response


def chat_to_response(
    chat: dict[str, Any], echo: Echo, resp_id: str | None = None
) -> dict[str, Any]:
    """The Response for an engine's chat completion (its first choice), with id `resp_id`
    (default: a fresh one)."""
    resp_id = resp_id or response_id()
    response = echo.response(resp_id, int(chat.get("created") or time.time()))
    choices = chat.get("choices") or [{}]
    choice = choices[0]
    reply = choice.get("message") or {}
    output = response["output"]
    reasoning = reply.get("reasoning_content") or reply.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(reasoning_item(resp_id, reasoning))
    if reply.get("content"):
        output.append(message_item(resp_id, reply["content"]))
    for index, call in enumerate(reply.get("tool_calls") or ()):
        function = call.get("function") or {}
        name, arguments = str(function.get("name") or ""), function.get("arguments")
        text = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
        output.append(
            call_item(echo, resp_id, index, call_id=call.get("id"), name=name, arguments=text)
        )
    counts = chat.get("usage") or {}
    response["usage"] = usage(
        int(counts.get("prompt_tokens", len(chat.get("prompt_token_ids") or ()))),
        int(counts.get("completion_tokens", len(choice.get("token_ids") or ()))),
    )
    return finished(response, choice.get("finish_reason"))
