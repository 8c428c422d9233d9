"""A scripted engine for coding-harness tests: each answer is the next bash command of a script.

It stands in for a model, because these tests are about a harness's wiring (its calls reach
the gateway and are captured, its commands run in the episode's working copy with the task's
environment, its patch is reported), which a model that had to find the fix would make slow
and uncertain. It plays mini-swe-agent's protocol: every answer is one call of its `bash`
tool; the n-th answer of a conversation (n = the assistant messages it already holds) runs
the n-th command, and past the end the last one again.

It speaks the dialect the gateway asks of any engine (vLLM's OpenAI chat completions):
asked `return_token_ids`, it answers top-level `prompt_token_ids` and per-choice `token_ids`;
asked `logprobs`, one `logprobs.content[]` entry per completion token; each answer names its
policy version in `x-policy-version`. Token ids are the bytes of the JSON of the messages
(prompt) and of the tool call (completion). It serves /v1/models without `max_model_len`,
so the gateway leaves budgets to it. Every request body is kept in `requests`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from harnessrl.http import HttpServer, Request, Response, json_error

TOOL = "bash"
_JSON = ("content-type", "application/json")
_LOGPROBS = [
    {"token": chr(b), "logprob": -0.25, "bytes": [b], "top_logprobs": []} for b in range(256)
]


class ScriptedEngine:
    """See the module docstring; `start()` it, then point a gateway at `url`."""

    def __init__(self, commands: Sequence[str], model: str = "policy") -> None:
        if not commands:
            raise ValueError("commands: the script needs at least one command")
        self.commands = list(commands)
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._server: HttpServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        return f"http://127.0.0.1:{self._server.port}"

    async def start(self) -> None:
        self._server = HttpServer(self._handle, host="127.0.0.1", port=0)
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace_s=1.0)
            self._server = None

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """The chat completion for a request body: the script's next command as a tool call."""
        messages = request.get("messages") or []
        step = sum(1 for m in messages if m.get("role") == "assistant")
        command = self.commands[min(step, len(self.commands) - 1)]
        arguments = orjson.dumps({"command": command}).decode()
        function = {"name": TOOL, "arguments": arguments}
        call = {"id": f"call_{step}", "type": "function", "function": function}
        content = f"Step {step + 1}: I run a command."
        message = {"role": "assistant", "content": content, "tool_calls": [call]}
        prompt = orjson.dumps(messages)
        completion = f'{content}<tool_call>{{"name": "{TOOL}", "arguments": {arguments}}}'
        completion_ids = list(completion.encode())
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": "tool_calls",
            "logprobs": None,
        }
        body: dict[str, Any] = {
            "id": f"chatcmpl-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": request.get("model") or self.model,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(completion_ids),
                "total_tokens": len(prompt) + len(completion_ids),
            },
        }
        if request.get("return_token_ids") is True:
            body["prompt_token_ids"] = list(prompt)
            choice["token_ids"] = completion_ids
        if request.get("logprobs") is True:
            choice["logprobs"] = {"content": [_LOGPROBS[b] for b in completion_ids]}
        return body

    async def _handle(self, request: Request) -> Response:
        if request.method == "GET" and request.path == "/v1/models":
            listing = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            return Response(200, [_JSON], orjson.dumps(listing))
        if request.method != "POST" or request.path != "/v1/chat/completions":
            return json_error(404, f"{request.method} {request.path}: not served")
        body = orjson.loads(request.body)
        self.requests.append(body)
        answer = orjson.dumps(self.answer(body))
        return Response(200, [_JSON, ("x-policy-version", "0")], answer)
