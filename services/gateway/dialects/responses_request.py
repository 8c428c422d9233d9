"""OpenAI Responses API requests as chat-completions requests: pure translation, no I/O.

`responses_to_chat(body, history)` reads a `POST /v1/responses` body (`history`: the items
of the response chain `previous_response_id` names, already resolved) and gives the
chat-completions request the engine serves, so capture is exact as for chat. Conventions,
where the two APIs do not map one to one:

- `instructions` is the first system message; `developer` messages are system messages
  (chat templates know no developer role, and some drop what they do not know).
- A message's text parts (`input_text`, `output_text`, `refusal`) are joined with a newline
  into one string, as for Anthropic's text blocks; images, files and audio are refused.
- `function_call` items join the assistant message before them (or start one) as its
  `tool_calls`; `function_call_output` items are `tool` messages.
- `custom` tools (free-form input, such as Codex's `apply_patch`) are passed on as function
  tools taking one string, `input`; their calls come back as `custom_tool_call` items.
- `reasoning` items sent back become the next assistant message's `reasoning_content`
  (what the chat template makes of it is the template's business).
- `namespace` tools (a named group of function tools, as Codex sends its sub-agent tools)
  are passed on as their function tools; a call of one names its namespace.
- Hosted tools (web search, file search, code interpreter, computer use, image generation,
  MCP, client tool search) cannot be served by a local engine: they are left out of the
  prompt (the model never sees them, so what is trained is what it saw; Codex sends
  `web_search` by default) or, with `gateway.unserved_tools: reject`, refused with a 400
  naming the tool. Their items in the input are refused either way.
- `text.format` json_schema / json_object becomes `response_format`, for engines that
  support structured output; `seed`, `stop` and vLLM's sampling extras pass through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from harnessrl.services.gateway.dialects.openai_passthrough import check_model
from harnessrl.services.gateway.errors import invalid

CUSTOM_INPUT = "input"
"""The one string argument a custom tool is given as a function tool."""
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_HOSTED = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer",
    "image_generation",
    "mcp",
    "local_shell",
    "tool_search",
)
_PASSED = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty")
_PASSED_TOO = ("frequency_penalty", "top_logprobs")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


@dataclass(frozen=True, slots=True)
class Translation:
    """A Responses request translated for the engine."""

    chat: dict[str, Any]
    """The chat-completions request, as a harness would send it."""
    items: list[dict[str, Any]]
    """This request's own input items (a string input is one user message)."""
    custom_tools: frozenset[str] = field(default_factory=frozenset)
    """Names of the custom tools (their calls are answered as `custom_tool_call`)."""
    namespaces: dict[str, str] = field(default_factory=dict)
    """The namespace of each function tool that came in one (its calls name it)."""
    dropped: tuple[str, ...] = ()
    """Types of the tools left out: hosted ones the engine cannot run."""


def responses_to_chat(
    body: dict[str, Any], history: list[dict[str, Any]], *, drop_unserved: bool = True
) -> Translation:
    """The chat request for a Responses body. Tools the engine cannot serve are left out
    (their types listed in the translation) or, without `drop_unserved`, refused. Raises
    GatewayError naming the field."""
    model = check_model(body.get("model"))
    for name in ("stream", "store", "parallel_tool_calls", "background"):
        if not isinstance(body.get(name, False), bool | None):
            raise invalid(name, "must be a boolean")
    if body.get("background"):
        raise invalid("background", "background responses are not supported by this gateway")
    for name in ("conversation", "prompt"):
        if body.get(name) is not None:
            raise invalid(
                name, "not supported by this gateway: send input (chain with previous_response_id)"
            )
    items = _input_items(body.get("input"))
    messages = _instructions(body.get("instructions")) + _messages(history, "history")
    messages += _messages(items, "input")
    if not messages:
        raise invalid("input", "required: a string or a non-empty list of items")
    chat: dict[str, Any] = {"model": model, "messages": messages}
    stream = body.get("stream") is True
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}
    if (limit := body.get("max_output_tokens")) is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise invalid("max_output_tokens", "must be a positive integer")
        chat["max_tokens"] = limit
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise invalid(name, "must be a number")
            chat[name] = value
    for name in (*_PASSED, *_PASSED_TOO):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("top_logprobs"):
        chat["logprobs"] = True
    if (parallel := body.get("parallel_tool_calls")) is not None:
        chat["parallel_tool_calls"] = parallel
    chat.update(_text_format(body.get("text")))
    custom, namespaces, dropped = _tools(
        body.get("tools"), body.get("tool_choice"), chat, drop_unserved=drop_unserved
    )
    return Translation(chat, items, custom, namespaces, tuple(dropped))


