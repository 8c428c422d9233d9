"""The OpenAPI document of the gateway's harness-facing routes, served at `/openapi.json`.

It describes what the gateway itself checks, no more, so that clients and fuzzers can rely
on it (tests/integration/test_fuzz_gateway.py sends it schema-violating requests and expects
each refused):

- `/v1/messages`: the schema of the model that validates the request
  (`anthropic_models.MessagesRequest`), generated, so it cannot drift from it, but for
  `tools`, whose items may also be server tools (any `type` but `custom`): the dialect
  leaves those out before validating (dialects/anthropic.py; refused by name with
  `gateway.unserved_tools: reject`). `/v1/messages/count_tokens` the same without
  `max_tokens` required and without `stream` (a count never streams: any value is ignored).
- `/v1/responses`: the fields whose type the Responses dialect checks itself
  (dialects/responses_request.py checks the items, tools and tool choice in detail, each
  refusal naming its field).
- `/v1/chat/completions`, `/v1/completions`: the fields the gateway reads itself (`model`,
  `stream`, `return_token_ids`, `logprobs`: `capture.check_request`) and the request's shape
  that any engine behind it enforces. Every other field goes to the engine as it was sent
  (sampling fields forced or dropped in train mode: `gateway.train`), and the engine's 400
  comes back as it is.

Each route is also served under `/e/{token}` (the second server), the episode token then
being in the path rather than the API key. Errors are OpenAI's error object on the OpenAI
routes and Anthropic's on `/v1/messages`.
"""

from __future__ import annotations

import functools
from typing import Any

import orjson

from harnessrl.services.gateway.dialects.anthropic_models import MessagesRequest

_REF = "#/components/schemas/{model}"
_OPENAI_ERRORS = {
    "4XX": {"$ref": "#/components/responses/OpenAIError"},
    "5XX": {"$ref": "#/components/responses/OpenAIError"},
}
_ANTHROPIC_ERRORS = {
    "4XX": {"$ref": "#/components/responses/AnthropicError"},
    "5XX": {"$ref": "#/components/responses/AnthropicError"},
}
_STREAM: dict[str, Any] = {"text/event-stream": {}}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "object"}},
                {"type": "null"},
            ]
        },
    },
}
_COMMON = {
    "model": {"type": "string", "description": "Any name: the answer carries it back."},
    "stream": {"type": "boolean"},
    "stream_options": {
        "anyOf": [
            {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
            {"type": "null"},
        ]
    },
    "return_token_ids": {
        "type": "boolean",
        "description": "Also return prompt and completion token ids (vLLM's field).",
    },
    "max_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
    "n": {"type": "integer", "minimum": 1},
    "stop": {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}},
            {"type": "null"},
        ]
    },
}
_CHAT = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "logprobs": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
}
_COMPLETION = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer", "minimum": 0}},
                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            ]
        },
        "logprobs": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]},
    },
}
_RESPONSES = {
    "type": "object",
    "required": ["model"],
    "properties": {
        "model": _COMMON["model"],
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "stream": {"type": "boolean"},
        "store": {"type": "boolean"},
        "previous_response_id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "max_output_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
        "tools": {"type": "array", "items": {"type": "object", "required": ["type"]}},
        "parallel_tool_calls": {"type": "boolean"},
        "temperature": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "top_p": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
}
_SERVER_TOOL = {
    "title": "ServerTool",
    "description": "A tool run by Anthropic's API (web search, code execution, ...), not by "
    "any engine: left out of the request (gateway.unserved_tools: drop, the default) or "
    "refused naming it (reject).",
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"type": "string", "not": {"const": "custom"}}},
}
_ID = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _generate(name: str, summary: str) -> dict[str, Any]:
    """A POST that answers JSON, or an SSE stream when the body asks for one."""
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json({"$ref": _REF.format(model=name)})},
            "responses": {
                "200": {"description": "The answer", "content": {**_json({}), **_STREAM}},
                **_OPENAI_ERRORS,
            },
        }
    }


def _get(summary: str, errors: dict[str, Any], *, path_id: bool = False) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": summary, "content": _json({})}, **errors},
    }
    if path_id:
        operation["parameters"] = _ID
    return operation