def _input_items(value: object) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        raise invalid("input", "must be a string or a list of items")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise invalid(f"input.{i}", "must be an object (an input item)")
    return value


def _instructions(value: object) -> list[dict[str, Any]]:
    if value is None or value == "":
        return []
    if not isinstance(value, str):
        raise invalid("instructions", "must be a string")
    return [{"role": "system", "content": value}]


def _messages(items: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """Chat messages for input items; `where` prefixes the field paths in errors."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        path = f"{where}.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise invalid(f"{path}.role", "must be one of user, assistant, system, developer")
            message: dict[str, Any] = {"role": _ROLES[role], "content": _text(item, path)}
            if message["role"] == "assistant" and reasoning:
                message["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            out.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            _assistant(out, reasoning).setdefault("tool_calls", []).append(_call(item, path))
            reasoning = []
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = _string(item, "call_id", path)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _output(item, path)})
        elif kind == "reasoning":
            reasoning += _reasoning(item, path)
        elif kind == "item_reference":
            raise invalid(f"{path}.type", "item references are not supported: send the item")
        else:
            raise invalid(f"{path}.type", f"{kind!r} items are not supported by this engine")
    return out


def _assistant(out: list[dict[str, Any]], reasoning: list[str]) -> dict[str, Any]:
    """The assistant message a tool call joins: the last message if it is one. Reasoning
    sent just before the call joins it too."""
    if out and out[-1]["role"] == "assistant":
        message = out[-1]
    else:
        message = {"role": "assistant", "content": None}
        out.append(message)
    if reasoning:
        earlier = message.get("reasoning_content")
        message["reasoning_content"] = "\n".join([earlier, *reasoning] if earlier else reasoning)
    return message


def _call(item: dict[str, Any], path: str) -> dict[str, Any]:
    call_id = _string(item, "call_id", path)
    name = _string(item, "name", path)
    if item.get("type") == "custom_tool_call":
        value = item.get("input", "")
        if not isinstance(value, str):
            raise invalid(f"{path}.input", "must be a string")
        arguments = orjson.dumps({CUSTOM_INPUT: value}).decode()
    else:
        arguments = item.get("arguments", "")
        if not isinstance(arguments, str):
            raise invalid(f"{path}.arguments", "must be a string (JSON text)")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _text(item: dict[str, Any], path: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{path}.content", "must be a string or a list of content parts")
    return _parts(content, f"{path}.content")


def _parts(content: list[Any], path: str) -> str:
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _TEXT_PARTS or kind == "refusal":
            raise invalid(f"{path}.{j}.text", "required, a string")
        else:
            raise invalid(f"{path}.{j}.type", f"{kind!r} parts are not supported by this engine")
    return "\n".join(texts)


def _output(item: dict[str, Any], path: str) -> str:
    output = item.get("output")
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        return _parts(output, f"{path}.output")
    raise invalid(f"{path}.output", "required, a string or a list of content parts")


def _reasoning(item: dict[str, Any], path: str) -> list[str]:
    texts = []
    for name in ("content", "summary"):
        parts = item.get(name) or []
        if not isinstance(parts, list):
            raise invalid(f"{path}.{name}", "must be a list of parts")
        texts += [
            p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str)
        ]
        if name == "content" and texts:
            break  # the full reasoning, when given, rather than its summary
    return texts


def _string(item: dict[str, Any], name: str, path: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise invalid(f"{path}.{name}", "required, a non-empty string")
    return value


def _text_format(text: object) -> dict[str, Any]:
    if text is None:
        return {}
    if not isinstance(text, dict):
        raise invalid("text", "must be an object")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return {}
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_schema", "json_object"):
        raise invalid("text.format.type", "must be one of text, json_schema, json_object")
    if fmt["type"] == "json_object":
        return {"response_format": {"type": "json_object"}}
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"response_format": {"type": "json_schema", "json_schema": schema}}


def _tools(
    tools: object, choice: object, chat: dict[str, Any], *, drop_unserved: bool
) -> tuple[frozenset[str], dict[str, str], list[str]]:
    """Fill the chat request's tools and tool_choice. Returns the names of the custom tools,
    the namespace of each function that came in one, and the types of the tools dropped."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise invalid("tools", "must be a list")
    functions: list[dict[str, Any]] = []
    custom: set[str] = set()
    namespaces: dict[str, str] = {}
    dropped: list[str] = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or kind not in ("function", "custom", "namespace"):
            if not drop_unserved or not isinstance(kind, str):
                raise invalid(f"tools.{i}.type", _unserved(kind))
            dropped.append(kind)
            continue
        if kind == "namespace":
            inner = tool.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"tools.{i}.tools", "required, a list of function tools")
            namespace = _string(tool, "name", f"tools.{i}")
            for j, member in enumerate(inner):
                path = f"tools.{i}.tools.{j}"
                if not isinstance(member, dict) or member.get("type") != "function":
                    raise invalid(f"{path}.type", "a namespace holds function tools only")
                functions.append(_function(member, path, custom))
                namespaces[functions[-1]["function"]["name"]] = namespace
            continue
        functions.append(_function(tool, f"tools.{i}", custom))
    names = [f["function"]["name"] for f in functions]
    if len(set(names)) != len(names):
        raise invalid("tools", "tool names must be unique (namespaces included)")
    if functions:
        chat["tools"] = functions
    if choice is not None:
        _tool_choice(choice, functions, chat)
    return frozenset(custom), namespaces, dropped