def document() -> dict[str, Any]:
    """The document (a fresh dict)."""
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "harnessrl gateway",
            "version": "1",
            "description": "OpenAI and Anthropic routes of one episode; see the module "
            "services/gateway/openapi.py for what is checked where.",
        },
        "servers": [
            {"url": "/"},
            {"url": "/e/{token}", "variables": {"token": {"default": "episode-token"}}},
        ],
        "security": [{"bearer": []}, {"apiKey": []}, {}],
        "paths": {**_openai_paths(), **_anthropic_paths()},
        "components": _components(),
    }


def _openai_paths() -> dict[str, Any]:
    return {
        "/v1/chat/completions": _generate("ChatCompletionRequest", "OpenAI chat completion"),
        "/v1/completions": _generate("CompletionRequest", "OpenAI completion"),
        "/v1/responses": _generate("ResponsesRequest", "OpenAI response (Responses API)"),
        "/v1/responses/{id}": {
            "get": _get("A response the episode stored", _OPENAI_ERRORS, path_id=True),
            "delete": _get("Delete a stored response", _OPENAI_ERRORS, path_id=True),
        },
        "/v1/responses/{id}/input_items": {
            "get": _get("A stored response's input items", _OPENAI_ERRORS, path_id=True)
        },
        "/v1/models": {"get": _get("The model served", _OPENAI_ERRORS)},
        "/v1/models/{id}": {
            "get": _get("Any model name: answered under that name", _OPENAI_ERRORS, path_id=True)
        },
    }


def _anthropic_paths() -> dict[str, Any]:
    return {
        "/v1/messages": _anthropic_post(
            "Anthropic message",
            "MessagesRequest",
            {"description": "The message", "content": {**_json({}), **_STREAM}},
        ),
        "/v1/messages/count_tokens": _anthropic_post(
            "Anthropic token count, by the engine's tokenizer and template",
            "CountTokensRequest",
            {"description": "input_tokens", "content": _json({})},
        ),
    }


def _anthropic_post(summary: str, model: str, answer: dict[str, Any]) -> dict[str, Any]:
    """A POST of an Anthropic route: its body's schema by name, its errors Anthropic's."""
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json({"$ref": _REF.format(model=model)})},
            "responses": {"200": answer, **_ANTHROPIC_ERRORS},
        }
    }


def _components() -> dict[str, Any]:
    messages, count, defs = _anthropic_schemas()
    return {
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer", "description": "Episode token"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        },
        "schemas": {
            "ChatCompletionRequest": _CHAT,
            "CompletionRequest": _COMPLETION,
            "ResponsesRequest": _RESPONSES,
            "MessagesRequest": messages,
            "CountTokensRequest": count,
            **defs,
            "ServerTool": _SERVER_TOOL,
            "OpenAIErrorBody": _OPENAI_ERROR,
            "AnthropicErrorBody": _ANTHROPIC_ERROR,
        },
        "responses": {
            "OpenAIError": {
                "description": "OpenAI's error object",
                "content": _json({"$ref": _REF.format(model="OpenAIErrorBody")}),
            },
            "AnthropicError": {
                "description": "Anthropic's error",
                "content": _json({"$ref": _REF.format(model="AnthropicErrorBody")}),
            },
        },
    }


def _anthropic_schemas() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(MessagesRequest's schema, with server tools among its tools; CountTokensRequest's:
    the same without `stream` and without `max_tokens` required; the models they refer to)."""
    messages = MessagesRequest.model_json_schema(ref_template=_REF)
    defs = messages.pop("$defs", {})
    tools = messages["properties"]["tools"]["anyOf"][0]
    tools["items"] = {"anyOf": [tools["items"], {"$ref": _REF.format(model="ServerTool")}]}
    count = {
        **messages,
        "properties": {k: v for k, v in messages["properties"].items() if k != "stream"},
        "required": [r for r in messages["required"] if r != "max_tokens"],
    }
    return messages, count, defs


@functools.cache
def document_bytes() -> bytes:
    """The document as served (built once, on first use)."""
    return orjson.dumps(document())