def _unserved(kind: object) -> str:
    if kind in _HOSTED:
        return (
            f"{kind!r} is a hosted tool this engine cannot run: only function, custom and "
            "namespace tools are served (gateway.unserved_tools: drop leaves such tools out)"
        )
    return f"{kind!r} tools are not supported by this engine"


def _function(tool: dict[str, Any], path: str, custom: set[str]) -> dict[str, Any]:
    """The chat function for a function or custom tool (a custom one's name joins `custom`)."""
    name = _string(tool, "name", path)
    function: dict[str, Any] = {"name": name}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool.get("type") == "custom":
        custom.add(name)
        function["parameters"] = {
            "type": "object",
            "properties": {CUSTOM_INPUT: {"type": "string"}},
            "required": [CUSTOM_INPUT],
        }
    else:
        parameters = tool.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise invalid(f"{path}.parameters", "must be a JSON Schema object")
        function["parameters"] = parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _tool_choice(choice: object, functions: list[dict[str, Any]], chat: dict[str, Any]) -> None:
    names = {f["function"]["name"] for f in functions}
    if choice in ("auto", "none", "required"):
        if choice != "none" and not functions and choice == "required":
            raise invalid("tool_choice", "'required' needs tools")
        if functions:
            chat["tool_choice"] = choice
        return
    if not isinstance(choice, dict):
        raise invalid("tool_choice", "must be auto, none, required or an object")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = choice.get("name")
        if not isinstance(name, str) or name not in names:
            raise invalid("tool_choice.name", f"no tool named {name!r} in tools")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    elif kind == "allowed_tools":
        allowed = choice.get("tools")
        if not isinstance(allowed, list):
            raise invalid("tool_choice.tools", "must be a list")
        keep = [t.get("name") for t in allowed if isinstance(t, dict)]
        unknown = [n for n in keep if not isinstance(n, str) or n not in names]
        if unknown:
            raise invalid("tool_choice.tools", f"no tool named {unknown[0]!r} in tools")
        chat["tools"] = [f for f in functions if f["function"]["name"] in keep]
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise invalid("tool_choice.mode", "must be auto or required")
        chat["tool_choice"] = mode
    else:
        raise invalid("tool_choice.type", f"{kind!r} is not supported by this engine")
